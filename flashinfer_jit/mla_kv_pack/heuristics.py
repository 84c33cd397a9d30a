"""Which fused backend ``auto`` tries first, and each backend's plan: measured per
workload point (``tuning``), else the backends' heuristics."""

from __future__ import annotations

from pathlib import Path

from . import cake, specialized, tuning

WORKLOADS = Path(__file__).parent / "workloads.json"
# Measured per-point choices (workloads JSON, "tuned"); the heuristics fill gaps.
TUNED = tuning.load(WORKLOADS, cake.HEAD_GROUPS)


def plan_specialized(tokens: int, heads: int) -> int:
    """Heads per warp for the specialized kernel: measured, else the heuristic."""
    tuned = TUNED.get("specialized_heads_per_warp", tokens, heads)
    return min(tuned, heads) if tuned is not None else specialized.heads_per_warp(tokens, heads)


def plan_cake(tokens: int, heads: int, sms: int) -> int:
    """Head pairs per warp for the cake programs: measured, else the heuristic."""
    tuned = TUNED.get("cake_head_group", tokens, heads)
    return tuned if tuned is not None else cake.plan_head_group(tokens, heads, sms)


# ``auto``'s policy, per compute capability, from kernel times (tools/bench_mla_kv_pack.py,
# back-to-back calls in CUDA graphs, median of interleaved rounds; BENCHMARKS.md).
# sm_90 (H200, measured): the specialized kernel wins with one head at every token count
# (its warp-per-token layout; 131072 x 1: 37.3 vs 43.7 µs) and for calls of at most 16
# tokens (16 x 128: 2.21 vs 2.30 µs); cake wins or ties (within 2.5 %) everywhere else.
# sm_100/sm_103 (not measured here): the seed's rule from GB300/B200 numbers, the fully
# unrolled specialized variant for 12 local heads and cake for every other head count.
_SM90_SPECIALIZED_MAX_TOKENS = 16


def _auto_first(tokens: int, heads: int, cap: tuple[int, int]) -> str:
    if cap == (9, 0):
        return "specialized" if heads == 1 or tokens <= _SM90_SPECIALIZED_MAX_TOKENS else "cake"
    return "specialized" if heads == 12 else "cake"


def auto_order(tokens: int, heads: int, cap: tuple[int, int] = (9, 0)) -> tuple[str, str]:
    """The fused backends in the order ``auto`` tries them on compute capability ``cap``."""
    first = _auto_first(tokens, heads, cap)
    return ("specialized", "cake") if first == "specialized" else ("cake", "specialized")
