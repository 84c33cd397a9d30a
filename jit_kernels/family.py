"""A kernel family: one template, its parameter names, and its loaded specializations."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

from .arch import device_arch
from .build import KernelBuilder
from .launch import ArgPacker, LoadedKernel
from .spec import KernelSpec, ParamValue

JIT_DISABLE_ENV = "FLASHINFER_JIT_DISABLE"


class KernelUnavailable(RuntimeError):
    """A specialization cannot be had: JIT disabled and not prebuilt, or no compiler."""


class KernelFamily:
    """Specializations of one kernel template, compiled on first use.

    ``get(params, device)`` is the hot path: one dict lookup once the specialization
    is loaded on that device. ``params`` are the template arguments in ``param_names``
    order. The argument ``signature`` is shared by every specialization.
    """

    def __init__(
        self,
        builder: KernelBuilder,
        family: str,
        template: str,
        kernel: str,
        param_names: Sequence[str],
        signature: Sequence[str],
        compiler: str = "nvrtc",
        archs: Sequence[str] = (),
    ):
        self.builder = builder
        self.family, self.template, self.kernel = family, template, kernel
        self.param_names = tuple(param_names)
        self.compiler = compiler
        self.archs = tuple(archs)
        self.packer = ArgPacker(signature)
        self._loaded: dict[tuple[tuple[ParamValue, ...], int], LoadedKernel] = {}
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
        )

    def get(self, params: tuple[ParamValue, ...], device: int) -> LoadedKernel:
        kernel = self._loaded.get((params, device))
        return kernel if kernel is not None else self._load(params, device)

    def _load(self, params: tuple[ParamValue, ...], device: int) -> LoadedKernel:
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
        with self._lock:
            kernel = self._loaded.get((params, device))
            if kernel is None:
                kernel = LoadedKernel(compiled, device, self.packer, spec.label)
                self._loaded[(params, device)] = kernel
        return kernel
