"""Measured choices for concat_mla_kv_quant_fp8: which backend ``auto`` prefers, and
each backend's plan (cake head group, specialized heads per warp), per workload point.

They live in the ``"tuned"`` block of ``mla_kv_pack/workloads.json``:

    "tuned": {"device": "...", "heads": [H...], "tokens": [T...],
              "auto": [["cake" | "specialized", ... per T] ... per H],
              "cake_head_group": [[G ...] ...], "specialized_heads_per_warp": [[n ...] ...]}

``tools/bench_mla_kv_pack.py`` measures every variant at every point and writes the
block (``--write-tuned``). The op plans from the two plan tables; its ``auto`` policy is
a per-arch rule in ``heuristics.py`` (sm_90's derived from the benchmark's serving measure
by ``tools/mla_kv_pack_rule.py``; the ``auto`` table here is a per-point record of the
``--variants`` measure, not used by the op). A call between measured points takes the nearest measured
point in log scale (heads, then tokens); without a block the heuristics in the backends
decide. Every value is checked on load, so a bad file cannot pick an invalid program.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path

BACKENDS = ("specialized", "cake")
TABLES = ("auto", "cake_head_group", "specialized_heads_per_warp")


def _nearest(points: list[int], x: int) -> int:
    """Index of the point nearest ``x`` in log scale (``points`` ascending)."""
    i = bisect.bisect_left(points, x)
    if i == 0:
        return 0
    if i == len(points):
        return len(points) - 1
    below, above = points[i - 1], points[i]
    return i if math.log(above / x) < math.log(x / below) else i - 1


class Tuned:
    """The ``tuned`` block, validated; ``get(table, tokens, heads)`` is None when absent."""

    def __init__(self, block: dict | None, head_groups: tuple[int, ...]):
        self.tables: dict[str, list[list]] = {}
        self.heads: list[int] = []
        self.tokens: list[int] = []
        if not block:
            return
        heads, tokens = [int(h) for h in block["heads"]], [int(t) for t in block["tokens"]]
        if heads != sorted(set(heads)) or tokens != sorted(set(tokens)) or min(heads + tokens) < 1:
            raise ValueError("tuned heads/tokens must be ascending, distinct and positive")
        valid = {
            "auto": lambda v: v in BACKENDS,
            "cake_head_group": lambda v: v in head_groups,
            "specialized_heads_per_warp": lambda v: isinstance(v, int) and v >= 1,
        }
        for name in TABLES:
            rows = block.get(name)
            if rows is None:
                continue
            if len(rows) != len(heads) or any(len(r) != len(tokens) for r in rows):
                raise ValueError(f"tuned {name} must be {len(heads)} rows of {len(tokens)}")
            bad = [v for r in rows for v in r if not valid[name](v)]
            if bad:
                raise ValueError(f"tuned {name} has invalid entries {bad[:3]}")
            self.tables[name] = rows
        self.heads, self.tokens = heads, tokens

    def get(self, table: str, tokens: int, heads: int):
        rows = self.tables.get(table)
        if rows is None:
            return None
        return rows[_nearest(self.heads, heads)][_nearest(self.tokens, tokens)]


def load(path: Path, head_groups: tuple[int, ...]) -> Tuned:
    return Tuned(json.loads(path.read_text()).get("tuned"), head_groups)


def block_from_measurements(rows: list[dict], device: str) -> dict:
    """The ``tuned`` block from the benchmark's rows (each: tokens, heads, variants with
    backend, param and us): the fastest variant of each backend, and the faster one."""
    heads = sorted({r["heads"] for r in rows})
    tokens = sorted({r["tokens"] for r in rows})
    by_point = {(r["heads"], r["tokens"]): r for r in rows}
    out: dict = {"device": device, "heads": heads, "tokens": tokens}
    tables: dict[str, list[list]] = {name: [] for name in TABLES}
    for h in heads:
        for name in TABLES:
            tables[name].append([])
        for t in tokens:
            # A point not measured (skipped as too large) copies its nearest measured one.
            row = by_point.get((h, t)) or min(
                (r for r in rows if r["heads"] == h), key=lambda r: abs(math.log(r["tokens"] / t))
            )
            best = {}
            for v in row["variants"].values():
                if v["backend"] not in best or v["us"] < best[v["backend"]]["us"]:
                    best[v["backend"]] = v
            cake, spec = best.get("cake"), best.get("specialized")
            faster = (
                "cake"
                if spec is None or (cake is not None and cake["us"] < spec["us"])
                else "specialized"
            )
            tables["auto"][-1].append(faster)
            tables["cake_head_group"][-1].append(cake["param"] if cake else 1)
            tables["specialized_heads_per_warp"][-1].append(spec["param"] if spec else max(1, h))
    out.update(tables)
    return out
