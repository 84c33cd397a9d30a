"""Benchmark QSA fp8 sparse paged decode on a GPU: split-count sweep, crossover, issue table.

    python tools/bench_qsa.py [--no-sweep]            # about 1.5 minutes on the H200
    python tools/bench_qsa.py --lean                  # issue-shape k table, alternatives vs default, issue table
    python tools/bench_qsa.py --wave                  # the one-wave split rule's sweep
    python tools/bench_qsa.py --ncu-one [--splits K]  # ONE decode launch, rows=512 (for ncu)
    python tools/bench_qsa.py --dispatch-sweep [--json F] [--part i/n] [--seed-triton PATH]
    python tools/bench_qsa.py --list [--part i/n] [--pairs LO:HI]  # its grid and cost, no GPU
    python tools/bench_qsa.py --short [--json F]      # the short single pass (qsa_short_bench.py)

Inputs follow the issue: D=128, page 64, valid_count uniform in [topk/2, topk] and -1 past
it, logical indices drawn without replacement from a 16K-token context per request, pages
scattered over a 6 GiB pool, the cache being the serving layout [blocks, Hkv, page, 2D]
transposed and split (zero-copy). "probe" is a kernel that only gathers the same bytes
(tools/kernels/qsa_gather_probe.cuh): the access pattern's ceiling on this memory system. k is the
split count: 1 the single pass (slot pass + decode), k > 1 a thread block cluster of k
CTAs per (row, kv head), "f" resolving its slots in the kernel (one launch), "s" after the
slot pass. Several input sets rotate so L2 does not hold one call's gathers for the next;
every variant is checked against the torch path before it is timed (a failure prints and
the run goes on). Times are CUDA-graph replays per call, whole call. The issue table
prints last.
"""

# Inputs and timers: qsa_bench_util.py; the dispatch sweep: qsa_dispatch_sweep.py, its grid
# and bookkeeping qsa_bench_grid.py (CPU-importable: --list and the tests use it).

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer_jit import qsa  # noqa: E402
from flashinfer_jit.qsa import kernels as qk  # noqa: E402
from flashinfer_jit.qsa import plan as qsa_plan  # noqa: E402
from flashinfer_jit.qsa import short as qs  # noqa: E402
from flashinfer_jit.qsa.op import run_kernels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import warm_gpu  # noqa: E402
from qsa_bench_util import (  # noqa: E402
    HEAD_DIM,
    check,
    copy_bandwidth,
    floor_us,
    fmt,
    make_sets,
    n_sets_for,
    probe_runner,
    reference_of,
    table,
    time_eager,
    time_graph,
    timed,
)

# (rows, Hq, Hkv, topk) -> (Triton µs, target µs) from FACTS.md / the issue.
ISSUE_SHAPES = {
    (64, 64, 4, 2048): ("198 / 136 (graph 68)", 50),
    (512, 64, 4, 2048): ("432 / 350", 240),
    (2048, 32, 4, 1024): ("585 / 594", 460),
    (4, 64, 4, 2048): ("- / 119 (graph 46)", 10),
    (256, 32, 8, 4096): ("- / 590", None),
}
# Split variants timed per shape: (label, num_splits, fused).
VARIANTS = [("k1", 1, False), ("k2 f", 2, True), ("k2 s", 2, False), ("k4 f", 4, True)]
VARIANTS += [("k4 s", 4, False), ("k8 f", 8, True), ("k8 s", 8, False)]
VARIANTS_LEAN = [("k1", 1, False), ("k2 f", 2, True), ("k2 s", 2, False), ("k4 f", 4, True)]
# Alternatives to the shipped launch choices (not dispatched): label -> _run_kernels
# overrides, at the dispatcher's split count. The shipped single pass launches every kernel
# as a programmatic dependent launch (PDL: each kernel's launch overlaps the previous
# kernel's tail: the slot pass's, and in a graph of back-to-back calls the previous call's),
# runs 4 slot-pass entries per thread (all loads in flight) and the loop forms TMMA (groups
# <= 8: the chunk's tokens as the MMAs' rows; the 512-row shape's group of 16 keeps its
# head rows) and LEAN (loop invariants kept in registers); each column turns one off, or
# all ("previous": the form before them). "cp.async" / "bulk sN": the other gather, to
# check the shipped rule (bulk on the combined cache: the single pass and 2-CTA clusters
# over two waves); "1 chunk": a small cluster grid stepping one chunk at a time (the
# shipped rule steps two when the grid is at most half a wave).
ALT_SINGLE = {
    "no pdl": dict(pdl=False),
    "slots x1": dict(slot_entries=1),
    "slots x8": dict(slot_entries=8),
    "cp.async": dict(bulk=False),
    "no tmma": dict(tmma=False),
    "no lean": dict(lean=False),
    "previous": dict(tmma=False, lean=False, slot_entries=1, pdl=False),
}
ALT_CLUSTER = {
    "no pdl": dict(pdl=False),
    "1 chunk": dict(pair=False),
    "cp.async": dict(bulk=False),
    "bulk s2": dict(bulk=True, config=qk.BULK_CLUSTER, pair=False),
    "bulk s3": dict(bulk=True, config=(4, 3, 4), pair=False),
}


