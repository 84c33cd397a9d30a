"""Loading cubins into a device and launching them with little host overhead.

A hot launch packs the arguments with one precompiled ``struct.Struct`` into a
per-thread buffer whose ``void*[]`` array was built once, and hands that array's
address to ``cuLaunchKernel``: no ctypes objects are created per call. The call goes
through the compiled launcher (``native``: one C call, ~1 us less than cuda-python's on
the H200 host) when it is available, else through cuda-python.

A launch plan that repeats one shape (an op's replayed plan) takes ``LoadedKernel.bind``:
with the compiled launcher, one C call that packs the arguments itself and launches
(``_launcher_bound.h``; ~2 us less than ``launch`` for 37 arguments, CPU), else ``launch``.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from . import driver as cu
from . import native
from .compile import CompiledKernel, nvrtc_version
from .driver import LaunchError, _check, _error_name

_ALIGN = {
    "b": 1,
    "B": 1,
    "h": 2,
    "H": 2,
    "i": 4,
    "I": 4,
    "f": 4,
    "q": 8,
    "Q": 8,
    "d": 8,
    "P": 8,
    "M": 64,
}
# Codes that are not plain ``struct`` codes: P a device pointer (packed as Q), M a
# CUtensorMap (128 opaque bytes, 64-byte aligned; passed as ``bytes``).
_STRUCT_CODE = {"P": "Q", "M": "128s"}
_SIZE = {"M": 128}


_PDL_CONFIGS = 256  # launch configs a kernel keeps for launch_programmatic


# A launch of fixed shape: (stream, the values of its per-call members) -> None
# (LoadedKernel.bind).
BoundLaunch = Callable[[int, tuple], None]
# In a bound launch's template: a member each call passes (the others are fixed at binding).
PER_CALL = object()
_PLACEHOLDER = {"f": 0.0, "d": 0.0, "M": b""}  # what a template's buffer holds for PER_CALL


def merge(template: Sequence, values: Sequence) -> tuple:
    """``template`` with its PER_CALL members replaced by ``values``, in order."""
    calls = [i for i, member in enumerate(template) if member is PER_CALL]
    if len(values) != len(calls):
        raise TypeError(f"a launch of this template takes {len(calls)} values, got {len(values)}")
    merged = list(template)
    for i, value in zip(calls, values, strict=True):
        merged[i] = value
    return tuple(merged)


class ArgPacker:
    """Lays out kernel parameters, each a C struct of the given member codes.

    ``signature`` holds one ``struct`` code string per kernel parameter, e.g.
    ``("P", "P", "i", "f")`` for ``(T*, T*, int, float)`` or ``"Pii"`` for a
    by-value ``{void*; int; int}`` (a CuTe-DSL tensor). ``P`` is a device pointer,
    ``M`` a ``__grid_constant__`` CUtensorMap given as its 128 bytes.
    """

    def __init__(self, signature: Sequence[str]):
        fmt, offsets, members, cursor = "<", [], [], 0
        for param in signature:
            align = max(_ALIGN[c] for c in param)
            pad = -cursor % max(align, 8)
            fmt, cursor = fmt + "x" * pad, cursor + pad
            offsets.append(cursor)
            for code in param:
                pad = -cursor % _ALIGN[code]
                fmt += "x" * pad + _STRUCT_CODE.get(code, code)
                members.append(cursor + pad)
                cursor += pad + _SIZE.get(code, _ALIGN[code])
        self.struct = struct.Struct(fmt)
        self.offsets = tuple(offsets)
        self.signature = tuple(signature)
        # Each flattened member's code and byte offset: the compiled launcher packs by them.
        self.codes, self.member_offsets = "".join(signature), tuple(members)
        self._local = threading.local()

    def split(self, template: Sequence) -> tuple[bytes, tuple[int, ...], bytes]:
        """A bound launch's layout: the codes and offsets of the members ``template`` leaves
        PER_CALL, and the parameter buffer with its other members packed."""
        if len(template) != len(self.codes):
            raise ValueError(f"{len(template)} template members for a {self.codes!r} signature")
        calls = [i for i, member in enumerate(template) if member is PER_CALL]
        fixed = (
            _PLACEHOLDER.get(code, 0) if member is PER_CALL else member
            for code, member in zip(self.codes, template, strict=True)
        )
        codes = "".join(self.codes[i] for i in calls).encode()
        return codes, tuple(self.member_offsets[i] for i in calls), self.struct.pack(*fixed)

    def _new_buffers(self):
        data = (ctypes.c_char * max(self.struct.size, 8))()
        base = ctypes.addressof(data)
        pointers = (ctypes.c_void_p * max(len(self.offsets), 1))(*(base + o for o in self.offsets))
        bufs = (data, pointers, ctypes.addressof(pointers))
        self._local.bufs = bufs
        return bufs

    def pack(self, args: Sequence) -> int:
        """Write ``args`` (flattened members) and return the ``void**`` address."""
        try:
            data, _, address = self._local.bufs
        except AttributeError:
            data, _, address = self._new_buffers()
        self.struct.pack_into(data, 0, *args)
        return address


def driver_mismatch(compiler: str) -> str:
    """A hint for a cubin the driver rejected: NVRTC newer than the driver's CUDA major
    emits cubins that driver cannot load ("" when that is not the case)."""
    if compiler != "nvrtc":
        return ""
    try:
        from cuda.bindings import driver

        _, version = driver.cuDriverGetVersion()
        nvrtc_major = int(nvrtc_version().split(".")[0])
    except Exception:  # noqa: BLE001 (a hint only: no driver or NVRTC means no hint)
        return ""
    major = int(version) // 1000
    if nvrtc_major <= major:
        return ""
    return (
        f"; NVRTC {nvrtc_major} emits cubins for CUDA {nvrtc_major}, the driver supports CUDA "
        f"{major}.{int(version) % 1000 // 10}: install the NVRTC of the driver's CUDA major "
        f"(pip install 'flashinfer-jit[cu{major}]')"
    )


class LoadedKernel:
    """One kernel loaded in one device's primary context."""

    __slots__ = (
        *("name", "device", "function", "packer", "_library", "_smem_limit", "_launch"),
        *("_launch_ex", "_pdl_configs", "_handle", "_native", "_native_pdl", "_launcher"),
    )

    def __init__(self, compiled: CompiledKernel, device: int, packer: ArgPacker, name: str):
        self.name, self.device, self.packer = name, device, packer
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.cuda.current_stream(device)  # makes the primary context current here
            self._library, function = cu.load_kernel(compiled.cubin, compiled.entry, name)
        self._bind(function, native.launcher())

    def _bind(self, function: int | None, launcher) -> None:
        """Launch ``function`` (a CUfunction handle) through ``launcher`` (the compiled
        launcher module, jit_kernels.native) or, where it is None, through cuda-python."""
        self.function = self._handle = 0 if function is None else int(function)
        self._launcher = launcher
        self._native = None if launcher is None else launcher.launch
        self._native_pdl = None if launcher is None else launcher.launch_programmatic
        self._smem_limit = 48 * 1024
        # cuda-python's launches, imported at the first launch without the launcher.
        self._launch = self._launch_ex = None
        # (grid, block, smem, stream) -> CUlaunchConfig of launch_programmatic through
        # cuda-python: built once, never changed after (threads may share them); at most
        # _PDL_CONFIGS kept. The native launcher builds its config per call, in C.
        self._pdl_configs: dict[tuple, object] = {}

    def _cuda_python(self) -> None:
        from cuda.bindings import driver

        self._launch, self._launch_ex = driver.cuLaunchKernel, driver.cuLaunchKernelEx

    def _allow_smem(self, nbytes: int) -> None:
        what = f"{self.name}: smem {nbytes}"
        cu.set_attribute(self._handle, cu.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes, what)
        self._smem_limit = nbytes

    def blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        """How many blocks of ``threads`` with ``smem`` dynamic bytes fit one SM (0: the
        launch would fail, e.g. registers x threads exceed the register file)."""
        if smem > self._smem_limit:
            self._allow_smem(smem)
        return cu.blocks_per_sm(self._handle, threads, smem, f"{self.name}: occupancy")

    def global_buffer(self, name: str) -> tuple[int, int]:
        """(device address, bytes) of the module's ``__device__`` variable ``name`` (how a
        tool reads the buffer an instrumented kernel writes)."""
        from cuda.bindings import driver

        library = driver.CUlibrary(self._library)
        ptr, size = _check(
            driver.cuLibraryGetGlobal(library, name.encode()), f"{self.name}: {name}"
        )
        return int(ptr), int(size)

    def num_regs(self) -> int:
        """Registers per thread of the compiled kernel."""
        return cu.get_attribute(self._handle, cu.NUM_REGS, f"{self.name}: regs")

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        args: Sequence,
        smem: int = 0,
    ) -> None:
        """Launch on ``stream`` (a raw ``cudaStream_t`` of this kernel's device)."""
        if smem > self._smem_limit:
            self._allow_smem(smem)
        params = self.packer.pack(args)
        launch = self._native
        if launch is not None:
            err = launch(self._handle, *grid, *block, smem, stream, params)
        else:
            if self._launch is None:
                self._cuda_python()
            err = self._launch(self._handle, *grid, *block, smem, stream, params, 0)[0]
        if err:
            self._failed(False, err)

    def launch_programmatic(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        args: Sequence,
        smem: int = 0,
    ) -> None:
        """``launch`` as a programmatic dependent launch: the grid may be scheduled while
        the stream's previous kernel finishes, so the kernel must wait for that kernel's
        results itself (``griddepcontrol.wait``) before reading them."""
        if smem > self._smem_limit:
            self._allow_smem(smem)
        launch = self._native_pdl
        if launch is not None:
            err = launch(self._handle, *grid, *block, smem, stream, self.packer.pack(args))
        else:
            config = self._pdl_configs.get((grid, block, smem, stream))
            if config is None:
                config = self._pdl_config(grid, block, smem, stream)
            if self._launch_ex is None:
                self._cuda_python()
            (err,) = self._launch_ex(config, self._handle, self.packer.pack(args), 0)
        if err:
            self._failed(True, err)

    def _failed(self, programmatic: bool, err) -> NoReturn:
        how = " (programmatic)" if programmatic else ""
        raise LaunchError(
            f"launching {self.name}{how} on cuda:{self.device} failed: {_error_name(err)}"
        )

    def bind(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int = 0,
        programmatic: bool = False,
        template: Sequence | None = None,
    ) -> BoundLaunch:
        """``launch`` (``launch_programmatic`` if ``programmatic``) with its shape and the
        members ``template`` fixes bound: ``bound(stream, values)`` passes the members it
        leaves PER_CALL, in order (``template`` None: every member). Through the compiled
        launcher, which packs them itself, where it is loaded, else through those methods."""
        if smem > self._smem_limit:
            self._allow_smem(smem)
        template = (PER_CALL,) * len(self.packer.codes) if template is None else tuple(template)
        launcher = self._launcher
        if launcher is not None:
            codes, offsets, buffer = self.packer.split(template)
            on_error = functools.partial(self._failed, programmatic)
            try:
                return launcher.Bound(
                    self._handle, *grid, *block, smem, programmatic, codes, offsets,
                    self.packer.offsets, buffer, on_error,
                )  # fmt: skip
            except ValueError:  # more parameter bytes than the launcher's stack buffer holds
                pass
        launch = self.launch_programmatic if programmatic else self.launch
        return lambda stream, values: launch(grid, block, stream, merge(template, values), smem)

    def _pdl_config(self, grid: tuple, block: tuple, smem: int, stream: int):
        """cuda-python's CUlaunchConfig of a programmatic launch, kept per (grid, block,
        smem, stream)."""
        from cuda.bindings import driver

        attribute = driver.CUlaunchAttribute()
        attribute.id = (
            driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        )
        attribute.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes, config.hStream = smem, stream
        config.attrs, config.numAttrs = [attribute], 1
        if len(self._pdl_configs) >= _PDL_CONFIGS:  # grids follow row counts: bound it
            self._pdl_configs.clear()
        self._pdl_configs[(grid, block, smem, stream)] = config
        return config


def _current_stream(device: int) -> int:
    """The raw handle of torch's current stream on ``device`` (what torch ops use)."""
    # The private accessor skips building a torch.cuda.Stream object; Triton uses it too.
    return torch._C._cuda_getCurrentRawStream(device)


# torch's accessor itself where torch has it: every launch asks, and the wrapper's frame
# is ~0.1 us of that. (A torch without CUDA keeps the wrapper, which raises when called.)
current_stream: Callable[[int], int] = getattr(
    torch._C, "_cuda_getCurrentRawStream", _current_stream
)
