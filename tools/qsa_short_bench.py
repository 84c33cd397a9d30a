"""``tools/bench_qsa.py --short [--json F]``: the short single pass (flashinfer_jit/qsa/short.py,
opt-in, not dispatched) beside the shipped single pass and the seed's Triton kernel, at issue
22's short selections over many rows (and one long selection as a guard).

Per point, every column is checked against the torch path, captured as a CUDA graph of one
call per input set (sets cycled past 4x L2, as the dispatch sweep) and timed in interleaved
rounds: "k1" the shipped single pass (slot pass + decode: ``qsa_sparse_paged_decode``);
"triton" the seed's kernel; "gather" the memory floor of the call's selection
(tools/qsa_gather_floor.py: the gather probe, the faster of its two grids; until session
27 this column was an older one-grid probe, "probe", up to 1.9x slower); "k1s3" the single
pass at 3 stages (its shape until session 27); one column per
SHORT_CONFIGS entry in index order (no row order), and "+ord" columns with the slot pass's
row order. The table prints last; the JSON is rewritten after each point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from qsa_bench_grid import Point, reps_for
from qsa_bench_util import (
    BANDWIDTH,
    TOL,
    capture,
    check,
    floor_us,
    fmt,
    make_sets,
    n_sets_for,
    reference_of,
    table,
    time_graphs,
)
from qsa_dispatch_sweep import SEED_TOL, default_seed_path, load_seed
from qsa_gather_floor import fold_gather, gather_runs

from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import short as qs
from flashinfer_jit.qsa.op import run_kernels
from jit_kernels import prepare

# Issue 22's weakest points (floor >= 50 µs, under 85 %; docs/perf-log/qsa_dispatch_sweep.md:
# k1 / triton / floor µs), then a long selection the variant must not lose badly.
POINTS = [
    Point(4096, 16, 1, 256),  # 122.0 / 102.8 / 60.2
    Point(1024, 64, 4, 512),  # 165.3 / 163.3 / 107.9
    Point(1024, 64, 4, 256),  # 116.6 / 103.2 / 59.8
    Point(4096, 16, 1, 512),  # 173.3 / 166.9 / 109.1
    Point(512, 128, 8, 256),  # 118.6 / 103.7 / 59.9
    Point(4096, 8, 1, 512),  # 145.5 / 153.8 / 103.1 (G = 8: TMMA)
    Point(512, 32, 8, 512),  # 131.2 / 144.3 / 98.1 (G = 4: TMMA)
    Point(1024, 64, 4, 2048),  # 444.0 / 515.5 / 391.2
]
ORDERED = ("w1s2", "w1s4", "w2s2", "w4s2")  # configs also timed with the row order (+ord)
# The single pass with three bulk stages a warp, its shape until session 27 (two since: 3-8 %
# faster at topk 256-512 over 512-1536 pairs, where session 27 timed them as "k1s2"), "k1s3".
K1_THREE_STAGES = (4, 3, 4)


def columns(seed_fn: Callable | None) -> dict[str, tuple[Callable, float]]:
    """label -> (run(args), check tolerance)."""
    cols: dict[str, tuple[Callable, float]] = {"k1": (lambda a: run_kernels(a), TOL)}
    cols["k1s3"] = (lambda a: run_kernels(a, config=K1_THREE_STAGES, bulk=True), TOL)
    if seed_fn is not None:
        cols["triton"] = (lambda a: seed_fn(*a), SEED_TOL)
    for name, config in qs.SHORT_CONFIGS.items():
        for order in (False, True) if name in ORDERED else (False,):
            run = lambda a, c=config, o=order: run_kernels(a, config=c, short=True, order=o)  # noqa: E731
            cols[name + ("+ord" if order else "")] = (run, TOL)
    return cols


def plans(points: list[Point]) -> list:
    """Every kernel the points reach, for one parallel compile up front."""
    wanted = []
    for group in sorted({p.group for p in points}):
        for config in (qk.BULK_SINGLE_PASS, K1_THREE_STAGES):
            wanted.append(qk.decode_plan(group, 128, 0, False, True, config, True, True))
        for name, config in qs.SHORT_CONFIGS.items():
            for order in (False, True) if name in ORDERED else (False,):
                wanted.append(qs.short_plan(group, 128, True, config, True, order))
    return wanted + [qk.slot_plan(64, order, 4) for order in (True, False)]


def measure(point: Point, gib: float, cols: dict, index: int) -> dict:
    p = point
    sets = make_sets(p.rows, p.hq, p.hkv, p.topk, n_sets_for(p.rows, p.hkv, p.topk), gib,
                     seed=100 + index)  # fmt: skip
    expect = reference_of(sets[0])
    floor = statistics.mean(floor_us(a) for a in sets)
    kv_floor = statistics.mean(kv_floor_us(a) for a in sets)
    graphs, errors = {}, {}
    runs = {**cols, **{label: (run, None) for label, run in gather_runs(sets).items()}}
    for label, (run, tol) in runs.items():
        try:
            if tol is not None:  # (the gather writes no output: nothing to check)
                check(run, sets[0], expect, tol)
            graphs[label] = capture(run, sets)
        except Exception as exc:  # one bad column must not end the run
            errors[label] = f"ERR {type(exc).__name__}: {exc}"[:80]
            print(f"  {p.name} {label}: {errors[label]}", flush=True)
    times = time_graphs(graphs, len(sets), reps_for(floor, len(sets)))
    fold_gather(times)
    short = {k: v for k, v in times.items() if k in qs.SHORT_CONFIGS or k.endswith("+ord")}
    best = min(short, key=short.get) if short else None
    return {"name": p.name, "floor_us": floor, "kv_floor_us": kv_floor, "best_short": best,
            "times_us": {**times, **errors}, "sets": len(sets)}  # fmt: skip


def kv_floor_us(args) -> float:
    """The selected K/V bytes alone (what the gather reads of them) over BANDWIDTH."""
    k_cache, indices = args[1], args[3]
    tokens = indices[:, -1].clamp(0, indices.shape[1] - 1).sum().item()
    return tokens * k_cache.shape[2] * 2 * k_cache.shape[3] / BANDWIDTH


def row_cells(row: dict, labels: list[str]) -> list:
    t, floor = row["times_us"], row["floor_us"]
    best = row["best_short"]
    k1 = t.get("k1")
    gain = f"{k1 / t[best]:.2f}" if best and isinstance(k1, float) else "-"
    pct = f"{100 * floor / t[best]:.0f}%" if best else "-"
    return [row["name"], floor, row["kv_floor_us"], *[t.get(k) for k in labels], best, gain, pct]


def short_main(opts: argparse.Namespace, banner: Callable[[], dict]) -> None:
    """Compile, measure every point (none started past --time-limit), print the table."""
    deadline = time.perf_counter() + opts.time_limit
    start = time.perf_counter()
    points = POINTS
    if opts.points:
        points = [Point(*(int(x) for x in name.split("/"))) for name in opts.points.split(",")]
    prepare(plans(points), 0)
    print(f"compiled the points' kernels in {time.perf_counter() - start:.1f} s", flush=True)
    seed_path = Path(opts.seed_triton) if opts.seed_triton else default_seed_path()
    cols = columns(load_seed(seed_path))
    meta = {**banner(), "configs": qs.SHORT_CONFIGS, "seed": str(seed_path)}
    rows = []
    for i, point in enumerate(points):
        if time.perf_counter() > deadline:
            print(f"time limit: {[p.name for p in points[i:]]} not started")
            break
        try:
            rows.append(measure(point, opts.gib, cols, i))
            cells = "  ".join(f"{k} {fmt(v)[:10]}" for k, v in rows[-1]["times_us"].items())
            print(f"[{i + 1}/{len(points)}] {point.name} floor {rows[-1]['floor_us']:.1f}  {cells}",
                  flush=True)  # fmt: skip
        except Exception:
            traceback.print_exc()
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        torch.cuda.empty_cache()
    labels = ["k1", "triton", "gather", *[c for c in cols if c not in ("k1", "triton")]]
    print("\n== short single pass (qsa/short.py): graph µs per call; kv floor = the K/V bytes "
          "alone; gain = k1 / best short; % floor of the best short")  # fmt: skip
    head = ["point", "floor", "kv floor", *labels, "best short", "gain", "% floor"]
    print(table(head, [row_cells(r, labels) for r in rows]))
