"""prebuild's shared PTX (jit_kernels.ptxas): which archs share one NVRTC front end and
optimizer, and that ptxas assembles the SASS NVRTC itself gives (issue 21, item 2)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flashinfer_jit import cli
from flashinfer_jit._jit import TEMPLATE_ROOT
from flashinfer_jit._version import __version__
from jit_kernels import CubinCache, KernelBuilder, compile_cubin, ptxas, render
from jit_kernels.compile import compile_ptx
from jit_kernels.params import cuobjdump
from jit_kernels.prebuild import BuildTask, _jobs, build_all
from jit_kernels.spec import KernelSpec

TWINS = ("sm_100a", "sm_103a")
# One cheap specialization per template the twins share (the templates' own SASS differs).
SAMPLE = ("mla_kv_pack", "mqa_logits_clean", "mqa_logits_schedule", "qsa_slots")


def _samples() -> list[KernelSpec]:
    specs = {}
    for task in cli._tasks(None, TWINS[:1], None):
        specs.setdefault(task.spec.family, task.spec)
    return [specs[family] for family in SAMPLE]


def _needs_ptxas() -> str:
    pytest.importorskip("cuda.bindings.nvrtc")
    if ptxas.ptxas_path() is None:
        pytest.skip("no ptxas of the installed NVRTC's release (pip install nvidia-cuda-nvcc)")
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    return tool


def _sass(tool: str, cubin: bytes, folder: Path) -> dict[str, list[str]]:
    """Function -> its SASS instructions (addresses and encodings dropped)."""
    path = folder / "k.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        name = re.search(r"Function : (\S+)", line)
        if name:
            current = functions.setdefault(name.group(1), [])
        elif instruction := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", line):
            current.append(instruction.group(1))
    return functions


def test_jobs_put_twins_together():
    """One job per spec and PTX: sm_100a with sm_103a; sm_90a and sm_107a alone."""
    spec = KernelSpec("f", "t.cuh", "k", (("n", 1),))
    other = KernelSpec("f", "t.cuh", "k", (("n", 2),))
    archs = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    tasks = [BuildTask("op", s, arch) for s in (spec, other) for arch in archs]
    jobs = [[(t.spec, t.arch) for t in job] for job in _jobs(tasks)]
    assert jobs == [
        [(spec, "sm_90a")],
        [(spec, "sm_100a"), (spec, "sm_103a")],
        [(spec, "sm_107a")],
        [(other, "sm_90a")],
        [(other, "sm_100a"), (other, "sm_103a")],
        [(other, "sm_107a")],
    ]
    assert ptxas.ptx_source("sm_107a") == "sm_107a"  # its PTX differs (module docstring)


def test_families_may_make_sm_107a_a_twin():
    """A family that declares sm_107a its twin (ptx_twins) builds it in sm_100a's job."""
    twins = (("sm_107a", "sm_100a"),)
    spec = KernelSpec("f", "t.cuh", "k", (("n", 1),), ptx_twins=twins)
    assert spec == KernelSpec("f", "t.cuh", "k", (("n", 1),))  # derived, not compared
    archs = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    jobs = [[t.arch for t in job] for job in _jobs([BuildTask("op", spec, a) for a in archs])]
    assert jobs == [["sm_90a"], ["sm_100a", "sm_103a", "sm_107a"]]
    assert ptxas.ptx_source("sm_107a", spec) == "sm_100a"


def _ptx_without_names(rendered, arch: str) -> str:
    internal = re.compile(r"_INTERNAL_\w+?_cu_[0-9a-f]+_\d+|\.target \S+")
    return internal.sub("", compile_ptx(rendered, arch)[0].decode())


def _sm107a_twins() -> list[KernelSpec]:
    """The first shipped spec of each family declaring sm_107a a twin, and qsa_slots."""
    specs = {}
    for task in cli._tasks(None, ("sm_107a",), None):
        if task.spec.ptx_twins or task.spec.family == "qsa_slots":
            specs.setdefault(task.spec.family, task.spec)
    return list(specs.values())


