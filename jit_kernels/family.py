"""A kernel family: one template, its parameter names, and its loaded specializations."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from .arch import device_arch
from .build import KernelBuilder
from .compile import CompiledKernel
from .launch import ArgPacker, LaunchError, LoadedKernel, driver_mismatch
from .params import Param, codes
from .spec import KernelSpec, ParamValue

JIT_DISABLE_ENV = "FLASHINFER_JIT_DISABLE"


class KernelUnavailable(RuntimeError):
    """A specialization cannot be had: JIT disabled and not prebuilt, or no compiler."""


class KernelFamily:
    """Specializations of one kernel template, compiled on first use.

    ``get(params, device)`` is the hot path: one dict lookup once the specialization
    is loaded on that device. ``params`` are the template arguments in ``param_names``
    order. The kernel's parameter list ``signature`` (typed, ``jit_kernels.params``) is
    shared by every specialization.

    A refusal (KernelUnavailable: no compiler, not prebuilt with JIT disabled, an arch
    the template does not support) is remembered per (params, device) for the process, so
    a caller that falls back on it (``auto`` backends) pays a dict lookup per call, not a
    cache search or a compiler import. It is forgotten when what caused it changes: the
    ``FLASHINFER_JIT_DISABLE`` switch or the builder's cache (its roots).
    """

    def __init__(
        self,
        builder: KernelBuilder,
        family: str,
        template: str,
        kernel: str,
        param_names: Sequence[str],
        signature: Sequence[Param],
        compiler: str = "nvrtc",
        archs: Sequence[str] = (),
        ptx_twins: Sequence[tuple[str, str]] = (),
    ):
        self.builder = builder
        self.family, self.template, self.kernel = family, template, kernel
        self.param_names = tuple(param_names)
        self.compiler = compiler
        self.archs = tuple(archs)
        self.ptx_twins = tuple(ptx_twins)
        self.signature = tuple(signature)
        if not all(isinstance(p, Param) for p in self.signature):
            raise TypeError(f"{family}: declare the signature with jit_kernels.params types")
        self.packer = ArgPacker(codes(self.signature))
        self._loaded: dict[tuple[tuple[ParamValue, ...], int], LoadedKernel] = {}
        # (params, device) -> (message, the conditions it was refused under)
        self._refused: dict[tuple[tuple[ParamValue, ...], int], tuple[str, tuple]] = {}
        self._lock = threading.Lock()

    def spec(self, params: tuple[ParamValue, ...]) -> KernelSpec:
        if len(params) != len(self.param_names):
            raise ValueError(f"{self.family} takes parameters {self.param_names}, got {params}")
        return KernelSpec(
            self.family,
            self.template,
            self.kernel,
            tuple(zip(self.param_names, params, strict=True)),
            self.compiler,
            self.archs,
            self.ptx_twins,
        )

    def get(self, params: tuple[ParamValue, ...], device: int) -> LoadedKernel:
        kernel = self._loaded.get((params, device))
        return kernel if kernel is not None else self._load(params, device)

    def _ready(self, params: tuple[ParamValue, ...], device: int) -> bool:
        """Whether ``get`` needs no compile: loaded, refused (it raises at once), or its
        cubin in memory or on disk."""
        if (params, device) in self._loaded or self._refusal(params, device) is not None:
            return True
        try:
            return self.builder.lookup(self.spec(params), device_arch(device)) is not None
        except Exception:  # noqa: BLE001 (the get that follows raises it, where it must)
            return False

    def _conditions(self) -> tuple:
        """What a refusal depends on besides (params, device)."""
        return (os.environ.get(JIT_DISABLE_ENV) == "1", self.builder.cache)

    def _refusal(self, params: tuple[ParamValue, ...], device: int) -> str | None:
        """Why ``get`` refused (params, device) under the conditions that hold now, if it did."""
        refused = self._refused.get((params, device))
        return refused[0] if refused is not None and refused[1] == self._conditions() else None

    def _load(self, params: tuple[ParamValue, ...], device: int) -> LoadedKernel:
        refused = self._refusal(params, device)
        if refused is not None:
            # A new exception each time: re-raising one instance grows its traceback.
            raise KernelUnavailable(refused)
        try:
            compiled = self._compiled(params, device)
        except KernelUnavailable as exc:
            self._refused[(params, device)] = (str(exc), self._conditions())
            raise
        return self._install(compiled, params, device)

    def _install(self, compiled: CompiledKernel, params, device: int) -> LoadedKernel:
        """Load ``compiled`` once per (params, device), in the calling thread."""
        with self._lock:
            kernel = self._loaded.get((params, device))
            if kernel is None:
                kernel = self._loaded_kernel(compiled, params, device)
                self._loaded[(params, device)] = kernel
        return kernel

    def _loaded_kernel(self, compiled: CompiledKernel, params, device: int) -> LoadedKernel:
        """Load ``compiled``; a cubin the driver rejects (one from a newer CUDA than the
        driver's, say) is a refusal remembered like any other, never a crash."""
        spec = self.spec(params)
        try:
            return LoadedKernel(compiled, device, self.packer, spec.label)
        except LaunchError as exc:
            message = f"the driver cannot load {spec.label}: {exc}{driver_mismatch(spec.compiler)}"
            self._refused[(params, device)] = (message, self._conditions())
            raise KernelUnavailable(message) from exc

    def _compiled(self, params: tuple[ParamValue, ...], device: int) -> CompiledKernel:
        """The cubin for ``params`` on ``device``'s arch, or KernelUnavailable."""
        spec = self.spec(params)
        arch = device_arch(device)
        if not spec.supports(arch):
            raise KernelUnavailable(
                f"{spec.label} is built for {', '.join(spec.archs)} only, not {arch}"
            )
        if os.environ.get(JIT_DISABLE_ENV) == "1":
            compiled = self.builder.cache.lookup(
                arch, spec.family, self.builder.cache_key(spec, arch), spec.label
            )
            if compiled is None:
                raise KernelUnavailable(
                    f"{spec.label} for {arch} is not prebuilt and {JIT_DISABLE_ENV}=1"
                )
        else:
            try:
                compiled, _ = self.builder.build(spec, arch)
            except ImportError as exc:
                raise KernelUnavailable(f"no compiler for {spec.label}: {exc}") from exc
        return compiled


def prepare(wanted: Sequence[tuple[KernelFamily, tuple[ParamValue, ...]]], device: int) -> None:
    """``family.get(params, device)`` of every ``(family, params)`` in ``wanted`` that needs a
    compile, at once, one thread each (NVRTC releases the GIL and compiles in parallel
    threads): a call that needs several kernels waits for the longest compile, not their
    sum. Raises what the first of them to fail in ``wanted``'s order raised, as getting
    them one by one would have. Cached kernels are left to those ``get`` calls (a thread
    would only add its start to a disk read)."""
    missing = [(f, p) for f, p in dict.fromkeys(wanted) if not f._ready(p, device)]
    if len(missing) < 2:  # one compile gains nothing from a thread
        return
    workers = min(len(missing), os.cpu_count() or 1)
    # The threads compile only. Loading needs the caller's CUDA context: a new thread has
    # none current, and cuKernelGetFunction there fails with CUDA_ERROR_INVALID_CONTEXT
    # (every QSA first call on the H200, 2026-12-02). The loads below find the cubins
    # built; then each failed compile is compiled again by its get, in order, which raises
    # (and remembers a refusal) as a lone get would.
    with ThreadPoolExecutor(workers, thread_name_prefix="flashinfer-jit-build") as pool:
        futures = [pool.submit(family._compiled, params, device) for family, params in missing]
    for (family, params), future in zip(missing, futures, strict=True):
        if future.exception() is None:
            family._install(future.result(), params, device)
    for (family, params), future in zip(missing, futures, strict=True):
        if future.exception() is not None:
            family.get(params, device)
