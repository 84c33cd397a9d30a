"""Target architectures: names, the device's own, and the lists users ask for."""

from __future__ import annotations

import functools
import os
import re

import torch

# sm_107a (Rubin) is compiled for, never run here: NVRTC 13 lists it (nvrtcGetSupportedArchs).
DEFAULT_OFFLINE_ARCHS = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
ARCH_ENV = "FLASHINFER_JIT_ARCHS"
# The oldest compute capability the package builds for and runs on: Hopper. Every op
# converts to or from e4m3 (sm_89 has that), but the templates use sm_90 features (the MQA
# kernels' .op_restrict, the clusters beside the QSA single pass): an sm_89 build fails
# (session 31's review). prebuild refuses older archs, the ops older devices (torch path).
MIN_CAPABILITY = (9, 0)
# The first compute capability of each target suffix: arch-specific ("a") from Hopper, family
# ("f") from Blackwell. NVRTC refuses sm_89a or sm_90f ("invalid value for --nv_arch").
SUFFIX_SINCE = {"": MIN_CAPABILITY, "a": (9, 0), "f": (10, 0)}

# Opt-in dynamic shared memory one block may use, per compute capability (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability"). Launch configs
# are sized from this table, not from the device, so prebuild (no GPU) picks the configs
# a device will ask for; a GPU test checks the table against ``device_smem_per_block``.
# sm_107a is compiled for but never run here: taken as the other cc 10.x parts' (checked by
# the GPU test on the first device that has it).
_SMEM_PER_BLOCK = {
    (9, 0): 232448,
    (10, 0): 232448,
    (10, 3): 232448,
    (10, 7): 232448,
}


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target that uses every feature of a compute capability.

    Hopper and Blackwell datacenter parts get their arch-specific ("a") targets,
    which the wgmma/tcgen05 instructions need; a cubin for one is never loaded on
    another capability, which the cache layout (one folder per arch) reflects.
    """
    if (major, minor) in ((9, 0), (10, 0), (10, 3), (10, 7)):
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


@functools.cache
def device_smem_per_block(device_index: int) -> int:
    """The opt-in shared memory per block a device reports, memoized."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def arch_capability(arch: str) -> tuple[int, int]:
    """The compute capability an arch name targets: ``sm_90a`` -> (9, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    return int(digits[:-1]), int(digits[-1])


def smem_per_block(arch: str) -> int:
    """Opt-in dynamic shared memory per block on ``arch`` (e.g. ``sm_90a``): what a launch
    config may use there."""
    cap = arch_capability(arch)
    if cap not in _SMEM_PER_BLOCK:
        raise KeyError(f"no shared-memory limit known for {arch}")
    return _SMEM_PER_BLOCK[cap]


def shipped_smem_per_block(archs: tuple[str, ...] = DEFAULT_OFFLINE_ARCHS) -> int:
    """The shared memory a launch config may use to fit every arch in ``archs`` (the
    package ships one config per call shape for all of them)."""
    return min(smem_per_block(arch) for arch in archs)


def device_arch(device: int | torch.device) -> str:
    index = device.index if isinstance(device, torch.device) else device
    return arch_for_capability(*capability(torch.cuda.current_device() if index is None else index))


# "sm_90a" (the package's names) or torch's "9.0a" (TORCH_CUDA_ARCH_LIST): a compute
# capability major.minor with an optional "a" (arch-specific) or "f" (family) suffix.
_ARCH_NAME = re.compile(r"sm_(\d{1,2})(\d)([af]?)")
_TORCH_ARCH = re.compile(r"(\d{1,2})\.(\d)([af]?)")


def parse_arch(text: str) -> str:
    """One arch as the package names it: ``sm_90a`` or torch's ``9.0a`` -> ``sm_90a``.

    ValueError for anything else (``sm90a``, ``sm_xx``, ``9.0+PTX``: this package builds
    no PTX, so a "+PTX" would silently mean something else)."""
    match = _ARCH_NAME.fullmatch(text) or _TORCH_ARCH.fullmatch(text)
    if match is None or int(match.group(1)) < 5:
        raise ValueError(
            f"bad arch {text!r}: expected a name like sm_90a or sm_100a, or torch's 9.0a / 10.0a"
        )
    major, minor, suffix = match.groups()
    return f"sm_{int(major)}{minor}{suffix}"


def parse_arch_list(text: str) -> tuple[str, ...]:
    """Archs separated by commas, semicolons or spaces, in order, without repeats.
    ValueError when one is malformed or the list names none."""
    archs = [parse_arch(a) for a in re.split(r"[,;\s]+", text) if a]
    if not archs:
        raise ValueError(f"no arch in {text!r}: expected e.g. sm_90a,sm_100a or '9.0a 10.0a'")
    return tuple(dict.fromkeys(archs))


def _name(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def _nvrtc_capabilities() -> tuple[str, list[tuple[int, int]]] | None:
    """(the loaded NVRTC's major.minor, the compute capabilities it compiles for); None
    where no NVRTC loads (a node that serves bundles: a build there fails and says why)."""
    from . import nvrtc_lib

    try:
        major, minor = nvrtc_lib.version()
        return f"{major}.{minor}", [divmod(arch, 10) for arch in nvrtc_lib.supported_archs()]
    except (OSError, RuntimeError, ImportError):
        return None


def buildable(archs: tuple[str, ...]) -> tuple[str, ...]:
    """``archs``, where the package can build each: compute capability MIN_CAPABILITY or
    newer, its suffix one NVRTC takes there (SUFFIX_SINCE) and, where NVRTC loads, one it
    lists (nvrtcGetSupportedArchs). Else ValueError naming those it can build: a build
    for another arch fails kernel by kernel."""
    nvrtc = _nvrtc_capabilities()
    for arch in archs:
        cap, suffix = arch_capability(arch), arch.removeprefix("sm_").lstrip("0123456789")
        if cap >= SUFFIX_SINCE[suffix] and (nvrtc is None or cap in nvrtc[1]):
            continue
        which = f"{_name(MIN_CAPABILITY)} and newer"
        if nvrtc is not None:
            listed = ", ".join(_name(c) for c in nvrtc[1] if c >= MIN_CAPABILITY)
            which = f"{listed} (NVRTC {nvrtc[0]}'s from {_name(MIN_CAPABILITY)})"
        suffixes = ", ".join(f"'{s}' from {_name(c)}" for s, c in SUFFIX_SINCE.items() if s)
        raise ValueError(
            f"cannot build {arch}: the package builds {which} (its templates use sm_90's); "
            f"suffix {suffixes}"
        )
    return archs


def target_archs(explicit: str | None = None) -> tuple[str, ...]:
    """Archs to build for: explicit list, else $FLASHINFER_JIT_ARCHS, else the
    visible GPUs' archs, else the offline default (DEFAULT_OFFLINE_ARCHS). ValueError where
    one is malformed or cannot be built (``buildable``), saying which list it was in."""
    if explicit is not None:
        return buildable(parse_arch_list(explicit))
    env = os.environ.get(ARCH_ENV)
    if env is not None and env != "":
        where = f"{ARCH_ENV}={env!r}"
        try:
            archs = parse_arch_list(env)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif torch.cuda.is_available():
        where = "the GPUs' archs"
        archs = tuple(sorted({device_arch(i) for i in range(torch.cuda.device_count())}))
    else:
        where, archs = "the default archs", DEFAULT_OFFLINE_ARCHS
    try:
        return buildable(archs)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