@pytest.mark.parametrize("spec", _sm107a_twins(), ids=lambda s: s.family)
def test_sm_107a_twins_take_sm_100a_ptx(spec):
    """Where a family declares sm_107a sm_100a's twin, NVRTC's PTX of the two is the same
    (every shipped spec compared once, docs/prebuild-time.md; one here); qsa_slots's is not,
    so it declares nothing."""
    pytest.importorskip("cuda.bindings.nvrtc")
    rendered = render(spec, TEMPLATE_ROOT)
    same = _ptx_without_names(rendered, "sm_100a") == _ptx_without_names(rendered, "sm_107a")
    assert same == bool(spec.ptx_twins), spec.label
    assert bool(spec.ptx_twins) == (spec.family != "qsa_slots")


def test_ptxas_gives_sm_107a_nvrtcs_sass_from_sm_100a_ptx(tmp_path):
    tool = _needs_ptxas()
    spec = next(s for s in _sm107a_twins() if s.family == "qsa_decode_form")
    rendered = render(spec, TEMPLATE_ROOT)
    assembled = ptxas.SharedPtx(rendered, ("sm_100a", "sm_107a")).compile("sm_107a")
    direct = compile_cubin(rendered, "sm_107a")
    assert _sass(tool, assembled.cubin, tmp_path) == _sass(tool, direct.cubin, tmp_path)


def test_ptxas_of_another_release_is_not_used(monkeypatch):
    ptxas.ptxas_path.cache_clear()
    monkeypatch.setattr(ptxas, "_reported_release", lambda path: "0.0.1")
    try:
        assert ptxas.ptxas_path() is None
    finally:
        ptxas.ptxas_path.cache_clear()


@pytest.mark.parametrize("spec", _samples(), ids=lambda s: s.family)
def test_twins_take_one_ptx_and_ptxas_gives_nvrtcs_sass(spec, tmp_path):
    """NVRTC's PTX for sm_103a is sm_100a's but for the .target line and internal names, and
    ptxas on sm_100a's PTX gives each twin the SASS NVRTC gives it."""
    tool = _needs_ptxas()
    rendered = render(spec, TEMPLATE_ROOT)
    texts = [compile_ptx(rendered, arch)[0].decode() for arch in TWINS]
    internal = re.compile(r"_INTERNAL_\w+?_cu_[0-9a-f]+_\d+|\.target \S+")
    assert internal.sub("", texts[0]) == internal.sub("", texts[1])
    shared = ptxas.SharedPtx(rendered, TWINS)
    for arch in TWINS:
        direct = compile_cubin(rendered, arch)
        assembled = shared.compile(arch)
        assert assembled.entry == direct.entry
        assert _sass(tool, assembled.cubin, tmp_path) == _sass(tool, direct.cubin, tmp_path)


def test_prebuild_compiles_one_ptx_for_the_twins(tmp_path, monkeypatch):
    """A prebuild of one spec for both twins runs NVRTC once (to PTX) and stores one verified
    entry per arch, under the keys an NVRTC compile would have."""
    _needs_ptxas()
    spec = _samples()[0]
    calls = []
    real = ptxas.compile_ptx
    monkeypatch.setattr(ptxas, "compile_ptx", lambda *a: calls.append(a[1]) or real(*a))
    monkeypatch.setattr("jit_kernels.build.compile_cubin", lambda *a: pytest.fail("NVRTC cubin"))
    tasks = [BuildTask("op", spec, arch) for arch in TWINS]
    results = list(build_all(tasks, TEMPLATE_ROOT, __version__, 1, output=tmp_path))
    assert [r.status for r in results] == ["compiled", "compiled"] and calls == ["sm_100a"]
    cache = CubinCache(tmp_path, [], __version__)
    builder = KernelBuilder(TEMPLATE_ROOT, __version__, cache)
    for arch in TWINS:
        assert cache.lookup(arch, spec.family, builder.cache_key(spec, arch), spec.label)
