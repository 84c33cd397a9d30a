"""The package's kernel builder: where its templates live and how ops declare families."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from jit_kernels import KernelBuilder, KernelFamily, Param, native

from ._version import __version__


def _template_root() -> Path:
    # In a wheel the templates ship inside the package; in a source checkout they sit
    # beside it at the repository root.
    packaged = Path(__file__).parent / "templates"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "templates"


TEMPLATE_ROOT = _template_root()
BUILDER = KernelBuilder(TEMPLATE_ROOT, __version__)
# A first call that compiles also needs the compiled launcher, whose build (the C compiler,
# ~0.3 s on an empty cache) then runs on a thread beside the kernel's compile.
BUILDER.on_compile = native.resolve_in_background
# sm_107a takes sm_100a's PTX in the families that declare this (ptx_twins): NVRTC 13.5 emits
# the same PTX for both in every shipped specialization of theirs, but not of qsa_slots
# (it loads its parameters otherwise there). tests/test_ptxas.py checks one of each.
SM107A_TAKES_SM100A = (("sm_107a", "sm_100a"),)
# Every family the package declares, by name (the signature test compiles each).
FAMILIES: dict[str, KernelFamily] = {}


def kernel_family(
    family: str,
    template: str,
    kernel: str,
    param_names: Sequence[str],
    signature: Sequence[Param],
    compiler: str = "nvrtc",
    archs: Sequence[str] = (),
    ptx_twins: Sequence[tuple[str, str]] = (),
) -> KernelFamily:
    made = KernelFamily(
        BUILDER, family, template, kernel, param_names, signature, compiler, archs, ptx_twins
    )
    if FAMILIES.setdefault(family, made) is not made:
        raise ValueError(f"kernel family {family!r} is declared twice")
    return made


def cuda_device_index(tensor: torch.Tensor) -> int:
    """The CUDA device index of ``tensor`` (which must live on a CUDA device)."""
    index = tensor.device.index
    return torch.cuda.current_device() if index is None else index
