"""Argument rules every op shares: integers that are ints, outputs that overlap nothing.

Both raise before anything is launched, naming the argument: a ``True`` size or a float
one would otherwise be silently taken as 1 or truncated, and an output that shares
memory with another output or an input is read back half-written by the kernel.
"""

from __future__ import annotations

import operator

import torch

# Above this many bytes a non-contiguous pair is not compared byte by byte (the check
# would allocate more than the call); like ATen's "too hard" case, it is let through.
_EXACT_LIMIT = 1 << 20


def require_int(name: str, value: object, minimum: int | None = None) -> int:
    """``value`` as an int: TypeError for bools, floats and others, ValueError below ``minimum``.

    Integer-like objects (numpy integers, 0-d integer tensors) pass through ``__index__``."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    number = operator.index(value)
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {number}")
    return number


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, past the last byte) that ``t`` can touch; None when it is empty."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _byte_offsets(t: torch.Tensor, base: int) -> torch.Tensor:
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets[..., None] + torch.arange(size) * stride
    width = t.element_size()
    data = offsets.reshape(-1, 1) * width + torch.arange(width)
    return data.reshape(-1) + (t.data_ptr() - base)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte (exact for dense tensors and small spans)."""
    if a.device != b.device:
        return False
    span_a, span_b = _span(a), _span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True  # each covers its whole span
    low, high = min(span_a[0], span_b[0]), max(span_a[1], span_b[1])
    if high - low > _EXACT_LIMIT:
        return False
    marks = torch.zeros(high - low, dtype=torch.bool)
    marks[_byte_offsets(a, low)] = True
    return bool(marks[_byte_offsets(b, low)].any())


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def require_no_overlap(
    outputs: dict[str, torch.Tensor | None],
    inputs: dict[str, torch.Tensor | None],
    in_place: tuple[str, ...] = (),
) -> None:
    """ValueError naming the pair when an output shares memory with another output or an
    input (``None`` entries are skipped). Inputs named in ``in_place`` may be the very same
    view as an output (an op reading them element by element, like a gate, can work in
    place); a partial overlap is still an error. Skipped while torch.compile traces (fake
    tensors have no addresses)."""
    if torch.compiler.is_compiling():
        return
    outs = [(n, t) for n, t in outputs.items() if isinstance(t, torch.Tensor)]
    ins = [(n, t) for n, t in inputs.items() if isinstance(t, torch.Tensor)]
    for i, (name, out) in enumerate(outs):
        for other, t in [*outs[i + 1 :], *ins]:
            if other in in_place and _same_view(out, t):
                continue
            if overlaps(out, t):
                raise ValueError(
                    f"{name} overlaps {other} in memory: an output must not share memory "
                    "with another output or an input"
                )
