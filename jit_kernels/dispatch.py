"""Choosing between a specialized kernel, a generic one and the torch path.

The switches are read at call time so a serving process can flip them without a restart:

- ``FLASHINFER_SPECIALIZED_KERNEL_DISABLE=1``: every op takes its torch path.
- ``FLASHINFER_JIT_STRICT=1``: falling back from a kernel raises instead of logging.
- ``FLASHINFER_VALIDATE_INPUTS=1``: ops check device-side preconditions (syncs); on
  CPU tensors, where reading them costs no sync, they always do (``validate_values``).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("flashinfer_jit")

DISABLE_ENV = "FLASHINFER_SPECIALIZED_KERNEL_DISABLE"
STRICT_ENV = "FLASHINFER_JIT_STRICT"
VALIDATE_ENV = "FLASHINFER_VALIDATE_INPUTS"

_reported: set[tuple[str, str]] = set()


class FallbackError(RuntimeError):
    """Raised in strict mode where an op would have left its kernels."""


def kernels_disabled() -> bool:
    return os.environ.get(DISABLE_ENV) == "1"


def validate_inputs() -> bool:
    return os.environ.get(VALIDATE_ENV) == "1"


def validate_values(device: torch.device) -> bool:
    """Whether an op checks the values of its inputs on ``device`` (lengths, table entries):
    always off the GPU, where reading them costs no sync and the torch path would otherwise
    index with them as given; on a GPU under FLASHINFER_VALIDATE_INPUTS=1, except during
    graph capture (a check syncs). Never while torch.compile traces (fake tensors hold no
    values: the compiled call checks them when its custom op runs)."""
    if torch.compiler.is_compiling():
        return False
    if device.type != "cuda":
        return True
    return validate_inputs() and not torch.cuda.is_current_stream_capturing()


def fall_back(op: str, reason: str) -> None:
    """Record that ``op`` left its fast path: an error in strict mode, else logged once."""
    if os.environ.get(STRICT_ENV) == "1":
        raise FallbackError(f"{op}: {reason} ({STRICT_ENV}=1)")
    if (op, reason) not in _reported:
        _reported.add((op, reason))
        log.warning("%s: falling back: %s", op, reason)
