"""``tools/bench_qsa.py --dispatch-sweep``: issue 22's sweep on the GPU (grid, columns and
bar: tools/qsa_bench_grid.py). Per point: our kernels (k1, k2, k4, the dispatcher's split,
the short single pass), the dispatcher and the seed's Triton kernel, each checked against
the torch path and then timed as CUDA-graph replays per call over input sets cycled past
4x L2; a failure prints and the run goes on. Every NVRTC specialization the points reach is built first, in
parallel worker processes (the run would otherwise compile them one at a time as it goes).
A progress line per point, and the JSON rewritten after each, so a killed run keeps what
it measured; the table prints last.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import qsa_bench_grid as grid
import torch
from qsa_bench_util import (
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

from flashinfer_jit import qsa
from flashinfer_jit._jit import TEMPLATE_ROOT
from flashinfer_jit._version import __version__
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa import short as qs
from flashinfer_jit.qsa.op import run_kernels
from jit_kernels import device_arch, sm_count
from jit_kernels.prebuild import BuildTask, build_all

ROOT = Path(__file__).resolve().parents[1]
# Where the seed's Triton module is: carried to the device under .device/, else the shared
# folder beside the checkout. Imported by path, never copied into the project.
SEED_PATHS = (
    ROOT / ".device/anchors/qsa_seed_triton.py",
    ROOT / "../shared/anchors/qsa_seed_triton.py",
)
# The seed converts e4m3 through fp16 and accumulates as its design does: a measuring
# stick, not under test, so it gets 5x our bound (a dropped or doubled token still fails).
SEED_TOL = 2.5e-2


def default_seed_path() -> Path:
    return next((p for p in SEED_PATHS if p.is_file()), SEED_PATHS[0])


def load_seed(path: Path) -> Callable | None:
    """The seed's ``qsa_sparse_paged_decode`` from ``path``; None (column "-") when the
    module is missing or does not import (no triton, say)."""
    try:
        spec = importlib.util.spec_from_file_location("qsa_seed_triton", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise FileNotFoundError(path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as importlib's recipe: the module can find itself
        spec.loader.exec_module(module)
        return module.qsa_sparse_paged_decode
    except Exception as exc:  # the column is skipped; our side still runs
        sys.modules.pop("qsa_seed_triton", None)
        print(f"seed Triton kernel not importable ({path}): {type(exc).__name__}: {exc}")
        return None


def seed_runs(seed_fn: Callable | None, args: tuple, expect: torch.Tensor, name: str) -> dict:
    """``{"triton": run}`` where the seed's kernel passes its check on ``args``; ``{}``
    where it is not importable or fails (printed: the column is skipped, the point goes on)."""
    if seed_fn is None:
        return {}
    run = lambda a: seed_fn(*a)  # noqa: E731
    try:
        check(run, args, expect, SEED_TOL)
    except Exception as exc:  # noqa: BLE001
        print(f"{name}: seed Triton failed: {type(exc).__name__}: {exc}")
        return {}
    return {"triton": run}


def precompile(points: Sequence[grid.Point], sms: int, clusters, jobs: int) -> None:
    """Build every NVRTC specialization of ``points`` into the cache, ``jobs`` at a time."""
    arch, start = device_arch(0), time.perf_counter()
    specs = grid.sweep_specs(points, sms, clusters)
    tasks = [BuildTask("qsa", spec, arch) for spec in specs if spec.supports(arch)]
    status: dict[str, int] = {}
    for result in build_all(tasks, TEMPLATE_ROOT, __version__, jobs):
        status[result.status] = status.get(result.status, 0) + 1
        if result.status == "failed":  # the point's variant will fail and print too
            print(f"  build failed: {result.task.spec.label}: {result.error[:300]}")
    took = time.perf_counter() - start
    print(f"precompiled {len(tasks)} NVRTC specializations for {arch} in {took:.1f} s: {status}")


def runner(variant: qsa_plan.Variant) -> Callable:
    v = variant
    return lambda a: run_kernels(
        a, v.num_splits, v.fused, config=v.config, bulk=v.bulk, pair=v.pair, short=v.short,
        order=v.order,
    )  # fmt: skip


def captured(run: Callable, sets: list, expect: torch.Tensor, tol: float) -> object:
    """The graph of ``run`` over the sets after the torch-path check; the error (printed) as
    a string when either fails."""
    try:
        check(run, sets[0], expect, tol)
        return capture(run, sets)
    except Exception as exc:  # one bad variant must not end the run
        print(f"  {type(exc).__name__}: {str(exc)[:300]}")
        return f"ERR {type(exc).__name__}: {exc}"[:80]


def point_sets(p: grid.Point, gib: float, index: int) -> list:
    """The input sets of the sweep's ``index``-th point (1-based: its seed)."""
    return make_sets(p.rows, p.hq, p.hkv, p.topk, n_sets_for(p.rows, p.hkv, p.topk, p.head_dim),
                     gib, seed=index, page=p.page, head_dim=p.head_dim)  # fmt: skip


