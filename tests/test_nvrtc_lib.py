"""jit_kernels.nvrtc_lib, NVRTC through ctypes (a cold first call imports no cuda-python
before its compile, ~0.1 s on the H200 host): the library is the one cuda-bindings loads,
a kernel compiles to the SASS, lowered name and log cuda-bindings' NVRTC gives, a failed
compile returns its log, the calls release the GIL, and no cuda-python module is imported."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jit_kernels import compile as compile_mod
from jit_kernels import nvrtc_lib, render
from jit_kernels.params import cuobjdump
from jit_kernels.spec import KernelSpec

from .test_ptxas import _sass

REPO = Path(__file__).resolve().parent.parent
SPEC = KernelSpec(
    "mla_kv_pack",
    "mla_kv_pack/sm90_warp_cvt.cuh",
    "fij_mla::concat_mla_kv_quant_fp8",
    (("num_heads", 0), ("unroll", 4)),
)


@pytest.fixture(scope="module")
def bindings():
    """cuda-bindings' NVRTC, loaded (the reference); skips where there is none."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        nvrtc_lib.library()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no NVRTC library: {exc!r}")
    return nvrtc


def _through_bindings(nvrtc, rendered, arch: str) -> tuple[bytes, str, str]:
    """What compile._compile_nvrtc did through cuda-bindings (before nvrtc_lib)."""
    names = [n.encode() for n, _ in rendered.headers]
    texts = [t.encode() for _, t in rendered.headers]
    _, prog = nvrtc.nvrtcCreateProgram(
        rendered.source.encode(), rendered.filename.encode(), len(names), texts, names
    )
    expression = rendered.spec.name_expression.encode()
    nvrtc.nvrtcAddNameExpression(prog, expression)
    options = [f"--gpu-architecture={arch}".encode()]
    options += [o.encode() for o in compile_mod.NVRTC_OPTIONS]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS
    _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
    log = bytearray(log_size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    _, lowered = nvrtc.nvrtcGetLoweredName(prog, expression)
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = bytearray(size)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(prog)
    return bytes(cubin), lowered.decode(), log.rstrip(b"\0").decode().strip()


def test_the_library_is_the_one_cuda_bindings_loads(bindings):
    _, major, minor = bindings.nvrtcVersion()
    assert nvrtc_lib.version() == (major, minor)
    assert compile_mod.nvrtc_version() == f"{major}.{minor}"
    path = nvrtc_lib.wheel_library()
    if path is not None:  # pathfinder (cuda-bindings' loader) finds a wheel's library first
        from cuda.pathfinder import load_nvidia_dynamic_lib

        assert os.path.samefile(path, load_nvidia_dynamic_lib("nvrtc").abs_path)


def test_the_release_is_the_wheel_s_or_the_file_s(bindings, tmp_path, monkeypatch):
    """nvrtcVersion names major.minor only; a key needs the patch release too."""
    path = nvrtc_lib.wheel_library()
    if path is not None:  # the library is that wheel's file: its version, 13.5.37 say
        assert nvrtc_lib.release() == compile_mod.installed_nvrtc_version()
        assert nvrtc_lib.release().count(".") == 2
    other = tmp_path / "libnvrtc.so.13"  # a library of no wheel: named by its file
    other.write_bytes(b"x" * 10)
    monkeypatch.setattr(nvrtc_lib, "_load", lambda: (None, str(other)))
    nvrtc_lib.release.cache_clear()
    try:
        major, minor = nvrtc_lib.version()
        assert nvrtc_lib.release() == f"{major}.{minor}+10.{other.stat().st_mtime_ns}"
    finally:
        nvrtc_lib.release.cache_clear()


def test_a_kernel_compiles_as_through_cuda_bindings(bindings, tmp_path):
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    rendered = render(SPEC, REPO / "templates")
    for arch in ("sm_90a", "sm_100a"):
        cubin, lowered, log = compile_mod._compile_nvrtc(rendered, arch)
        reference = _through_bindings(bindings, rendered, arch)
        assert (lowered, log) == reference[1:]
        sass = _sass(tool, cubin, tmp_path)
        assert sass == _sass(tool, reference[0], tmp_path) and sum(map(len, sass.values())) > 50


def test_a_failed_compile_returns_its_log(bindings):
    binary, lowered, log = nvrtc_lib.compile_program(
        b"__global__ void k() { not_declared(); }", b"bad.cu", [], b"k", [], "CUBIN"
    )
    assert binary is None and lowered == "" and "not_declared" in log
    with pytest.raises(RuntimeError, match=r"nvrtcGetPTX failed: NVRTC_ERROR_COMPILATION \(6\)"):
        nvrtc_lib._check(6, "nvrtcGetPTX")  # another call's error: named by NVRTC


def test_the_calls_release_the_gil(bindings):
    """ctypes releases the GIL in a CDLL's functions (not a PyDLL's): a first call's kernels
    compile in parallel threads (jit_kernels.prepare)."""
    lib = nvrtc_lib.library()
    assert not isinstance(lib, ctypes.PyDLL)
    assert not lib.nvrtcCompileProgram._flags_ & ctypes._FUNCFLAG_PYTHONAPI


NO_CUDA_PYTHON = """
import importlib.util, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "cuda" or name.startswith("cuda."):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Refuse())
spec = importlib.util.spec_from_file_location("nvrtc_lib", sys.argv[1])
lib = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lib)
ptx, lowered, log = lib.compile_program(
    b"__global__ void k(int* x) { *x = 1; }", b"k.cu", [], b"k", [b"-arch=compute_90a"], "PTX"
)
assert ptx.startswith(b"//") and lowered == "_Z1kPi", (ptx[:40], lowered)
print(lib.version())
"""


def test_a_compile_imports_no_cuda_python(bindings):
    if nvrtc_lib.wheel_library() is None:
        pytest.skip("no NVRTC wheel: the library is found through cuda.pathfinder")
    source = str(REPO / "jit_kernels" / "nvrtc_lib.py")
    run = subprocess.run(
        [sys.executable, "-c", NO_CUDA_PYTHON, source], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
