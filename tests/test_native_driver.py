"""jit_kernels.driver through the compiled launcher (_launcher_driver.h): against a stand-in
libcuda every call reaches the driver with the caller's values and returns what the driver
gave, a driver error raises LaunchError naming the call, and the attribute numbers are
cuda-python's. (A first call loads its kernels this way without importing cuda-python's
driver module; the H200 runs the real driver through the GPU tests.)"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from jit_kernels import driver as cu
from jit_kernels import native

REPO = Path(__file__).resolve().parent.parent
needs_cc = pytest.mark.skipif(
    not shutil.which(native.compiler()[0]), reason="no C compiler on this machine"
)

FAKE_DRIVER = """
#include <string.h>
int result;                /* what every call returns */
char seen_name[64];        /* the last entry name asked for */
unsigned char seen_image[8];
int seen_attr[3];          /* function (low bits), attribute, value of cuFuncSetAttribute */
unsigned seen_config[8];   /* grid x, block x, smem, attribute id, cluster x, y, z, numAttrs */
int capture_mode;          /* this (one) thread's stream-capture mode: 0 global, 2 relaxed */
int mode_at_load[2];       /* capture_mode during the last library and module load */
int cuThreadExchangeStreamCaptureMode(int *mode) {
  int previous = capture_mode; capture_mode = *mode; *mode = previous; return 0; }
static void image(const void *p) { memcpy(seen_image, p, 8); }
int cuLibraryLoadData(void **lib, const void *code, void *o, void **v, unsigned n, void *lo,
                      void **lv, unsigned ln) {
  image(code); mode_at_load[0] = capture_mode; *lib = (void *)0xA1; return result; }
int cuLibraryGetKernel(void **k, void *lib, const char *name) {
  strncpy(seen_name, name, 63); *k = (char *)lib + 1; return 0; }
int cuKernelGetFunction(void **f, void *k) { *f = (char *)k + 1; return 0; }
int cuModuleLoadData(void **m, const void *image_) {
  image(image_); mode_at_load[1] = capture_mode; *m = (void *)0xB1; return result; }
int cuModuleGetFunction(void **f, void *m, const char *name) {
  strncpy(seen_name, name, 63); *f = (char *)m + 1; return 0; }
int cuFuncSetAttribute(void *f, int attr, int value) {
  seen_attr[0] = (int)(long)f; seen_attr[1] = attr; seen_attr[2] = value + 1000000 * capture_mode;
  return result; }
int cuFuncGetAttribute(int *value, int attr, void *f) { *value = attr * 100 + (int)(long)f; return result; }
int cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int threads, unsigned long smem) {
  *n = threads + (int)smem; return result; }
int cuTensorMapEncodeTiled(unsigned long long *map, int dtype, unsigned rank, void *address,
                           const unsigned long long *dims, const unsigned long long *strides,
                           const unsigned *box, const unsigned *estrides, int interleave,
                           int swizzle, int promotion, int oob) {
  map[0] = dtype | rank << 8 | interleave << 16 | swizzle << 24 | (unsigned long long)promotion << 32 |
           (unsigned long long)oob << 40;
  map[1] = (unsigned long long)address;
  for (unsigned i = 0; i < rank; ++i) { map[2 + i] = dims[i]; map[7 + i] = box[i]; map[12 + i] = estrides[i] * 1000; }
  for (unsigned i = 0; i + 1 < rank; ++i) map[2 + rank + i] = strides[i];
  return result; }
int cuOccupancyMaxActiveClusters(int *n, void *f, const void *config) {
  const unsigned *dims = (const unsigned *)config;
  const char *attrs = *(char *const *)((const char *)config + 40);
  const unsigned *cluster = (const unsigned *)(attrs + 8);
  unsigned v[8] = {dims[0], dims[3], dims[6], *(const unsigned *)attrs, cluster[0], cluster[1],
                   cluster[2], *(const unsigned *)((const char *)config + 48)};
  memcpy(seen_config, v, sizeof v);
  *n = 15; return result; }