def measure(point: grid.Point, gib: float, seed_fn: Callable | None, index: int) -> dict:
    """One point's JSON row (qsa_bench_grid.summarize). Every variant, the dispatcher and
    the seed are captured first, then timed in interleaved rounds (time_graphs)."""
    p, sms, clusters = point, sm_count(0), qsa_plan.wave_clusters(0)
    sets = point_sets(p, gib, index)
    expect = reference_of(sets[0])
    floor = statistics.mean(floor_us(args) for args in sets)
    reps = grid.reps_for(floor, len(sets))
    variants = grid.variants_of(p, sms, clusters)
    labels = grid.timed_labels(p, sms, clusters)
    runs = {label: runner(variants[label]) for label, same in labels.items() if same == label}
    runs["disp"] = lambda a: qsa.qsa_sparse_paged_attention(*a)
    tols = {label: TOL for label in runs}  # the GPU tests' contract (qsa_bench_util.TOL)
    if seed_fn is not None:
        runs["triton"], tols["triton"] = (lambda a: seed_fn(*a)), SEED_TOL
    graphs = {label: captured(run, sets, expect, tols[label]) for label, run in runs.items()}
    ok = {label: g for label, g in graphs.items() if not isinstance(g, str)}
    times: dict[str, object] = {**graphs, **time_graphs(ok, len(sets), reps)}
    times.update({label: times[same] for label, same in labels.items() if same != label})
    times.setdefault("triton", None)
    chosen = qsa_plan.dispatch_split(p.rows, p.hkv, p.topk, p.head_dim, torch.uint8, 0,
                                     group=p.group, bulk=p.head_dim == 128)  # fmt: skip
    pick = grid.pick_label(p, chosen, sms, clusters)
    row = grid.summarize(p, floor, times, pick or f"k{chosen.num_splits}?")
    return {**row, "sets": len(sets), "reps": reps}


def progress(i: int, n: int, row: dict, start: float) -> str:
    times = "  ".join(f"{k} {fmt(v)[:12]}" for k, v in row["times_us"].items())
    ratio = row["disp_over_best"]
    verdict = ",".join(row["misses"]) or "ok"
    head = f"[{i}/{n} {time.perf_counter() - start:5.0f}s] {row['name']} pairs {row['pairs']}"
    return (
        f"{head} floor {row['floor_us']:.1f}  {times}  pick {row['pick']} best {row['best']} "
        + (f"disp/best {ratio:.3f} {verdict}" if ratio else verdict)
    )


def sweep(
    points: Sequence[grid.Point], gib: float, seed_fn, json_path, meta: dict, deadline: float
) -> list:
    """Measure ``points`` one by one (progress flushed, JSON rewritten after each); none
    is started past ``deadline`` (perf_counter), so the table still prints within the
    device call's limit."""
    rows, start = [], time.perf_counter()
    for i, point in enumerate(points, 1):
        if time.perf_counter() > deadline:
            meta["skipped"] = [p.name for p in points[i - 1 :]]
            print(f"time limit: {len(points) - i + 1} points not started: {meta['skipped']}")
            break
        try:
            row = measure(point, gib, seed_fn, i)
            print(progress(i, len(points), row, start), flush=True)
        except Exception as exc:  # a point that cannot even be set up: recorded, run goes on
            traceback.print_exc()
            row = {
                "name": point.name,
                "pairs": point.pairs,
                "error": f"{type(exc).__name__}: {exc}",
            }
            print(f"[{i}/{len(points)}] {point.name}: ERROR {row['error'][:200]}", flush=True)
        rows.append(row)
        if json_path:
            grid.write_json(json_path, meta, rows)
        torch.cuda.empty_cache()
    return rows


