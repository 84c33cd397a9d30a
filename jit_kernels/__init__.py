"""jit_kernels: render, compile (NVRTC / CuTe DSL), cache, load and launch GPU kernels.

The engine knows no op: ops describe kernel families (a template and its parameters)
and call ``KernelFamily.get(params, device).launch(...)``, or ``.bind(...)`` once for a
launch they repeat (a replayed plan).
"""

from . import cache_admin
from .arch import (
    DEFAULT_OFFLINE_ARCHS,
    MIN_CAPABILITY,
    arch_capability,
    arch_for_capability,
    capability,
    device_arch,
    device_smem_per_block,
    shipped_smem_per_block,
    sm_count,
    smem_per_block,
    target_archs,
)
from .build import KernelBuilder
from .cache import (
    CacheWriteError,
    CubinCache,
    InsecureCacheError,
    default_cache_root,
    prebuilt_roots,
)
from .compile import CompiledKernel, CompileError, compile_cubin, nvrtc_version
from .dispatch import (
    FallbackError,
    fall_back,
    kernels_disabled,
    validate_inputs,
    validate_values,
)
from .family import KernelFamily, KernelUnavailable, prepare
from .launch import ArgPacker, LaunchError, LoadedKernel, current_stream
from .occupancy import max_active_clusters
from .params import F32, I32, I64, PTR, TENSOR_MAP, U32, Param, Signature, struct
from .render import RenderedSource, render
from .spec import KernelSpec

__all__ = [
    "DEFAULT_OFFLINE_ARCHS",
    "MIN_CAPABILITY",
    "F32",
    "I32",
    "I64",
    "PTR",
    "TENSOR_MAP",
    "U32",
    "Param",
    "Signature",
    "struct",
    "ArgPacker",
    "CacheWriteError",
    "CompileError",
    "CompiledKernel",
    "CubinCache",
    "FallbackError",
    "InsecureCacheError",
    "KernelBuilder",
    "KernelFamily",
    "KernelSpec",
    "KernelUnavailable",
    "LaunchError",
    "LoadedKernel",
    "RenderedSource",
    "arch_capability",
    "arch_for_capability",
    "cache_admin",
    "capability",
    "compile_cubin",
    "current_stream",
    "default_cache_root",
    "device_arch",
    "device_smem_per_block",
    "fall_back",
    "kernels_disabled",
    "max_active_clusters",
    "nvrtc_version",
    "prebuilt_roots",
    "prepare",
    "render",
    "shipped_smem_per_block",
    "sm_count",
    "smem_per_block",
    "target_archs",
    "validate_inputs",
    "validate_values",
]