"""

DRIVE = """
import ctypes, json, sys
fake = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # dlopen("libcuda.so.1") finds it
from jit_kernels import driver as cu, native
assert native.launcher() is not None
seen = {"load_kernel": cu.load_kernel(b"CUBINxyz", "entry_a", "k")}
seen["library image"] = bytes((ctypes.c_ubyte * 8).in_dll(fake, "seen_image")).decode()
name = lambda: (ctypes.c_char * 64).in_dll(fake, "seen_name").value.decode()
seen["library name"] = name()
seen["load_module"] = cu.load_module(b".version 7.8\\x00", "probe", "p")
seen["module name"] = name()
# loaded with the capture mode relaxed (2), then the thread's own (global, 0) restored
seen["modes"] = list((ctypes.c_int * 2).in_dll(fake, "mode_at_load"))
seen["mode after"] = ctypes.c_int.in_dll(fake, "capture_mode").value
cu.set_attribute(0x42, cu.MAX_DYNAMIC_SHARED_SIZE_BYTES, 200000, "s")
seen["set"] = list((ctypes.c_int * 3).in_dll(fake, "seen_attr"))
seen["get"] = cu.get_attribute(0x42, cu.NUM_REGS, "g")
seen["blocks"] = cu.blocks_per_sm(0x42, 256, 1000, "b")
seen["clusters"] = cu.max_active_clusters(0x42, 8, 128, 70000, "c")
seen["config"] = list((ctypes.c_uint * 8).in_dll(fake, "seen_config"))
tmap = cu.encode_tiled(cu.TENSOR_MAP_UINT8, 0x7000, (128, 64, 9), (128, 8448), (128, 64, 1),
                       (1, 1, 1), cu.SWIZZLE_BYTES[128], cu.L2_PROMOTION_BYTES[128], "t")
seen["tmap"] = [int.from_bytes(tmap[8 * i: 8 * i + 8], "little") for i in range(16)]
ctypes.c_int.in_dll(fake, "result").value = 200  # CUDA_ERROR_INVALID_IMAGE
errors = []
for call in (lambda: cu.load_kernel(b"CUBINxyz", "entry_a", "loading k"),
             lambda: cu.set_attribute(0x42, 8, 1, "smem of k"),
             lambda: cu.max_active_clusters(0x42, 8, 128, 0, "clusters of k"),
             lambda: cu.encode_tiled(0, 0x7000, (1,), (), (1,), (1,), 0, 0, "map of k")):
    try:
        call()
    except cu.LaunchError as exc:
        errors.append(str(exc))
seen["errors"] = errors
print(json.dumps(seen))
"""


@needs_cc
def test_driver_calls_reach_the_driver_and_errors_raise(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.delenv("FLASHINFER_JIT_CUBIN_PATH", raising=False)
    source, fake = tmp_path / "fake_cuda.c", tmp_path / "libcuda.so.1"
    source.write_text(FAKE_DRIVER)
    subprocess.run(
        [*native.compiler(), "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(source), "-o", str(fake)],
        check=True,
    )  # fmt: skip
    native.build(tmp_path / "cache")
    run = subprocess.run(
        [sys.executable, "-c", DRIVE, str(fake)], capture_output=True, text=True, cwd=REPO
    )
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["load_kernel"] == [0xA1, 0xA3] and seen["library image"] == "CUBINxyz"
    assert seen["library name"] == "entry_a"
    assert seen["load_module"] == 0xB2 and seen["module name"] == "probe"
    assert seen["modes"] == [2, 2] and seen["mode after"] == 0  # loads pass a global capture
    assert seen["set"] == [0x42, 8, 200000 + 2000000]  # the value, set while relaxed
    assert seen["get"] == 4 * 100 + 0x42 and seen["blocks"] == 256 + 1000
    # one cluster of 8 CTAs of 128 threads, 70000 B each; the cluster-dimension attribute
    assert seen["clusters"] == 15 and seen["config"] == [8, 128, 70000, 4, 8, 1, 1, 1]
    # rank 3 at 0x7000: dims, then the two outer strides, box, element strides (x1000 here)
    flags = 0 | 3 << 8 | 0 << 16 | 3 << 24 | 2 << 32
    expect = [flags, 0x7000, 128, 64, 9, 128, 8448, 128, 64, 1, 0, 0, 1000, 1000, 1000, 0]
    assert seen["tmap"] == expect
    assert len(seen["errors"]) == 4
    whats = ("loading k", "smem of k", "clusters of k", "map of k")
    for error, what in zip(seen["errors"], whats, strict=True):
        assert error.startswith(f"{what} failed") and "200" in error


def test_the_cluster_probe_does_not_wait_for_the_launcher(monkeypatch):
    """Cluster occupancy is asked before a first call's compile: its driver calls take
    native.launcher(wait=False), so the launcher's build runs beside that compile."""
    from jit_kernels import occupancy

    class Launcher:
        def load_module(self, image, entry):
            return 0, 0xB1, 0xB2

        def set_attribute(self, function, attribute, value):
            return 0

        def clusters(self, function, cluster, threads, smem):
            return 0, 15

    asked = []
    monkeypatch.setattr(native, "launcher", lambda wait=True: asked.append(wait) or Launcher())
    monkeypatch.setattr(occupancy, "capability", lambda device: (9, 0))
    cuda = SimpleNamespace(
        device=lambda device: contextlib.nullcontext(),
        init=lambda: None,
        current_stream=lambda device: None,
    )
    monkeypatch.setattr(occupancy, "torch", SimpleNamespace(cuda=cuda))
    for cached in (occupancy._probe_function, occupancy.max_active_clusters):
        cached.cache_clear()
    try:
        assert occupancy.max_active_clusters(0, 8, 256, 1000) == 15
    finally:
        for cached in (occupancy._probe_function, occupancy.max_active_clusters):
            cached.cache_clear()
    assert asked == [False, False, False]  # load the probe, its shared memory, the query


