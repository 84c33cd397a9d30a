"""The CTA schedule of ``fp8_paged_mqa_logits``: ``compute_paged_mqa_logits_schedule``
(a small GPU kernel, or the same rule on the host) and its torch reference."""

from __future__ import annotations

import torch

from jit_kernels import (
    I32,
    I64,
    PTR,
    KernelUnavailable,
    current_stream,
    fall_back,
    kernels_disabled,
    sm_count,
)
from jit_kernels.args import require_int, require_no_overlap

from .._jit import cuda_device_index, kernel_family
from .checks import BLOCK_SIZES, TILE

SCHEDULE_THREADS = 256


schedule_family = kernel_family(
    "mqa_logits_schedule",
    "mqa_logits/util.cuh",
    "fij_mqa::paged_mqa_schedule",
    ("threads",),
    (PTR, I64, I32, PTR),
)


def compute_paged_mqa_logits_schedule(
    seq_lens: torch.Tensor,
    block_size: int = 64,
    num_sms: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CTA schedule ``fp8_paged_mqa_logits`` derives from ``seq_lens``: ``[num_sms+1, 2]``
    int32, row c = (request, 64-token tile) where SM c's balanced share of the KV tiles
    begins; row num_sms = (batch, 0). One small GPU kernel (graph-capturable).

    ``block_size`` is accepted for API symmetry; the split is in 64-token tiles for every
    block size. Reuse the result only while the contents of ``seq_lens`` are unchanged.
    """
    if (
        not isinstance(seq_lens, torch.Tensor)
        or seq_lens.dim() != 1
        or seq_lens.dtype != torch.int32
    ):
        raise ValueError("seq_lens must be a 1-D int32 tensor [batch_size]")
    if require_int("block_size", block_size) not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    on_cuda = seq_lens.device.type == "cuda"
    if num_sms is None:
        num_sms = sm_count(cuda_device_index(seq_lens)) if on_cuda else 1
    num_sms = require_int("num_sms", num_sms, 1)
    if out is None:
        out = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=seq_lens.device)
    elif out.shape != (num_sms + 1, 2) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor of shape {(num_sms + 1, 2)}")
    else:
        require_no_overlap({"out": out}, {"seq_lens": seq_lens})
    if on_cuda and not kernels_disabled():
        try:
            device = cuda_device_index(seq_lens)
            kernel = schedule_family.get((SCHEDULE_THREADS,), device)
            args = (seq_lens.data_ptr(), seq_lens.stride(0), seq_lens.shape[0], out.data_ptr())
            kernel.launch(
                (num_sms + 1, 1, 1), (SCHEDULE_THREADS, 1, 1), current_stream(device), args
            )
            return out
        except KernelUnavailable as exc:
            fall_back("compute_paged_mqa_logits_schedule", str(exc))
    out.copy_(schedule_torch(seq_lens, num_sms))
    return out


def schedule_torch(seq_lens: torch.Tensor, num_sms: int) -> torch.Tensor:
    """The schedule computed on the host (same rule as the kernel)."""
    tiles = (seq_lens.to("cpu", torch.int64).clamp_min(0) + TILE - 1) // TILE
    starts = torch.cumsum(tiles, 0) - tiles
    total = int(tiles.sum())
    rows = []
    for c in range(num_sms + 1):
        x = c * total // num_sms
        hit = ((starts <= x) & (x < starts + tiles)).nonzero()
        rows.append((int(hit[0]), x - int(starts[hit[0]])) if len(hit) else (len(tiles), 0))
    return torch.tensor(rows, dtype=torch.int32)


def check_current(schedule: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """A given schedule must be the one these lengths give (jit_kernels.validate_values: CPU
    tensors, and on a GPU under FLASHINFER_VALIDATE_INPUTS=1, where it syncs): one computed
    for other lengths hands a CTA more tiles than its run holds, which only the padding of
    some kernels absorbs."""
    current = compute_paged_mqa_logits_schedule(seq_lens, 64, schedule.shape[0] - 1)
    if not torch.equal(current.cpu(), schedule.cpu()):
        raise ValueError(
            "schedule_meta is not compute_paged_mqa_logits_schedule(seq_lens) of this call's "
            "seq_lens: reuse a schedule only while the lengths it was computed from hold"
        )
