"""The compiled launcher (jit_kernels.native, _launcher.c) without a GPU: it builds, caches
and imports; a broken or missing compiler and the switch fall back to cuda-python; its
driver types match cuda.h; against a stand-in libcuda it passes every argument through
(``launch`` and the bound launches, which pack them in C onto the members bound at
binding, byte for byte as ArgPacker's struct does) and LoadedKernel turns a driver error
into LaunchError; without it a bound launch merges its members and calls ``launch``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path

import pytest

from jit_kernels import native
from jit_kernels.launch import PER_CALL, ArgPacker, LoadedKernel
from jit_kernels.prebuild import build_native

REPO = Path(__file__).resolve().parent.parent
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")
needs_cc = pytest.mark.skipif(
    not shutil.which(native.compiler()[0]), reason="no C compiler on this machine"
)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache, no bundles, the switch unset and nothing resolved yet."""
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("FLASHINFER_JIT_CUBIN_PATH", native.NATIVE_ENV, "CC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(native, "_resolved", [])
    return tmp_path / "cache"


@needs_cc
def test_builds_once_into_the_cache_and_imports(fresh, monkeypatch):
    module = native.launcher()
    assert module is not None and callable(module.launch) and callable(module.launch_programmatic)
    (built,) = (fresh / "native").glob(f"_launcher-*{SUFFIX}")
    assert built.name == native.file_name() and native.find() == built
    assert native.launcher() is module  # resolved once per process
    monkeypatch.setattr(native, "_resolved", [])
    monkeypatch.setenv("CC", "/bin/false")  # a second process finds it: no compiler runs
    assert native.launcher() is not None


@needs_cc
def test_a_bundle_is_searched_first(fresh, tmp_path, monkeypatch):
    assert build_native(tmp_path / "bundle")[0] == "built"
    assert build_native(tmp_path / "bundle")[0] == "cached"
    monkeypatch.setenv("FLASHINFER_JIT_CUBIN_PATH", str(tmp_path / "bundle"))
    assert native.find() == tmp_path / "bundle" / "native" / native.file_name()
    assert native.launcher() is not None and not (fresh / "native").exists()


@needs_cc
def test_resolving_in_the_background_builds_once(fresh, monkeypatch):
    monkeypatch.setattr(native, "_started", [])
    native.resolve_in_background()
    native.resolve_in_background()  # one thread a process
    module = native.launcher()  # waits for that thread's build (or builds, the thread waits)
    assert module is not None and callable(module.Bound)
    assert len(list((fresh / "native").glob(f"_launcher-*{SUFFIX}"))) == 1


@needs_cc
def test_not_waiting_leaves_the_build_to_a_thread(fresh, monkeypatch):
    """launcher(wait=False) (the cluster occupancy probe, before a first call's compile):
    None at once while the launcher is still to be built, its build on a thread; the load
    after the compile (launcher()) waits for it. Built already (a warm first call): the
    module, loaded at once, no thread."""
    monkeypatch.setattr(native, "_started", [])
    compiling, release, compile_ = threading.Event(), threading.Event(), native._compile

    def held(target):
        compiling.set()
        release.wait(60)
        compile_(target)

    monkeypatch.setattr(native, "_compile", held)
    assert native.launcher(wait=False) is None
    assert compiling.wait(60)  # on the thread
    assert native.launcher(wait=False) is None  # still building: not waited for
    release.set()
    module = native.launcher()
    assert module is not None and native.launcher(wait=False) is module
    monkeypatch.setattr(native, "_resolved", [])
    monkeypatch.setattr(native, "_started", [])
    assert native.launcher(wait=False) is not None and not native._started


@pytest.mark.parametrize(
    "cc, level", [("/bin/false", logging.WARNING), ("/nonexistent/cc", logging.INFO)]
)
def test_a_broken_compiler_falls_back_once(fresh, monkeypatch, caplog, cc, level):
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.INFO, logger="flashinfer_jit.jit"):
        assert native.launcher() is None
        assert native.launcher() is None
    (record,) = [r for r in caplog.records if "native launcher" in r.message]
    assert record.levelno == level and "cuda-python" in record.message
    left = [p.name for p in (fresh / "native").iterdir()]
    assert left == [f"{native.file_name()}.lock"]  # no partial build left
    assert build_native(None)[0] == ("failed" if level == logging.WARNING else "skipped")


