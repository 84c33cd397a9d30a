"""The driver calls the engine makes besides launches: load a kernel, set and read its
attributes, ask its occupancy. Through the compiled launcher (``_launcher_driver.h``) where
it is loaded, so a first call does not import cuda-python's driver module (27 of the 34-42 ms
of a warm first call on the H200 host, 2026-12-02); through cuda-python where it is not.

Handles are ints. The caller makes the device's primary context current (torch's), as a
load and a function query need one. Every failure raises ``LaunchError`` naming ``what``.
``wait=False`` (the occupancy probe's calls) takes cuda-python while the launcher is still
to be built (``native.launcher``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import native

# cuda.h's CUfunction_attribute values (tests/test_native_launch.py checks them against
# cuda-python's).
NUM_REGS = 4
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class LaunchError(RuntimeError):
    pass


def _error_name(err) -> str:
    """A driver error (an int from the native launcher, a CUresult from cuda-python) as
    cuda-python spells it."""
    try:
        from cuda.bindings import driver

        return repr(driver.CUresult(int(err)))
    except (ImportError, ValueError):
        return f"CUresult {int(err)}"


def _check(result, what: str):
    """The value(s) after the CUresult of a driver call: a bare CUresult (the launcher's
    setters), or a tuple led by one (the launcher's and cuda-python's others)."""
    err = result if isinstance(result, int) else result[0]
    if int(err) != 0:
        raise LaunchError(f"{what} failed: {_error_name(err)}")
    if isinstance(result, int):
        return None
    return result[1] if len(result) == 2 else result[1:]


@contextlib.contextmanager
def _capture_relaxed(driver) -> Iterator[None]:
    """This thread's stream-capture mode relaxed while a module loads: during a capture in
    torch's default global mode the driver refuses a load (the launcher does the same in C,
    _launcher_driver.h says why)."""
    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = _check(driver.cuThreadExchangeStreamCaptureMode(relaxed), "capture mode")
    try:
        yield
    finally:
        driver.cuThreadExchangeStreamCaptureMode(previous)


def load_kernel(cubin: bytes, entry: str, what: str) -> tuple[int, int]:
    """(library, function) of ``entry`` in ``cubin``."""
    launcher = native.launcher()
    if launcher is not None:
        return _check(launcher.load_library(cubin, entry.encode()), what)
    from cuda.bindings import driver

    with _capture_relaxed(driver):
        loaded = driver.cuLibraryLoadData(cubin, [], [], 0, [], [], 0)
    library = _check(loaded, "cuLibraryLoadData")
    kernel = _check(driver.cuLibraryGetKernel(library, entry.encode()), what)
    return int(library), int(_check(driver.cuKernelGetFunction(kernel), what))


def load_module(image: bytes, entry: str, what: str, wait: bool = True) -> int:
    """The function ``entry`` of a module loaded from ``image`` (PTX the driver compiles, or a
    cubin); the module stays loaded."""
    launcher = native.launcher(wait)
    if launcher is not None:
        return _check(launcher.load_module(image, entry.encode()), what)[1]
    from cuda.bindings import driver

    with _capture_relaxed(driver):
        loaded = driver.cuModuleLoadData(image)
    module = _check(loaded, what)
    return int(_check(driver.cuModuleGetFunction(module, entry.encode()), what))


def set_attribute(function: int, attribute: int, value: int, what: str, wait: bool = True) -> None:
    launcher = native.launcher(wait)
    if launcher is not None:
        _check(launcher.set_attribute(function, attribute, value), what)
        return
    from cuda.bindings import driver

    with _capture_relaxed(driver):
        (err,) = driver.cuFuncSetAttribute(function, driver.CUfunction_attribute(attribute), value)
    _check(int(err), what)


def get_attribute(function: int, attribute: int, what: str) -> int:
    launcher = native.launcher()
    if launcher is not None:
        return _check(launcher.get_attribute(function, attribute), what)
    from cuda.bindings import driver

    return int(
        _check(driver.cuFuncGetAttribute(driver.CUfunction_attribute(attribute), function), what)
    )


def blocks_per_sm(function: int, threads: int, smem: int, what: str) -> int:
    """Resident blocks of ``threads`` threads and ``smem`` dynamic bytes per SM."""
    launcher = native.launcher()
    if launcher is not None:
        return _check(launcher.blocks_per_sm(function, threads, smem), what)
    from cuda.bindings import driver

    return int(
        _check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, threads, smem), what)
    )


def max_active_clusters(
    function: int, cluster: int, threads: int, smem: int, what: str, wait: bool = True
) -> int:
    """Resident clusters of ``cluster`` CTAs (``threads`` threads, ``smem`` dynamic bytes
    each) on the current device."""
    launcher = native.launcher(wait)
    if launcher is not None:
        return _check(launcher.clusters(function, cluster, threads, smem), what)
    from cuda.bindings import driver

    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = smem
    dims = driver.CUlaunchAttribute()
    dims.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    dims.value.clusterDim.x, dims.value.clusterDim.y, dims.value.clusterDim.z = cluster, 1, 1
    config.attrs, config.numAttrs = [dims], 1
    return int(_check(driver.cuOccupancyMaxActiveClusters(function, config), what))


# cuda.h's CUtensorMap enums (tests/test_native_driver.py checks them against cuda-python's).
TENSOR_MAP_UINT8 = 0
INTERLEAVE_NONE = 0
SWIZZLE_BYTES = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_32B / 64B / 128B
L2_PROMOTION_BYTES = {64: 1, 128: 2, 256: 3}  # CU_TENSOR_MAP_L2_PROMOTION_L2_<n>B
OOB_FILL_NONE = 0


def encode_tiled(
    dtype: int,
    address: int,
    dims: tuple[int, ...],
    strides: tuple[int, ...],
    box: tuple[int, ...],
    element_strides: tuple[int, ...],
    swizzle: int,
    promotion: int,
    what: str,
) -> bytes:
    """The 128 bytes of a tiled CUtensorMap (cuTensorMapEncodeTiled; no interleave, no
    out-of-bounds fill): ``dims`` innermost first, ``strides`` in bytes for the outer
    dimensions, ``swizzle`` / ``promotion`` as cuda.h numbers them."""
    launcher = native.launcher()
    if launcher is not None:
        args = (dtype, address, dims, strides, box, element_strides, INTERLEAVE_NONE)
        return _check(launcher.encode_tiled(*args, swizzle, promotion, OOB_FILL_NONE), what)
    from cuda.bindings import driver

    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        driver.CUtensorMapDataType(dtype),
        len(dims),
        address,
        [u64(d) for d in dims],
        [u64(s) for s in strides],
        [u32(b) for b in box],
        [u32(e) for e in element_strides],
        driver.CUtensorMapInterleave(INTERLEAVE_NONE),
        driver.CUtensorMapSwizzle(swizzle),
        driver.CUtensorMapL2promotion(promotion),
        driver.CUtensorMapFloatOOBfill(OOB_FILL_NONE),
    )
    _check(int(err), what)
    return b"".join(int(word).to_bytes(8, "little") for word in tmap.opaque)
