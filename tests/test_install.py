"""The install beside serving engines: the wheel's requirements (no compiler pinned), pip's
resolver beside vLLM's nvidia-cutlass-dsl==4.7.1, the CuTe-DSL release policy, and what a
kernel family does when it has no compiler or the driver rejects a cubin."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from jit_kernels import KernelUnavailable
from jit_kernels import cache as jcache
from jit_kernels import compile as jc
from jit_kernels import family as jf

REPO = Path(__file__).resolve().parent.parent
ENGINE_PIN = "nvidia-cutlass-dsl==4.7.1"  # vLLM's pin


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)]
    subprocess.run(pip, check=True)
    (built,) = out.glob("flashinfer_jit-*.whl")
    return built


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(name).decode()
    return [
        line.split(":", 1)[1].strip()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:")
    ]


def test_wheel_requires_no_compiler(wheel):
    reqs = requires(wheel)
    base = [r for r in reqs if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("nvidia-cutlass-dsl", "nvidia-cuda-nvrtc"))], base
    extras = {e: [r for r in reqs if f"extra == '{e}'" in r] for e in ("cake", "cu12", "cu13")}
    assert extras["cake"] == [f"nvidia-cutlass-dsl=={jc.CUTE_DSL_PINNED_VERSION}; extra == 'cake'"]
    assert any(r.startswith("nvidia-cuda-nvrtc-cu12") for r in extras["cu12"])
    assert any(re.match(r"cuda-python<13", r) for r in extras["cu12"])
    assert any(r.startswith("nvidia-cuda-nvrtc>=13") for r in extras["cu13"])
    assert any(r.startswith("nvidia-cuda-nvcc>=13") for r in reqs if "extra == 'prebuild'" in r)


def _dry_run(*targets: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """pip's resolution as in a fresh environment: --ignore-installed, so what this
    environment already holds (the package itself, under CI) is resolved and reported too."""
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
    cmd += ["--report", str(report)]
    return subprocess.run([*cmd, *targets], capture_output=True, text=True, timeout=300)


def test_resolves_beside_the_engine_pin(wheel, tmp_path):
    """pip's resolver (with dependencies: not --no-deps) installs the package beside
    nvidia-cutlass-dsl==4.7.1; with the cake extra the two conflict, as documented."""
    res = _dry_run(str(wheel), ENGINE_PIN, tmp_path=tmp_path)
    if res.returncode and "No matching distribution found for nvidia-cutlass-dsl" in res.stderr:
        pytest.skip("nvidia-cutlass-dsl 4.7.1 is not obtainable from this machine's indexes")
    assert res.returncode == 0, res.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    got = {i["metadata"]["name"]: i["metadata"]["version"] for i in report["install"]}
    assert got.get("nvidia-cutlass-dsl") == "4.7.1" and "flashinfer-jit" in got
    res = _dry_run(f"{wheel}[cake]", ENGINE_PIN, tmp_path=tmp_path)
    assert res.returncode != 0 and "ResolutionImpossible" in res.stderr


def test_readme_ci_commands_install_the_extras():
    readme = (REPO / "README.md").read_text()
    for marker in ("main-job", "tests"):
        command = readme.split(f"<!-- ci:{marker} -->\n```\n", 1)[1].split("\n", 1)[0]
        assert re.search(r'pip install "?\.\[[^]]*cu13[^]]*\]', command), command
        assert "cake" in command, command
        assert marker != "main-job" or "prebuild" in command, command  # its ptxas (issue 21)


@pytest.mark.parametrize(
    "installed,expect",
    [(None, "not installed"), ("4.7.1", "4.7.1 is installed"), (jc.CUTE_DSL_PINNED_VERSION, None)],
)
def test_cute_dsl_release_policy(monkeypatch, installed, expect):
    import importlib.metadata as md

    def version(name):
        if installed is None:
            raise md.PackageNotFoundError(name)
        return installed

    monkeypatch.setattr(md, "version", version)
    why = jc.cute_dsl_refusal()
    assert why is None if expect is None else (expect in why and "flashinfer-jit[cake]" in why)
    # The cache key names the pinned release whatever is installed: bundles are found.
    assert jc.compiler_identity("cute") == f"cutlass-dsl {jc.CUTE_DSL_PINNED_VERSION}"


def test_family_remembers_a_missing_compiler(monkeypatch, jit_cache):
    """No usable DSL: the cake family raises KernelUnavailable with the reason, once built,
    then at once (auto then serves from specialized without retrying)."""
    from flashinfer_jit.mla_kv_pack import cake

    monkeypatch.setattr(jc, "cute_dsl_refusal", lambda: "nvidia-cutlass-dsl 4.7.1 is installed")
    monkeypatch.setattr(jf, "device_arch", lambda device: "sm_90a")
    family = cake.family
    monkeypatch.setattr(family, "_refused", {})
    builds = []
    real_build = family.builder.build
    monkeypatch.setattr(family.builder, "build", lambda *a: builds.append(a) or real_build(*a))
    for _ in range(3):
        with pytest.raises(KernelUnavailable, match="4.7.1 is installed"):
            family.get((2,), 0)
    assert len(builds) == 1


def test_a_cubin_the_driver_rejects_is_unavailable(monkeypatch, jit_cache):
    """cuLibraryLoadData failing (a cubin from a newer CUDA) is KernelUnavailable naming the
    extra to install, never an exception the op does not expect."""
    import flashinfer_jit.mqa_logits.schedule as ms
    from jit_kernels import launch

    def reject(*args):
        raise launch.LaunchError("cuLibraryLoadData failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION")

    monkeypatch.setattr(jf, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(jf, "LoadedKernel", reject)
    monkeypatch.setattr(jf, "driver_mismatch", lambda compiler: "; install cu12")
    family = ms.schedule_family
    monkeypatch.setattr(family, "_refused", {})
    for _ in range(2):
        with pytest.raises(KernelUnavailable, match="driver cannot load .*install cu12"):
            family.get((256,), 0)


def test_driver_mismatch_hint(monkeypatch):
    from cuda.bindings import driver

    from jit_kernels import launch

    monkeypatch.setattr(launch, "nvrtc_version", lambda: "13.5")
    monkeypatch.setattr(driver, "cuDriverGetVersion", lambda: (0, 12080))
    assert "flashinfer-jit[cu12]" in launch.driver_mismatch("nvrtc")
    assert launch.driver_mismatch("cute") == ""
    monkeypatch.setattr(driver, "cuDriverGetVersion", lambda: (0, 13000))
    assert launch.driver_mismatch("nvrtc") == ""


@pytest.mark.gpu
def test_gpu_auto_serves_from_specialized_without_the_dsl(monkeypatch, jit_cache):
    """No usable DSL and no bundle: auto gives the specialized kernel's (bit-exact) result,
    cake falls back with one message naming the extra (an error in strict mode)."""
    import torch

    from flashinfer_jit import mla_kv_pack as mkp
    from flashinfer_jit.mla_kv_pack import cake
    from jit_kernels import FallbackError

    monkeypatch.setattr(jc, "cute_dsl_refusal", lambda: "nvidia-cutlass-dsl is not installed")
    monkeypatch.setattr(cake.family, "_loaded", {})
    monkeypatch.setattr(cake.family, "_refused", {})
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    monkeypatch.delenv(jcache.CUBIN_PATH_ENV, raising=False)  # no bundle either
    torch.manual_seed(0)
    kv_nope = torch.randn(4096, 16, 256, device="cuda", dtype=torch.bfloat16) * 40
    k_pe = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16) * 40
    assert mkp.auto_order(4096, 16)[0] == "cake"  # auto tries cake first here
    want = mkp.concat_mla_kv_quant_fp8(kv_nope, k_pe, backend="specialized")
    for _ in range(2):
        got = mkp.concat_mla_kv_quant_fp8(kv_nope, k_pe, backend="auto")
        assert all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for a, b in zip(got, want, strict=True)
        )
    with pytest.raises(FallbackError, match="nvidia-cutlass-dsl is not installed"):
        mkp.concat_mla_kv_quant_fp8(kv_nope, k_pe, backend="cake")