def kernel_breakdown(run, sets, reps=5) -> str:
    """Mean device µs per call of each kernel, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for args in sets:
                run(args)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("<")[0].split("(")[0][-24:]
            totals[name] = totals.get(name, 0.0) + event.device_time / (reps * len(sets))
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1]))


def variant(splits: int, fused: bool):
    return lambda args: run_kernels(args, num_splits=splits, fused=fused)


def dispatcher(args):
    qsa.qsa_sparse_paged_attention(*args)


def dispatch_split(rows, hkv, topk) -> tuple:
    """The dispatcher's (splits, config, pair) on this device (D=128, uint8 cache), the
    short single pass left out: the alternatives vary the single pass and the clusters."""
    variant = qsa_plan.dispatch_split(
        rows, hkv, topk, HEAD_DIM, torch.uint8, 0, short=False, group=16, bulk=True
    )  # (the short pass left out)
    return variant.num_splits, variant.config, variant.pair


def sweep_row(shape, gib, seed, with_probe, variants=VARIANTS):
    """[floor, probe, every variant's time, best label, the dispatcher's k] of one shape."""
    rows, hq, hkv, topk = shape
    sets = make_sets(*shape, n_sets_for(rows, hkv, topk), gib, seed=seed)
    expect = reference_of(sets[0])
    times = {}
    for label, splits, fused in variants:
        if fused and not qk.fused_fits(topk, splits):
            continue
        times[label] = timed(variant(splits, fused), sets, expect)
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    probe = time_graph(probe_runner(sets), sets) if with_probe else None
    k = dispatch_split(rows, hkv, topk)[0]
    best = min(ok, key=ok.get) if ok else None
    return [floor_us(sets[0]), probe, *[times.get(v[0]) for v in variants], best, k]


def bench_splits(gib, shapes, title, with_probe, variants=VARIANTS) -> None:
    print(f"\n== {title}: graph µs per call (k1 = single pass; f/s = fused slots/slot pass)")
    out = []
    for i, shape in enumerate(shapes):
        rows, hq, hkv, topk = shape
        try:
            row = sweep_row(shape, gib, i, with_probe, variants)
            out.append([f"{rows}/{hq}/{hkv}/{topk}", rows * hkv, *row])
        except Exception as exc:
            traceback.print_exc()
            out.append([f"{rows}/{hq}/{hkv}/{topk}", rows * hkv, f"ERR {exc}"[:60]])
        torch.cuda.empty_cache()
    head = ["rows/Hq/Hkv/topk", "rows*Hkv", "floor", "probe", *[v[0] for v in variants]]
    print(table([*head, "best", "rule k"], out))


def bench_alternatives(gib) -> None:
    """Each issue shape: the shipped path against the alternatives at the same split
    count. The default is timed before and after the variants (drift check); a variant
    WINS only when it beats the better default time by more than 1%."""
    print("\n== alternatives vs the shipped default (graph µs per call, same split count)")
    labels = list(dict.fromkeys([*ALT_SINGLE, *ALT_CLUSTER, "table"]))
    out, verdicts = [], []
    for i, shape in enumerate(ISSUE_SHAPES):
        rows, hq, hkv, topk = shape
        name = f"{rows}/{hq}/{hkv}/{topk}"
        try:
            sets = make_sets(*shape, n_sets_for(rows, hkv, topk), gib, seed=10 + i)
            expect = reference_of(sets[0])
            single = qsa.use_fp8_decode_kernel(rows * hkv, torch.uint8)
            k, config, pair = dispatch_split(rows, hkv, topk)
            ship = dict(config=config, pair=pair)
            before = timed(dispatcher, sets, expect)
            times = {}
            for label, kw in (ALT_SINGLE if single else ALT_CLUSTER).items():
                kw = {**ship, **kw}
                run = lambda a, kw=kw, k=k: run_kernels(a, num_splits=k, **kw)  # noqa: E731
                times[label] = timed(run, sets, expect)
            if not single:  # round 4's rule: split_count's table, gather_choice's configs
                table_k = qk.split_count(rows, hkv, topk)
                times["table"] = timed(variant(table_k, None), sets, expect)
            after = timed(dispatcher, sets, expect)
            base = [t for t in (before, after) if isinstance(t, float)]
            ok = {lbl: t for lbl, t in times.items() if isinstance(t, float)}
            best = min(ok, key=ok.get) if ok else None
            win = bool(base and best and ok[best] < 0.99 * min(base))
            gain = f"{100 * (1 - ok[best] / min(base)):+.1f}%" if base and best else "-"
            row = [name, f"k{k}", before, after, *[times.get(lbl) for lbl in labels]]
            verdict = "WIN" if win else "default"
            out.append([*row, best, gain, verdict])
            verdicts.append(
                f"{name}: {'alternative ' + best + ' ' + verdict if win else 'default stays'}"
            )
            del sets
        except Exception as exc:
            traceback.print_exc()
            out.append([name, f"ERR {type(exc).__name__}: {exc}"[:60]])
        torch.cuda.empty_cache()
    head = ["rows/Hq/Hkv/topk", "k", "default", "default again", *labels, "best other", "gain"]
    print(table([*head, "verdict"], out))
    print("verdicts: " + "; ".join(verdicts))
    print(
        "flips (QsaOptions' defaults, flashinfer_jit/qsa/plan.py): pdl, slot_entries, tmma, "
        "lean; cp.async / bulk sN winning over the default means the gather rule "
        "(qsa/kernels.py takes_bulk, BULK_CLUSTER) moves, 1 chunk the pair rule (takes_pairs)"
    )


def bench_issue(gib) -> None:
    print(
        "\n== QSA fp8 sparse paged decode on the H200 (D=128, page 64; our µs = graph replay "
        "of the dispatcher per call, slot pass included)"
    )
    out = []
    for shape, (triton, target) in ISSUE_SHAPES.items():
        rows, hq, hkv, topk = shape
        try:
            sets = make_sets(rows, hq, hkv, topk, n_sets_for(rows, hkv, topk), gib, seed=1)
            check(dispatcher, sets[0], reference_of(sets[0]))
            ours = time_graph(dispatcher, sets, reps=50)
            eager = time_eager(dispatcher, sets)
            floor = floor_us(sets[0])
            print(f"kernels {rows}/{hq}/{hkv}/{topk}: {kernel_breakdown(dispatcher, sets)}")
            verdict = "PASS" if target is None or ours <= target else "MISS"
            pct = f"{100 * floor / ours:.0f}%"
            out.append([rows, hq, hkv, topk, ours, eager, floor, pct, triton, target, verdict])
            del sets
        except Exception as exc:
            traceback.print_exc()
            out.append([rows, hq, hkv, topk, f"ERR {type(exc).__name__}: {exc}"[:70]])
    head = ["rows", "Hq", "Hkv", "topk", "our µs", "eager µs", "floor µs", "% of floor"]
    print(table([*head, "Triton µs (FACTS)", "target µs", "verdict"], out))


WAVE_SHAPES = [(r, 64, 4, 2048) for r in (1, 2, 3, 4, 6, 8, 12, 16)]
WAVE_SHAPES += [(4, 32, 4, 2048), (1, 32, 8, 1024), (5, 16, 4, 640)]
WAVE_CONFIGS = {"8w": qk.WAVE_CONFIG, "4w": (4, 8, 1)}  # both one CTA per SM (144 KB)


def bench_wave(gib) -> None:
    """The one-wave split rule (qsa_kernels.launch_split): the dispatcher against every split
    count whose clusters all fit at once at one CTA per SM (this device's count), two
    chunks a step, at the two one-CTA-per-SM configs; and the round-4 table."""
    sizes = range(2, qk.CLUSTER_MAX + 1)
    clusters = qsa_plan.wave_clusters(0)
    print("\n== one-wave splits: graph µs per call; clusters of 2..8 resident at once:")
    print("   " + ", ".join(f"{k}: {clusters(k)}" for k in sizes))
    out = []
    for i, shape in enumerate(WAVE_SHAPES):
        rows, hq, hkv, topk = shape
        sets = make_sets(*shape, n_sets_for(rows, hkv, topk), gib, seed=20 + i)
        expect = reference_of(sets[0])
        k, config, _ = dispatch_split(rows, hkv, topk)
        times = {"dispatch": timed(dispatcher, sets, expect)}
        times["table"] = timed(variant(qk.split_count(rows, hkv, topk), None), sets, expect)
        for splits in sizes:
            if not qk.wave_fits(rows * hkv, topk, splits, clusters):
                continue  # clusters do not all fit, too few chunks, or slots do not fit
            for name, cfg in WAVE_CONFIGS.items():
                run = lambda a, s=splits, c=cfg: run_kernels(  # noqa: E731
                    a, num_splits=s, fused=True, config=c, pair=True
                )
                times[f"k{splits} {name}"] = timed(run, sets, expect)
        ok = {n: t for n, t in times.items() if isinstance(t, float)}
        best = min(ok, key=ok.get) if ok else "-"
        cells = "  ".join(f"{n} {fmt(t)}" for n, t in times.items())
        out.append(f"{rows}/{hq}/{hkv}/{topk}: dispatch k{k} {config}; best {best}; {cells}")
        del sets
    print("\n".join(out))


def ncu_one(gib: float, splits: int) -> None:
    """Exactly one decode launch (rows=512 Hq=64 Hkv=4 topk=2048), after its slot pass."""
    args = make_sets(512, 64, 4, 2048, 1, gib, seed=5)[0]
    run_kernels(args, num_splits=splits, fused=False)
    torch.cuda.synchronize()
    print(f"one decode launch done: {splits} split(s)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sweep", action="store_true", help="issue shapes and table only")
    parser.add_argument(
        "--lean",
        action="store_true",
        help="issue-shape k table, alternatives vs the default, issue table",
    )
    parser.add_argument("--gib", type=float, default=6.0, help="cache pool size")
    parser.add_argument("--ncu-one", action="store_true", help="one decode launch, then exit")
    parser.add_argument("--wave", action="store_true", help="only the one-wave split sweep")
    parser.add_argument("--splits", type=int, default=1, help="split count for --ncu-one")
    sweep = parser.add_argument_group("issue 22's dispatch sweep (tools/qsa_dispatch_sweep.py)")
    sweep.add_argument("--dispatch-sweep", action="store_true", help="run it, table last")
    sweep.add_argument("--short", action="store_true", help="the short single pass at issue 22's "
                       "short selections instead (tools/qsa_short_bench.py; --json, --time-limit)")  # fmt: skip
    sweep.add_argument("--points", help="--short: these points (rows/Hq/Hkv/topk, comma-separated)"
                       " instead of qsa_short_bench.POINTS")  # fmt: skip
    sweep.add_argument("--list", action="store_true", help="its points and cost model; no GPU")
    sweep.add_argument("--json", help="write every row here (rewritten after each point)")
    sweep.add_argument("--part", help="i/n: only part i of n (cost-balanced), e.g. 1/2")
    sweep.add_argument("--pairs", help="LO:HI: only points with LO <= rows x Hkv <= HI (before "
                       "--part), e.g. 512:4096 for the short single pass's threshold")  # fmt: skip
    sweep.add_argument("--seed-triton", help="the seed's Triton module (default: .device/anchors/"
                       "qsa_seed_triton.py if present, else ../shared/anchors/)")  # fmt: skip
    sweep.add_argument("--jobs", type=int, help="NVRTC build processes (default: min(16, CPUs))")
    sweep.add_argument("--time-limit", type=float, default=380.0,
                       help="s from the sweep's start (builds included) after which no point "
                       "starts; the table still prints (default 380)")  # fmt: skip
    opts = parser.parse_args()
    if opts.short and opts.list:  # (--list is the dispatch sweep's; --short needs a GPU)
        parser.error("--list lists the dispatch sweep's points; --short has no list")
    if opts.points and not opts.short:
        parser.error("--points picks the short single pass's points (--short)")
    return opts


def banner() -> dict:
    """Warm the GPU; print and return the device, torch and today's copy bandwidth."""
    warm_gpu()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    info["copy_tbs"] = round(copy_bandwidth(), 3)
    print(f"device: {info['device']}, torch {info['torch']}, copy {info['copy_tbs']:.2f} TB/s "
          "(read + write)")  # fmt: skip
    print(
        f"dispatch: single pass when rows*Hkv >= {qk.DECODE_MIN_PROGRAMS}, else a cluster "
        f"(launch_split): the most CTAs that keep every cluster resident at once, one per SM "
        f"({qk.WAVE_CONFIG}, or {qk.CLUSTER_PAIR_CONFIG} within half a wave; two chunks a "
        f"step), else split_count's table; (warps, stages, min CTAs/SM): cp.async "
        f"{qk.DECODE_CONFIG}, D=128 bulk copies {qk.BULK_SINGLE_PASS} single pass, "
        f"{qk.BULK_CLUSTER} 2-CTA clusters over two waves, other clusters {qk.CLUSTER_CONFIG}",
        flush=True,
    )
    print(f"sm_90: the single pass from rows*Hkv >= {qk.DECODE_MIN_PROGRAMS_SM90}; in its place "
          f"the short single pass {qs.SHORT_DISPATCH} (rows in order) from "
          f"(topk up to, pairs per SM) {qs.SHORT_MIN_PAIRS_PER_SM} at head_dim "
          f"{qs.SHORT_HEAD_DIMS}; with bulk copies {qs.SHORT_WIDE} from "
          f"{qs.SHORT_WIDE_MIN_PAIRS_PER_SM}, {qs.SHORT_DISPATCH} or {qs.SHORT_DEEP} (fewer "
          f"waves) past {qs.SHORT_ONE_WARP_PER_SM} (short.short_config)", flush=True)  # fmt: skip
    return info


def main() -> None:
    opts = parse_args()
    if opts.ncu_one:
        ncu_one(opts.gib, opts.splits)
        return
    if opts.short:
        from qsa_short_bench import short_main

        short_main(opts, banner)
        return
    if opts.dispatch_sweep or opts.list:
        from qsa_dispatch_sweep import sweep_main  # its imports build nothing

        sweep_main(opts, banner)
        return
    banner()
    if opts.wave:
        bench_wave(opts.gib)
        return
    shapes, ks = list(ISSUE_SHAPES), VARIANTS_LEAN if opts.lean else VARIANTS
    sections = [(True, lambda gib: bench_splits(gib, shapes, "issue shapes", True, ks))]
    crossover = [(r, 64, 4, t) for t in (2048, 8192) for r in (16, 64, 256)]
    sweep = not (opts.no_sweep or opts.lean)
    sections.append((sweep, lambda gib: bench_splits(gib, crossover, "G=16 Hkv=4", False)))
    sections.append((True, bench_alternatives))
    sections.append((True, bench_issue))
    for enabled, section in sections:
        if enabled:
            try:
                section(opts.gib)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
