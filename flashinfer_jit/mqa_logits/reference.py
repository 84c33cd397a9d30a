"""The composable torch path of ``fp8_paged_mqa_logits``: CPU tensors and every call the
kernels cannot serve. It follows the documented numerics:

- the per-head dot product accumulates in ``acc_dtype``; for float16 that is emulated
  as the tensor core does it at the granularity that matters, a float32 partial per
  32-wide k step added into a float16 accumulator (one rounding per step);
- ReLU, the weights multiply, the head sum and the scale multiply run in ``epi_dtype``
  (float16 products are rounded to float16; the head sum is rounded once at the end,
  so it overflows to inf exactly when the float16 result does);
- the result is converted to ``output_dtype`` on store.
"""

from __future__ import annotations

import torch

K_STEP = 32  # head_dim elements per tensor-core k step
_ROW_CHUNK_ELEMS = 1 << 26  # bound the [rows, heads, positions] intermediate (memory)


def split_kv_pool(kv_fused: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [num_blocks, block_size, head_dim] e4m3, scales [num_blocks, block_size] f32).

    Per block the pool holds all fp8 values token-major, then the fp32 scales.
    """
    num_blocks, block_size = kv_fused.shape[0], kv_fused.shape[1]
    flat = kv_fused.reshape(num_blocks, block_size * (head_dim + 4))
    values = flat[:, : block_size * head_dim].reshape(num_blocks, block_size, head_dim)
    scales = flat[:, block_size * head_dim :].contiguous().view(torch.float32)
    return values.view(torch.float8_e4m3fn), scales


def _scores(q: torch.Tensor, k: torch.Tensor, acc_dtype: torch.dtype) -> torch.Tensor:
    """q [R, N, D] float32, k [R, P, D] float32 -> [R, N, P] float32 with acc_dtype rounding."""
    if acc_dtype == torch.float32:
        return torch.einsum("rhd,rpd->rhp", q, k)
    acc = None
    for start in range(0, q.shape[-1], K_STEP):
        step = torch.einsum(
            "rhd,rpd->rhp", q[..., start : start + K_STEP], k[..., start : start + K_STEP]
        )
        acc = step.half() if acc is None else (acc.float() + step).half()
    return acc.float()


def _epilogue(
    s: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, epi_dtype: torch.dtype
) -> torch.Tensor:
    """s [R, H, P] f32, w [R, H] f32, scale [R, P] f32 -> logits [R, P] in epi precision."""
    if epi_dtype == torch.float32:
        return torch.einsum("rhp,rh->rp", s.clamp_min(0), w) * scale
    terms = (s.half().clamp_min(0) * w.half()[:, :, None]).float()
    head_sum = terms.sum(dim=1).half()
    return (head_sum * scale.half()).float()


def paged_mqa_logits_torch(
    q: torch.Tensor,
    kv_fused: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    epi_dtype: torch.dtype,
    acc_dtype: torch.dtype,
) -> None:
    """Write logits into ``out`` ([>= B*next_n, >= covered columns], output dtype).

    Rows of requests with seq_lens == 0 are left untouched; other rows get every column
    of the request's KV blocks (positions past the valid limit are unspecified).
    """
    batch, next_n, heads, dim = q.shape
    block_size = kv_fused.shape[1]
    lens = seq_lens.to("cpu", torch.int64)
    if batch == 0 or int(lens.max()) <= 0:
        return
    values, scales = split_kv_pool(kv_fused, dim)
    qf = q.float().reshape(batch, next_n * heads, dim)
    wf = weights.float().reshape(batch * next_n, heads)
    per_request = max(1, (next_n * heads + dim) * int(lens.max()))
    rows_per_chunk = max(1, _ROW_CHUNK_ELEMS // per_request)
    for first in range(0, batch, rows_per_chunk):
        reqs = range(first, min(batch, first + rows_per_chunk))
        width = max(-(-int(lens[b]) // block_size) for b in reqs)
        if width == 0:
            continue
        ids = block_tables[first : first + len(reqs), :width].long()
        # Entries past a request's own blocks may hold anything: point them at block 0.
        need = torch.tensor([-(-int(lens[b]) // block_size) for b in reqs], device=ids.device)
        ids = torch.where(torch.arange(width, device=ids.device)[None, :] < need[:, None], ids, 0)
        k = values[ids].float().reshape(len(reqs), width * block_size, dim)
        sc = scales[ids].reshape(len(reqs), width * block_size)
        s = _scores(qf[first : first + len(reqs)], k, acc_dtype)
        s = s.reshape(len(reqs) * next_n, heads, width * block_size)
        rows = slice(first * next_n, (first + len(reqs)) * next_n)
        logits = _epilogue(s, wf[rows], sc.repeat_interleave(next_n, dim=0), epi_dtype)
        for i, b in enumerate(reqs):
            cols = need[i].item() * block_size
            if cols:
                out[b * next_n : (b + 1) * next_n, :cols] = logits[
                    i * next_n : (i + 1) * next_n, :cols
                ]