def test_the_switch_turns_it_off(fresh, monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    monkeypatch.setattr(native, "_started", [])
    assert native.launcher() is None and not fresh.exists()
    assert native.launcher(wait=False) is None and not native._started
    assert build_native(None) == ("skipped", f"{native.NATIVE_ENV}=0")
    kernel = LoadedKernel.__new__(LoadedKernel)
    kernel._bind(0x1234, native.launcher())
    assert kernel._native is None and kernel._native_pdl is None  # cuda-python launches


def test_a_bound_launch_without_the_launcher_merges_its_members():
    class Recording(LoadedKernel):
        __slots__ = ("seen",)

        def launch(self, grid, block, stream, args, smem=0):
            self.seen = (grid, block, stream, args, smem)

    kernel = Recording.__new__(Recording)
    kernel.name, kernel.device, kernel.packer = "k", 0, ArgPacker(("P", "i", "q"))
    kernel._bind(0x1234, None)
    bound = kernel.bind((1, 1, 1), (32, 1, 1), 0, False, (PER_CALL, 5, PER_CALL))
    bound(7, (0xAB, -3))
    assert kernel.seen == ((1, 1, 1), (32, 1, 1), 7, (0xAB, 5, -3), 0)
    with pytest.raises(TypeError, match="takes 2 values, got 3"):
        bound(7, (0xAB, -3, 1))


def test_an_insecure_cache_is_refused(fresh, caplog):
    (fresh / "native").mkdir(parents=True)
    os.chmod(fresh / "native", 0o777)
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit.jit"):
        assert native.launcher() is None
    assert "writable by other users" in caplog.text


def _cuda_header() -> Path | None:
    """A cuda.h: the toolkit's, else the nvidia-cuda-runtime wheel's."""
    roots = [os.environ.get("CUDA_HOME"), "/usr/local/cuda", *Path("/usr/local").glob("cuda-*")]
    roots += [Path(p) / "nvidia" / "cu13" for p in sys.path if p.endswith("site-packages")]
    headers = [Path(root) / "include" / "cuda.h" for root in roots if root]
    return next((header for header in headers if header.exists()), None)


@needs_cc
def test_the_declared_driver_types_match_cuda_h(fresh, tmp_path):
    header = _cuda_header()
    if header is None:
        pytest.skip("no cuda.h installed")
    probe = tmp_path / "layout.c"
    probe.write_text(
        textwrap.dedent("""
        #include <cuda.h>
        #include <stddef.h>
        #include <stdio.h>
        int main(void) {
          printf("{\\"CUlaunchConfig\\": %zu, \\"CUlaunchConfig.hStream\\": %zu, "
                 "\\"CUlaunchConfig.attrs\\": %zu, \\"CUlaunchConfig.numAttrs\\": %zu, "
                 "\\"CUlaunchAttribute\\": %zu, \\"CUlaunchAttribute.value\\": %zu, "
                 "\\"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\\": %d}",
                 sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream),
                 offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),
                 sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
                 (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
          return 0;
        }
        """)
    )
    exe = tmp_path / "layout"
    subprocess.run(
        [*native.compiler(), f"-I{header.parent}", str(probe), "-o", str(exe)], check=True
    )
    expected = json.loads(subprocess.run([str(exe)], capture_output=True, check=True).stdout)
    assert native.launcher().layout() == expected


def test_a_launch_without_a_driver_raises(fresh):
    import ctypes.util

    if ctypes.util.find_library("cuda") or Path("/dev/nvidiactl").exists():
        pytest.skip("this machine has a CUDA driver")
    module = native.launcher()
    if module is None:
        pytest.skip("no native launcher here")
    for launch in (module.launch, module.launch_programmatic):
        with pytest.raises(RuntimeError, match="libcuda.so.1"):
            launch(1, 1, 1, 1, 32, 1, 1, 0, 0, 0)


# -- against a stand-in libcuda (in a subprocess: it stays loaded) -----------------------------
FAKE_DRIVER = """
/* cuLaunchKernel / cuLaunchKernelEx that record their arguments; the config is read at
   cuda.h's offsets (hStream 32, attrs 40, numAttrs 48; an attribute's value at 8). */
#include <string.h>
int result, nparams, nbytes;
unsigned long long last[13];
long long offsets[16];  /* each parameter's offset from the first, and the buffer's bytes, */
unsigned char data[4096];  /* copied during the call: a bound launch's buffer is its stack */
static void record(void **params) {
  for (int i = 0; i < nparams; ++i) offsets[i] = (char *)params[i] - (char *)params[0];
  memcpy(data, params[0], nbytes);
}
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra) {
  record(params);
  unsigned long long v[13] = {(unsigned long long)f, gx, gy, gz, bx, by, bz, smem,
                              (unsigned long long)stream, (unsigned long long)params,
                              (unsigned long long)extra, 0, 0};
  memcpy(last, v, sizeof v);
  return result;
}
int cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
  record(params);
  const unsigned *dims = (const unsigned *)config;
  const char *attrs = *(char *const *)((const char *)config + 40);
  unsigned long long v[13] = {(unsigned long long)f, dims[0], dims[1], dims[2], dims[3],
                              dims[4], dims[5], dims[6],
                              *(unsigned long long *)((const char *)config + 32),
                              (unsigned long long)params, (unsigned long long)extra,
                              *(const int *)attrs, *(const int *)(attrs + 8)};
  memcpy(last, v, sizeof v);
  return *(const unsigned *)((const char *)config + 48) == 1 ? result : -1;
}
"""

DRIVE = """
import ctypes, json, sys
from pathlib import Path
fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # dlopen("libcuda.so.1") finds it
from jit_kernels import native
from jit_kernels.launch import PER_CALL, ArgPacker, LaunchError, LoadedKernel
kernel = LoadedKernel.__new__(LoadedKernel)
signature = ("P", "i", "Piq", "f", "I", "q", "M")
kernel.name, kernel.device, kernel.packer = "fake_kernel", 0, ArgPacker(signature)
kernel._bind(0x1234, native.load(Path(sys.argv[2])))
values = (0xDEADBEEF, -7, 7, 9, -11, 1.5, 4000000000, -(1 << 40), bytes(range(100)))
ctypes.c_int.in_dll(fake, "nparams").value = len(signature)
ctypes.c_int.in_dll(fake, "nbytes").value = kernel.packer.struct.size
last, seen = (ctypes.c_uint64 * 13).in_dll(fake, "last"), {}
offsets, data = (ctypes.c_int64 * 16).in_dll(fake, "offsets"), (ctypes.c_ubyte * 4096).in_dll(fake, "data")
launches = {"launch": lambda *a, **k: kernel.launch(*a, **k),
            "launch_programmatic": lambda *a, **k: kernel.launch_programmatic(*a, **k),
            "bind": lambda g, b, s, v, smem=0: kernel.bind(g, b, smem)(s, v),
            "bind programmatic": lambda g, b, s, v, smem=0: kernel.bind(g, b, smem, True)(s, v)}
fixed = tuple(PER_CALL if i % 3 == 0 else v for i, v in enumerate(values))  # some bound
per_call = values[::3]
launches["bind template"] = lambda g, b, s, v, smem=0: kernel.bind(g, b, smem, False, fixed)(
    s, per_call)
for name, go in launches.items():
    go((2, 3, 4), (128, 1, 2), 0x5678, values, smem=99)
    packed = bytes(data[: kernel.packer.struct.size])
    seen[name] = [*last[:9], *last[10:], list(offsets[: len(signature)]), packed.hex()]
seen["expected"] = [list(kernel.packer.offsets), kernel.packer.struct.pack(*values).hex()]
ctypes.c_int.in_dll(fake, "result").value = 700
for name, go in launches.items():
    try:
        go((1, 1, 1), (32, 1, 1), 0, values)
    except LaunchError as exc:
        seen[name + " error"] = str(exc)
ctypes.c_int.in_dll(fake, "result").value = 0
for bad in (values[:-1], (*values[:3], 1 << 31, *values[4:]), (*values[:5], "x", *values[6:])):
    try:
        kernel.bind((1, 1, 1), (32, 1, 1))(0, bad)
    except (TypeError, OverflowError) as exc:
        seen.setdefault("refused", []).append(type(exc).__name__)
big = LoadedKernel.__new__(LoadedKernel)  # more parameter bytes than a bound launch packs
big.name, big.device, big.packer = "big", 0, ArgPacker(("M",) * 40)
big._bind(0x1234, native.load(Path(sys.argv[2])))
seen["big"] = type(big.bind((1, 1, 1), (32, 1, 1))).__name__
print(json.dumps(seen))
"""


@needs_cc
def test_arguments_reach_the_driver_and_errors_raise_launch_error(tmp_path):
    source = tmp_path / "fake_cuda.c"
    source.write_text(FAKE_DRIVER)
    fake = tmp_path / "libcuda.so.1"
    subprocess.run(
        [*native.compiler(), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(source), "-o", str(fake)],
        check=True,
    )  # fmt: skip
    launcher, _ = native.build(tmp_path / "cache")
    run = subprocess.run(
        [sys.executable, "-c", DRIVE, str(fake), str(launcher)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    dims = [0x1234, 2, 3, 4, 128, 1, 2, 99, 0x5678]
    plain, programmatic = [*dims, 0, 0, 0], [*dims, 0, 6, 1]  # extra NULL; PDL allowed
    for name, config in (("launch", plain), ("launch_programmatic", programmatic),
                         ("bind", plain), ("bind programmatic", programmatic),
                         ("bind template", plain)):  # fmt: skip
        # every path packs the bytes ArgPacker's struct lays out, at its offsets
        assert seen[name] == [*config, *seen["expected"]], name
        message = seen[name + " error"]
        assert "fake_kernel" in message and "CUDA_ERROR_ILLEGAL_ADDRESS: 700" in message
        assert ("(programmatic)" in message) == (config is programmatic)
    assert seen["refused"] == ["TypeError", "OverflowError", "TypeError"]
    assert seen["big"] == "function"  # launches through LoadedKernel.launch instead


@needs_cc
@pytest.mark.parametrize("damage", ["truncate", "folder", "no record"])
def test_a_corrupt_launcher_is_rebuilt_and_verify_reports_it(fresh, monkeypatch, damage):
    from jit_kernels import CubinCache, cache_admin

    path, built = native.build(fresh)
    assert built and native.launcher_problem(path) is None
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "folder":
        path.unlink()
        path.mkdir()
    else:
        path.with_name(path.name + ".json").unlink()
    (found,) = [p for p in cache_admin.other_problems(CubinCache(fresh, [], "0"), fresh)]
    assert found.path == path and found.what != "ok"
    monkeypatch.setattr(native, "_resolved", [])
    assert native.launcher() is not None  # rebuilt, not a fallback for good
    assert path.is_file() and native.launcher_problem(path) is None
