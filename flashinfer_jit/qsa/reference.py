"""The composable torch path of QSA sparse paged decode: the reference semantics.

It serves CPU tensors and every call the kernels cannot take. Products and sums are in
float32 (e4m3 codes decode exactly); rows are processed in slices so the gathered K/V of
a large batch never has to exist all at once.
"""

from __future__ import annotations

import torch

# Gathered tokens (rows x TOPK) per slice of the torch path: bounds its temporaries.
_TOKENS_PER_SLICE = 1 << 16


def decode_cache_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of a cache slice: uint8 holds e4m3 codes, other dtypes are values."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.float()


def resolve_entries(
    logical_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    num_blocks: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(physical page, page offset, attended) per [row, entry], int64/int64/bool.

    Entry j of row r is attended when j < min(valid_count, TOPK), the logical index is
    >= 0, its page is inside the block-table row, the request is in [0, num_requests)
    and the physical page is in [0, num_blocks). Unattended entries get page/offset 0.
    """
    rows, width = logical_indices.shape
    topk = width - 1
    device = logical_indices.device
    logical = logical_indices[:, :topk].long()
    count = logical_indices[:, topk].long().clamp(0, topk)
    request = token_to_req.long()
    num_requests, table_width = block_table.shape
    attended = torch.arange(topk, device=device)[None, :] < count[:, None]
    attended &= logical >= 0
    attended &= ((request >= 0) & (request < num_requests))[:, None]
    page = logical.clamp(min=0) // page_size
    offset = logical.clamp(min=0) % page_size
    attended &= page < table_width
    if num_requests == 0 or table_width == 0:
        physical = torch.zeros_like(page)
        attended &= False
    else:
        safe_request = request.clamp(0, num_requests - 1)[:, None].expand_as(page)
        physical = block_table[safe_request, page.clamp(max=table_width - 1)].long()
    attended &= (physical >= 0) & (physical < num_blocks)
    zero = torch.zeros_like(page)
    return torch.where(attended, physical, zero), torch.where(attended, offset, zero), attended


def qsa_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    logical_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    out: torch.Tensor,
    output_gate: torch.Tensor,
    softmax_scale: float,
    output_scale: float,
) -> torch.Tensor:
    """Write the gated sparse attention of ``q`` over the selected cache tokens into ``out``."""
    rows, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    topk = logical_indices.shape[1] - 1
    if rows == 0:
        return out
    if num_blocks == 0:  # no token to attend: every row is zero
        return out.zero_()
    page, offset, attended = resolve_entries(
        logical_indices, block_table, token_to_req, num_blocks, page_size
    )
    step = max(1, _TOKENS_PER_SLICE // max(topk, 1))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        n = r1 - r0
        sel_page, sel_off, mask = page[r0:r1], offset[r0:r1], attended[r0:r1]
        # Unattended entries gather slot (0, 0), which may lie in an unused block holding
        # anything (NaN codes in an uninitialised pool; 0 * NaN is NaN): zero them, as the
        # kernels never read them.
        keep = mask[:, :, None, None]
        keys = decode_cache_values(k_cache[sel_page, sel_off]).where(keep, 0.0)  # [n, topk, Hkv, D]
        values = decode_cache_values(v_cache[sel_page, sel_off]).where(keep, 0.0)
        query = q[r0:r1].float().view(n, num_kv_heads, group, head_dim)
        scores = torch.einsum("nhgd,nthd->nhgt", query, keys) * softmax_scale
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        top = (
            scores.amax(dim=-1, keepdim=True)
            if topk
            else scores.new_zeros(n, num_kv_heads, group, 1)
        )
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        probs = torch.exp(scores - top)  # masked entries: exp(-inf) = 0
        denom = probs.sum(dim=-1, keepdim=True)
        acc = torch.einsum("nhgt,nthd->nhgd", probs, values)
        normalized = torch.where(denom > 0, acc / denom.clamp(min=1e-30), torch.zeros_like(acc))
        gate = torch.sigmoid(output_gate[r0:r1].float())
        result = normalized.reshape(n, num_q_heads, head_dim) * output_scale * gate
        # A row with nothing attended is zero whatever its gate holds (no NaN leaks in).
        empty = (denom == 0).reshape(n, num_kv_heads, group, 1).expand(-1, -1, -1, head_dim)
        result = result.masked_fill(empty.reshape(n, num_q_heads, head_dim), 0.0)
        out[r0:r1].copy_(result.to(out.dtype))
    return out
