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


# ``auto``'s policy, per compute capability, from kernel times.
# sm_90 (H200, measured 2026-12-02): per call in a CUDA graph, inputs cycled past 4x L2
# (tools/bench_mla_kv_pack.py's serving measure; the points are in
# docs/perf-log/mla_kv_pack_sm90_serving.json and a CPU test checks this table against
# them; tools/mla_kv_pack_rule.py derives it). From each head count on (up to the next
# entry), the most tokens a call may have for ``specialized`` to go first (None: any),
# else ``cake``. specialized wins at one and four heads at every token count (its
# warp-per-token layout: 65536 x 1 19.8 against cake's 23.0 us, 16384 x 4 16.6 against
# 17.7) and for small calls; cake wins once a call moves enough bytes (128 x 128 5.27
# against 5.53 us). Worst auto/faster over 132 points: 1.027 (4096 x 4).
SM90_SPECIALIZED_MAX_TOKENS: tuple[tuple[int, int | None], ...] = (
    (1, None),
    (2, 4096),
    (4, None),
    (8, 1024),
    (12, 512),
    (32, 128),
    (128, 64),
)


def specialized_first(table: tuple[tuple[int, int | None], ...], tokens: int, heads: int) -> bool:
    """Whether ``table`` (as SM90_SPECIALIZED_MAX_TOKENS) sends tokens x heads to
    specialized first: the entry of the largest head count at most ``heads`` decides."""
    limit: int | None = 0
    for first_heads, max_tokens in table:
        if heads < first_heads:
            break
        limit = max_tokens
    return limit is None or tokens <= limit


# sm_100/sm_103 (not measured here): the seed's rule from GB300/B200 numbers, the fully
# unrolled specialized variant for 12 local heads and cake for every other head count.
def _auto_first(tokens: int, heads: int, cap: tuple[int, int]) -> str:
    if cap == (9, 0):
        hit = specialized_first(SM90_SPECIALIZED_MAX_TOKENS, tokens, heads)
        return "specialized" if hit else "cake"
    return "specialized" if heads == 12 else "cake"


def auto_order(tokens: int, heads: int, cap: tuple[int, int] = (9, 0)) -> tuple[str, str]:
    """The fused backends in the order ``auto`` tries them on compute capability ``cap``."""
    first = _auto_first(tokens, heads, cap)
    return ("specialized", "cake") if first == "specialized" else ("cake", "specialized")
