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
# sm_90 (H200, measured): ``specialized`` first when any clause of ``SM90_SPECIALIZED``
# covers the call, else ``cake``. A clause is (max tokens, max heads, max tokens x heads),
# None for no bound. The clauses are derived by ``tools/mla_kv_pack_rule.py`` from
# ``tools/bench_mla_kv_pack.py``'s serving measure (per call in a CUDA graph, inputs
# cycled past 4x L2): the simplest rule that keeps ``auto`` within 3 % of the faster
# backend at every measured point; ``docs/perf-log/mla_kv_pack_sm90_serving.json`` (when
# committed) holds those points and a test checks this rule against them.
# Until then: the rule from back-to-back calls over warm inputs (one head at every token
# count; calls of at most 16 tokens).
SM90_SPECIALIZED: tuple[tuple[int | None, int | None, int | None], ...] = (
    (None, 1, None),
    (16, None, None),
)


def covers(clause: tuple[int | None, int | None, int | None], tokens: int, heads: int) -> bool:
    """Whether ``tokens`` x ``heads`` lies within every bound of ``clause``."""
    max_tokens, max_heads, max_work = clause
    return (
        (max_tokens is None or tokens <= max_tokens)
        and (max_heads is None or heads <= max_heads)
        and (max_work is None or tokens * heads <= max_work)
    )


# sm_100/sm_103 (not measured here): the seed's rule from GB300/B200 numbers, the fully
# unrolled specialized variant for 12 local heads and cake for every other head count.
def _auto_first(tokens: int, heads: int, cap: tuple[int, int]) -> str:
    if cap == (9, 0):
        hit = any(covers(c, tokens, heads) for c in SM90_SPECIALIZED)
        return "specialized" if hit else "cake"
    return "specialized" if heads == 12 else "cake"


def auto_order(tokens: int, heads: int, cap: tuple[int, int] = (9, 0)) -> tuple[str, str]:
    """The fused backends in the order ``auto`` tries them on compute capability ``cap``."""
    first = _auto_first(tokens, heads, cap)
    return ("specialized", "cake") if first == "specialized" else ("cake", "specialized")