def test_attribute_numbers_are_cuda_pythons():
    driver = pytest.importorskip("cuda.bindings.driver")
    attribute = driver.CUfunction_attribute
    assert cu.NUM_REGS == int(attribute.CU_FUNC_ATTRIBUTE_NUM_REGS)
    assert cu.MAX_DYNAMIC_SHARED_SIZE_BYTES == int(
        attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    )
    cluster = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert int(cluster) == 4  # _launcher_driver.h's CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert cu.TENSOR_MAP_UINT8 == int(driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8)
    assert cu.INTERLEAVE_NONE == int(driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
    assert cu.OOB_FILL_NONE == int(driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    for width, number in cu.SWIZZLE_BYTES.items():
        assert number == int(getattr(driver.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{width}B"))
    for size, number in cu.L2_PROMOTION_BYTES.items():
        name = f"CU_TENSOR_MAP_L2_PROMOTION_L2_{size}B"
        assert number == int(getattr(driver.CUtensorMapL2promotion, name))


@pytest.mark.gpu
def test_gpu_the_launcher_and_cuda_python_answer_alike(monkeypatch):
    """On a real driver: the same tensor map bytes, occupancy and registers either way."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or native.launcher() is None:
        pytest.skip("needs a GPU and the compiled launcher")
    from flashinfer_jit.mqa_logits.tma import TmaConfig, tma_family

    pool = torch.empty(9, 64 * 132, dtype=torch.uint8, device="cuda")
    dims = ((128, 64, 9), (128, 64 * 132), (128, 64, 1), (1, 1, 1))
    config = TmaConfig(3, 9, 3, 2)
    kernel = tma_family.get(
        (1, 64, 128, 64, torch.float32, torch.float32, torch.float32, *config), 0
    )
    answers = []
    for launcher in (native.launcher(), None):
        monkeypatch.setattr(native, "launcher", lambda found=launcher: found)
        tmap = cu.encode_tiled(0, pool.data_ptr(), *dims, 3, 2, "map")
        answers.append((tmap, cu.blocks_per_sm(kernel._handle, 480, 16384, "occupancy"),
                        cu.get_attribute(kernel._handle, cu.NUM_REGS, "regs")))  # fmt: skip
    assert answers[0] == answers[1] and answers[0][1] >= 1 and answers[0][2] > 0


@pytest.mark.gpu
def test_gpu_cluster_occupancy_alike_before_and_after_the_launcher(monkeypatch):
    """The probe's queries through cuda-python (a cold first call: the launcher still
    building) answer as through the launcher, for every cluster size of the one-wave split."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or native.launcher() is None:
        pytest.skip("needs a GPU and the compiled launcher")
    from jit_kernels import occupancy

    answers = []
    for launcher in (native.launcher(), None):
        monkeypatch.setattr(native, "launcher", lambda wait=True, found=launcher: found)
        for cached in (occupancy._probe_function, occupancy.max_active_clusters):
            cached.cache_clear()
        answers.append([occupancy.max_active_clusters(0, k, 256, 100000) for k in range(2, 9)])
    for cached in (occupancy._probe_function, occupancy.max_active_clusters):
        cached.cache_clear()
    assert answers[0] == answers[1] and min(answers[0]) >= 1


def test_cuda_python_loads_relax_the_capture_mode_too():
    """Without the launcher, cuda-python's loads run inside the same exchange: relaxed for
    the load, the thread's previous mode restored after (also when the load raises)."""
    calls = []

    class Driver:  # cuda-python's signature: (CUresult, previous mode)
        CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED=2)

        @staticmethod
        def cuThreadExchangeStreamCaptureMode(mode):
            calls.append(mode)
            return 0, (0 if len(calls) == 1 else 2)

    with cu._capture_relaxed(Driver):
        calls.append("load")
    with pytest.raises(RuntimeError), cu._capture_relaxed(Driver):
        raise RuntimeError("the load failed")
    assert calls == [2, "load", 0, 2, 2]