def report(rows: list[dict]) -> None:
    done = [r for r in rows if "times_us" in r]
    print("\n== gate data: best split µs / single pass (k1) µs by rows x Hkv (< 1: a split wins)")
    print("\n".join(grid.gate_lines(done)))
    print("\n== ordered clusters: best of k2o / k4o µs / single pass (k1) µs by rows x Hkv")
    print("\n".join(grid.gate_lines(done, grid.ORDERED)))
    print("\n== short gate data: short single pass µs / single pass (k1) µs by rows x Hkv "
          f"(< 1: short wins; the rule: from (topk up to, pairs per SM) "
          f"{qs.SHORT_MIN_PAIRS_PER_SM}, with bulk copies {qs.SHORT_WIDE_MIN_PAIRS_PER_SM} "
          f"on this device's {sm_count(0)} SMs)")  # fmt: skip
    print("\n".join(grid.gate_lines(done, ("short",))))
    print("\n== QSA dispatch sweep: graph µs per call, whole call; floor = selected K/V + q, "
          "gate, out, indices over 4.24 TB/s; bar: disp <= 1.03 x best of ours, >= 85% of "
          "floor where floor >= 50 µs, >= 4x triton where rows x Hkv <= 128")  # fmt: skip
    print(table(grid.HEADER, [grid.table_row(r) for r in done]))
    missed = [r["name"] for r in done if r["misses"]]
    failed = [r["name"] for r in rows if "error" in r]
    # A variant that fails its check is a wrong answer, not a slow one: named, never folded.
    wrong = [f"{r['name']} {k}" for r in done for k, v in r["times_us"].items()
             if isinstance(v, str) and k != "triton"]  # fmt: skip
    print(f"{len(done)} points measured, {len(missed)} miss the bar, {len(failed)} failed"
          + (f"; variants failing the check: {wrong}" if wrong else ""))  # fmt: skip


def sweep_main(opts: argparse.Namespace, banner: Callable[[], dict]) -> None:
    """--list (no GPU) or --dispatch-sweep; ``banner`` warms the GPU and returns the
    device's description for the JSON's meta."""
    deadline = time.perf_counter() + opts.time_limit
    points = grid.select_part(grid.select_pairs(grid.grid(), opts.pairs), opts.part)
    if opts.list:
        print("\n".join(grid.list_lines(points)))
        return
    sms, clusters = sm_count(0), qsa_plan.wave_clusters(0)
    precompile(points, sms, clusters, opts.jobs or min(16, os.cpu_count() or 1))
    seed_path = Path(opts.seed_triton) if opts.seed_triton else default_seed_path()
    seed_fn = load_seed(seed_path)
    meta = {**banner(), "part": opts.part, "pairs": opts.pairs, "points": len(points)}
    meta |= {"gate": grid.GATE, "short_min_pairs_per_sm": qs.SHORT_MIN_PAIRS_PER_SM}
    meta |= {"short_wide_min_pairs_per_sm": qs.SHORT_WIDE_MIN_PAIRS_PER_SM}
    meta |= {"sms": sms, "clusters": {k: clusters(k) for k in range(2, 9)}}
    meta |= {"seed": str(seed_path) if seed_fn else None, "version": __version__}
    if seed_fn is not None:
        meta["triton"] = sys.modules["triton"].__version__
    print(f"{len(points)} points (part {opts.part or 'all'}); seed Triton: {meta['seed']}")
    rows = sweep(points, opts.gib, seed_fn, opts.json, meta, deadline)
    if opts.json:
        grid.write_json(opts.json, meta, rows)  # with the skipped points, if any
    report(rows)
