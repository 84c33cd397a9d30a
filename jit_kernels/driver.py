"""The driver calls the engine makes besides launches: load a kernel, set and read its
attributes, ask its occupancy. Through the compiled launcher (``_launcher_driver.h``) where
it is loaded, so a first call does not import cuda-python's driver module (27 of the 34-42 ms
of a warm first call on the H200 host, 2026-12-02); through cuda-python where it is not.

Handles are ints. The caller makes the device's primary context current (torch's), as a
load and a function query need one. Every failure raises ``LaunchError`` naming ``what``.
"""

from __future__ import annotations

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


def load_kernel(cubin: bytes, entry: str, what: str) -> tuple[int, int]:
    """(library, function) of ``entry`` in ``cubin``."""
    launcher = native.launcher()
    if launcher is not None:
        return _check(launcher.load_library(cubin, entry.encode()), what)
    from cuda.bindings import driver

    library = _check(driver.cuLibraryLoadData(cubin, [], [], 0, [], [], 0), "cuLibraryLoadData")
    kernel = _check(driver.cuLibraryGetKernel(library, entry.encode()), what)
    return int(library), int(_check(driver.cuKernelGetFunction(kernel), what))


def load_module(image: bytes, entry: str, what: str) -> int:
    """The function ``entry`` of a module loaded from ``image`` (PTX the driver compiles, or a
    cubin); the module stays loaded."""
    launcher = native.launcher()
    if launcher is not None:
        return _check(launcher.load_module(image, entry.encode()), what)[1]
    from cuda.bindings import driver

    module = _check(driver.cuModuleLoadData(image), what)
    return int(_check(driver.cuModuleGetFunction(module, entry.encode()), what))


def set_attribute(function: int, attribute: int, value: int, what: str) -> None:
    launcher = native.launcher()
    if launcher is not None:
        _check(launcher.set_attribute(function, attribute, value), what)
        return
    from cuda.bindings import driver

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


def max_active_clusters(function: int, cluster: int, threads: int, smem: int, what: str) -> int:
    """Resident clusters of ``cluster`` CTAs (``threads`` threads, ``smem`` dynamic bytes
    each) on the current device."""
    launcher = native.launcher()
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
