"""Issue 22's open small calls (rows x Hkv <= 128, under 4x the seed's Triton kernel with no
measured floor in the way): every cluster launch shape beside the dispatcher's.

    python tools/qsa_cluster_sweep.py [--json FILE] [--points a,b]   # the H200: ~3 minutes
    python tools/qsa_cluster_sweep.py --list                         # the variants, no GPU

Per point, per call in a CUDA graph, inputs cycled past 4x L2, each variant checked against
the torch path first: the dispatcher ("disp"); split counts 2, 4 and 8 (--splits; 1: the
single pass), each with the cp.async gathers at CP_CONFIGS (warps, stages, min CTAs; "p":
two chunks a step) and the 256-byte bulk copies at BULK_CONFIGS; the gather probe
(tools/qsa_gather_floor.py, the faster of its two grids) and the seed's kernel. What it
answers: whether a launch shape the dispatcher does not take (more CTAs an SM,
more stages, bulk copies in a one-wave grid) makes a small call faster. Prints a table per
point, best first, then one summary row a point.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import qsa_bench_grid as grid  # noqa: E402
import torch  # noqa: E402
from qsa_bench_util import (  # noqa: E402
    TOL,
    capture,
    check,
    floor_us,
    make_sets,
    reference_of,
    table,
    time_graphs,
)
from qsa_dispatch_sweep import SEED_TOL, default_seed_path, load_seed, seed_runs  # noqa: E402
from qsa_gather_floor import fold_gather, gather_runs  # noqa: E402

from flashinfer_jit import qsa  # noqa: E402
from flashinfer_jit.qsa.op import run_kernels  # noqa: E402
from flashinfer_jit.qsa.plan import QsaOptions, Variant  # noqa: E402
from jit_kernels import prepare, sm_count  # noqa: E402

POINTS = ("64/16/1/2048", "64/16/1/4096", "128/16/1/4096", "64/8/1/2048", "16/64/4/2048",
          "16/64/4/4096", "32/64/4/4096", "16/128/8/2048", "16/32/8/2048", "4/64/4/512",
          "16/64/4/512", "16/128/8/512")  # fmt: skip
SPLITS = (2, 4, 8)
CP_CONFIGS = (((8, 4, 1), True), ((4, 6, 1), True), ((4, 8, 1), True), ((8, 4, 1), False),
              ((4, 4, 2), False), ((4, 2, 4), False), ((8, 2, 2), False))  # fmt: skip
BULK_CONFIGS = ((4, 2, 4), (4, 4, 2), (8, 4, 1), (4, 8, 1), (8, 2, 2))
GIB = 6.0


def variants(splits: tuple[int, ...] = SPLITS) -> dict[str, dict]:
    """label -> run_kernels keywords."""
    out = {}
    for k in splits:
        for config, pair in CP_CONFIGS:
            label = f"k{k} {'x'.join(map(str, config))}{' p' if pair else ''}"
            out[label] = dict(num_splits=k, config=config, pair=pair, bulk=False)
        for config in BULK_CONFIGS:
            out[f"k{k} {'x'.join(map(str, config))} bulk"] = dict(
                num_splits=k, config=config, pair=False, bulk=True
            )
    return out


def parse(name: str) -> grid.Point:
    """A point of tools/qsa_bench_grid.py from its name (rows/Hq/Hkv/topk)."""
    return grid.Point(*(int(x) for x in name.split("/")))


def precompile(names, table_: dict[str, dict]) -> None:
    """Every variant's kernels of every point, compiled at once (jit_kernels.prepare), as
    plan.launch_choice (qsa_bench_grid.resolve) says decode_launch picks
    them; a variant its checks refuse is left to its row."""
    options, sms, wanted = QsaOptions(), sm_count(0), []
    for point in map(parse, names):
        for kw in table_.values():
            variant = Variant(kw["num_splits"], None, kw["config"], kw["bulk"], kw["pair"])
            try:
                wanted += grid.resolve(point, variant, sms, options).plans()
            except ValueError:
                continue
    prepare(list(dict.fromkeys(wanted)), 0)


def measure(name: str, seed_fn, table_: dict[str, dict]) -> dict:
    p = parse(name)
    sets = make_sets(p.rows, p.hq, p.hkv, p.topk, grid.n_sets(p), GIB, seed=7,
                     page=p.page, head_dim=p.head_dim)  # fmt: skip
    expect = reference_of(sets[0])
    runs = {"disp": lambda a: qsa.qsa_sparse_paged_attention(*a), **gather_runs(sets)}
    runs.update(seed_runs(seed_fn, sets[0], expect, name))
    for label, kw in table_.items():
        runs[label] = lambda a, kw=kw: run_kernels(a, **kw)
    graphs, errors = {}, {}
    for label, run in runs.items():
        try:
            if not label.startswith("gather"):
                check(run, sets[0], expect, SEED_TOL if label == "triton" else TOL)
            graphs[label] = capture(run, sets)
        except Exception as exc:  # noqa: BLE001 (a refused or failing variant is a row)
            errors[label] = f"{type(exc).__name__}: {exc}"[:70]
    times = time_graphs(graphs, len(sets), 20)
    fold_gather(times)
    times["floor"] = floor_us(sets[0])
    return {"times": times, "errors": errors}


def report(name: str, result: dict) -> list:
    t = result["times"]
    gather = t["gather"]
    ours = {k: v for k, v in t.items() if k.startswith("k")}
    ranked = sorted(ours, key=ours.get)
    print(f"\n== {name}: floor {t['floor']:.1f}, gather {gather:.1f}, disp {t['disp']:.1f}, "
          f"triton {t.get('triton', float('nan')):.1f}")  # fmt: skip
    print(table(["variant", "µs", "x disp"], [[k, ours[k], f"{ours[k] / t['disp']:.3f}"]
                                              for k in ranked[:8]]))  # fmt: skip
    refused = sorted(result["errors"])
    if refused:
        print(f"  not run ({len(refused)}): " + "; ".join(f"{k}: {result['errors'][k]}"
                                                         for k in refused[:4]))  # fmt: skip
    best = ranked[0] if ranked else None
    tri = t.get("triton")
    return [name, t["floor"], gather, t["disp"], best, ours.get(best), tri,
            f"{tri / 4:.1f}" if tri else "-"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", default=",".join(POINTS))
    parser.add_argument("--splits", default=",".join(map(str, SPLITS)), help="e.g. 2,3,4")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--seed-triton", default=str(default_seed_path()))
    args = parser.parse_args()
    names = args.points.split(",")
    table_ = variants(tuple(int(k) for k in args.splits.split(",")))
    if args.list:
        print(f"{len(names)} points x {len(table_)} variants: {', '.join(table_)}")
        return
    precompile(names, table_)
    seed_fn = load_seed(Path(args.seed_triton))
    summary, results = [], {}
    for name in names:
        results[name] = measure(name, seed_fn, table_)
        summary.append(report(name, results[name]))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        torch.cuda.empty_cache()
    head = ["point", "floor", "gather", "disp", "best variant", "best µs", "triton", "triton/4"]
    print("\n== summary (graph µs per call)\n" + table(head, summary))


if __name__ == "__main__":
    main()
