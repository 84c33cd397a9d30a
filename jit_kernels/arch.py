"""Target architectures: names, the device's own, and the lists users ask for."""

from __future__ import annotations

import functools
import os

import torch

DEFAULT_OFFLINE_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
ARCH_ENV = "FLASHINFER_JIT_ARCHS"


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target that uses every feature of a compute capability.

    Hopper and Blackwell datacenter parts get their arch-specific ("a") targets,
    which the wgmma/tcgen05 instructions need; a cubin for one is never loaded on
    another capability, which the cache layout (one folder per arch) reflects.
    """
    if (major, minor) in ((9, 0), (10, 0), (10, 3)):
        return f"sm_{major}{minor}a"
    return f"sm_{major}{minor}"


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """A device's compute capability, memoized: ops ask on every call."""
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def sm_count(device_index: int) -> int:
    """A device's multiprocessor count, memoized: persistent grids size from it per call."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_arch(device: int | torch.device) -> str:
    index = device.index if isinstance(device, torch.device) else device
    return arch_for_capability(*capability(torch.cuda.current_device() if index is None else index))


def parse_arch_list(text: str) -> tuple[str, ...]:
    archs = tuple(a.strip() for a in text.replace(";", ",").split(",") if a.strip())
    for arch in archs:
        digits = arch.removeprefix("sm_").rstrip("af")
        if not arch.startswith("sm_") or not digits.isdigit():
            raise ValueError(f"bad arch {arch!r}: expected names like sm_90a, sm_100a")
    return archs


def target_archs(explicit: str | None = None) -> tuple[str, ...]:
    """Archs to build for: explicit list, else $FLASHINFER_JIT_ARCHS, else the
    visible GPUs' archs, else the offline default (sm_90a, sm_100a, sm_103a)."""
    if explicit:
        return parse_arch_list(explicit)
    if os.environ.get(ARCH_ENV):
        return parse_arch_list(os.environ[ARCH_ENV])
    if torch.cuda.is_available():
        return tuple(sorted({device_arch(i) for i in range(torch.cuda.device_count())}))
    return DEFAULT_OFFLINE_ARCHS
