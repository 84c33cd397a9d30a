"""Argument rules every op shares: integers that are ints, outputs that overlap nothing.

Both raise before anything is launched, naming the argument: a ``True`` size or a float
one would otherwise be silently taken as 1 or truncated, and an output that shares
memory with another output or an input is read back half-written by the kernel.
"""

from __future__ import annotations

import math
import operator

import torch

# Past this many contiguous runs a tensor's bytes are not enumerated (the check would
# allocate more than the call); like ATen's "too hard" case, such a pair is let through.
_RUN_LIMIT = 1 << 22


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


def _runs(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(sorted first bytes, from t's address, of its contiguous runs; a run's bytes): the
    innermost dims merged while each continues the bytes of those inside it. None past
    _RUN_LIMIT runs."""
    width = t.element_size()
    dims = sorted(((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1))
    run = width
    while dims and dims[0][0] * width == run:
        run *= dims.pop(0)[1]
    if math.prod(sz for _, sz in dims) > _RUN_LIMIT:
        return None
    starts = torch.zeros((), dtype=torch.int64)
    for st, sz in dims:
        starts = starts[..., None] + torch.arange(sz) * (st * width)
    return starts.reshape(-1).sort().values, run


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a byte (exact up to _RUN_LIMIT contiguous runs each)."""
    if a.device != b.device:
        return False
    span_a, span_b = _span(a), _span(b)
    if span_a is None or span_b is None or span_a[1] <= span_b[0] or span_b[1] <= span_a[0]:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True  # each covers its whole span
    runs_a, runs_b = _runs(a), _runs(b)
    if runs_a is None or runs_b is None:
        return False
    (starts_a, run_a), (starts_b, run_b) = runs_a, runs_b
    starts_b = starts_b + (b.data_ptr() - a.data_ptr())
    # b's run [t, t + run_b) meets a's [s, s + run_a) iff s < t + run_b and t < s + run_a;
    # a's runs are sorted and equally long, so the last one starting below t + run_b decides.
    last = torch.searchsorted(starts_a, starts_b + run_b) - 1
    meets = starts_a[last.clamp(min=0)] + run_a > starts_b
    return bool((meets & (last >= 0)).any())


def overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two of ``t``'s elements share a byte (an expand()ed or as_strided view)."""
    if t.numel() <= 1 or t.is_contiguous():
        return False
    runs = _runs(t)
    if runs is None:
        return False
    starts, run = runs
    return bool((starts[1:] < starts[:-1] + run).any())


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
    """ValueError naming the pair when an output shares memory with itself, another output
    or an input (``None`` entries are skipped). Inputs named in ``in_place`` may be the very same
    view as an output (an op reading them element by element, like a gate, can work in
    place); a partial overlap is still an error. Skipped while torch.compile traces (fake
    tensors have no addresses)."""
    if torch.compiler.is_compiling():
        return
    outs = [(n, t) for n, t in outputs.items() if isinstance(t, torch.Tensor)]
    ins = [(n, t) for n, t in inputs.items() if isinstance(t, torch.Tensor)]
    for i, (name, out) in enumerate(outs):
        if overlaps_itself(out):
            raise ValueError(
                f"{name} overlaps itself in memory (an expand()ed or as_strided view): an "
                "output's elements must not share memory"
            )
        for other, t in [*outs[i + 1 :], *ins]:
            if other in in_place and _same_view(out, t):
                continue
            if overlaps(out, t):
                raise ValueError(
                    f"{name} overlaps {other} in memory: an output must not share memory "
                    "with another output or an input"
                )
