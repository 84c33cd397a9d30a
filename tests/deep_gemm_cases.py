"""Inputs and a float64 reference for flashinfer_jit.deep_gemm, in DeepGEMM's terms.

Written from the contract alone (DeepGEMM's fused pool layout and length semantics), not
from the package: the reference reads per-token keys and scales kept beside the pool, so
a wrong pool layout, block stride or length rule in the code under test shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn


@dataclass
class Case:
    q: torch.Tensor  # [B, next_n, H, D] e4m3
    kv_cache: torch.Tensor  # [num_blocks, block_kv, 1, D + 4] uint8, DeepGEMM's fused layout
    weights: torch.Tensor  # [B * next_n, H] float32
    context_lens: torch.Tensor  # [B] or [B, next_n] int32
    block_table: torch.Tensor  # [B, width] int32
    max_context_len: int
    keys: list[torch.Tensor]  # per request [L_b, D] float64 (decoded e4m3)
    scales: list[torch.Tensor]  # per request [L_b] float64


def visible(context_lens: torch.Tensor, next_n: int) -> list[int]:
    """Positions each output row sees, from DeepGEMM's rules (1-D: <= len - next_n + t;
    2-D: < len[b, t])."""
    lens = context_lens.cpu().tolist()
    if context_lens.dim() == 2:
        return [max(0, n) for row in lens for n in row]
    return [max(0, n - next_n + 1 + t) for n in lens for t in range(next_n)]


def make_case(
    lens: list[int],
    next_n: int = 2,
    heads: int = 32,
    dim: int = 128,
    block_kv: int = 64,
    two_d: bool = False,
    block_pad: int = 0,
    seed: int = 0,
    device: str = "cpu",
) -> Case:
    """``lens``: each request's newest-slot length. 2-D lens give earlier slots random
    lengths in [0, len] (as DeepGEMM's test does). ``block_pad``: extra bytes between blocks
    (a pool carved from a wider buffer, DeepGEMM's free block stride)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    q = (torch.randn(batch, next_n, heads, dim, generator=g) * 2).to(E4M3)
    weights = torch.randn(batch * next_n, heads, generator=g)
    width = max(1, max(-(-n // block_kv) for n in lens))
    num_blocks = batch * width + 3
    order = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width)
    stride = block_kv * (dim + 4) + block_pad
    # Filler bytes (unused blocks, padding) from their own stream: the padding must not
    # change the keys, so padded and dense pools of one seed hold the same request data.
    filler = torch.Generator().manual_seed(seed + 1)
    flat = torch.randint(0, 256, (num_blocks * stride,), dtype=torch.uint8, generator=filler)
    keys, scales = [], []
    for b, n in enumerate(lens):
        k = (torch.randn(n, dim, generator=g) * 3).to(E4M3)
        sc = torch.rand(n, generator=g) + 0.25
        keys.append(k.double())
        scales.append(sc.double())
        for pos in range(n):
            base = int(order[b, pos // block_kv]) * stride
            off = pos % block_kv
            flat[base + off * dim : base + (off + 1) * dim] = k[pos].view(torch.uint8)
            at = base + block_kv * dim + 4 * off
            flat[at : at + 4] = sc[pos : pos + 1].view(torch.uint8)
    kv = flat.as_strided((num_blocks, block_kv, 1, dim + 4), (stride, dim + 4, dim + 4, 1))
    table = order.to(torch.int32)
    for b, n in enumerate(lens):  # entries past a request's blocks may hold anything
        table[b, -(-n // block_kv) :] = -7
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if two_d:
        frac = torch.rand(batch, next_n, generator=g)
        lens_t = ((lens_t[:, None] + 1) * frac).to(torch.int32)
        lens_t[:, -1] = torch.tensor(lens, dtype=torch.int32)
    max_len = max(lens) + 5
    to = (q, kv, weights, lens_t, table)
    q, kv, weights, lens_t, table = (t.to(device) for t in to)
    return Case(q, kv, weights, lens_t, table, max_len, keys, scales)


def reference(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per output row: (logits float64 over its visible positions, magnitude for tolerances)."""
    batch, next_n = case.q.shape[:2]
    rows = []
    vis = visible(case.context_lens, next_n)
    for b in range(batch):
        for t in range(next_n):
            n = vis[b * next_n + t]
            qt = case.q[b, t].cpu().double()
            wt = case.weights[b * next_n + t].cpu().double()
            k, sc = case.keys[b][:n], case.scales[b][:n]
            s = qt @ k.T
            vals = (s.clamp_min(0) * wt[:, None]).sum(0) * sc
            mag = ((qt.abs() @ k.abs().T) * wt.abs()[:, None]).sum(0) * sc
            rows.append((vals, mag))
    return rows


def check(logits: torch.Tensor, case: Case, clean_logits: bool, rtol: float = 2e-3) -> None:
    """Visible positions match the reference; with clean_logits, every other position up to
    max_context_len is -inf."""
    next_n = case.q.shape[1]
    assert logits.shape == (case.q.shape[0] * next_n, case.max_context_len)
    got_all = logits.double().cpu()
    bf16 = logits.dtype == torch.bfloat16
    for row, (vals, mag) in enumerate(reference(case)):
        got = got_all[row, : len(vals)]
        tol = rtol * mag + (2**-8 * vals.abs() if bf16 else 0) + 1e-6
        bad = (~((got - vals).abs() <= tol)).nonzero()  # NaN (an unwritten poison) is bad
        assert len(bad) == 0, (
            f"row {row}: {len(bad)} mismatches, first at {int(bad[0])}: "
            f"got {float(got[bad[0]])} want {float(vals[bad[0]])}"
        )
        if clean_logits:
            assert (got_all[row, len(vals) :] == float("-inf")).all(), f"row {row} not cleaned"
