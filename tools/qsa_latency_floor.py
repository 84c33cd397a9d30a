"""Issue 22's small calls: the latency floor beside ours and the seed's Triton kernel.

    python tools/qsa_latency_floor.py [--json FILE]    # the H200: about a minute

For every sweep point with rows x Hkv <= 128 (tools/qsa_bench_grid.py), per call in a CUDA
graph, inputs cycled past 4x L2, the four timed in interleaved rounds:
- "empty": a kernel that does nothing, one launch a call (what a graph's launch costs);
- "chain": tools/kernels/qsa_chain_probe.cuh, the call's dependent loads and nothing else
  (selection and request -> block table -> every selected K/V byte -> one store), one
  selected token a thread, all in flight at once: a lower bound on any call's time;
- "ours": `qsa_sparse_paged_attention` (whole call, checked against the torch path first);
- "triton": the seed's kernel (`qsa_dispatch_sweep.load_seed`), "-" when not importable.
"chain" is a floor where it runs faster than ours: it makes the call's trips with every
token in flight and no reduction. (Where it is slower, at many rows x long selections, its
one-token-a-thread gathers are the slower way to move those bytes and it bounds nothing.)
"4x under floor": triton / 4 is under a valid chain, so issue 22's 4x bar at that point
asks for less than the dependent loads take. The table prints last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qsa_bench_grid import grid  # noqa: E402
from qsa_bench_util import (  # noqa: E402
    TOOLS_BUILDER,
    capture,
    check,
    fmt,
    make_sets,
    n_sets_for,
    reference_of,
    table,
    time_graphs,
)
from qsa_dispatch_sweep import default_seed_path, load_seed, seed_runs  # noqa: E402

from flashinfer_jit import qsa  # noqa: E402
from flashinfer_jit._jit import cuda_device_index  # noqa: E402
from jit_kernels import I32, I64, PTR, KernelFamily, current_stream  # noqa: E402

_chain = KernelFamily(
    TOOLS_BUILDER,
    "qsa_chain_probe",
    "qsa_chain_probe.cuh",
    "fij_qsa::qsa_chain_probe",
    ("head_dim",),
    (PTR, I64, I32, PTR, PTR, I64, I32, PTR, I64, I64, I64, PTR, I64, I64, I64, PTR),
)
GIB = 6.0
REPS = 40


def chain_runner(sink: torch.Tensor):
    def run(args) -> None:
        q, k, v, indices, table_, t2r = args[:6]
        device = cuda_device_index(q)
        values = (indices.data_ptr(), indices.stride(0), indices.shape[1] - 1, t2r.data_ptr())
        values += (table_.data_ptr(), table_.stride(0), k.shape[1], k.data_ptr())
        values += (k.stride(0), k.stride(1), k.stride(2), v.data_ptr(), *v.stride()[:3])
        grid_ = (q.shape[0], k.shape[2], -(-(indices.shape[1] - 1) // 256))
        kernel = _chain.get((q.shape[2],), device)
        kernel.launch(grid_, (256, 1, 1), current_stream(device), (*values, sink.data_ptr()))

    return run


def empty_runner(sink: torch.Tensor):
    # The chain probe with no selected token (count 0): a launch, one store, nothing else.
    zero = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    chain = chain_runner(sink)

    def run(args) -> None:
        chain((args[0][:1], args[1], args[2], zero, args[4], args[5][:1]))

    return run


def measure(point, seed_fn) -> dict:
    sets = make_sets(point.rows, point.hq, point.hkv, point.topk,
                     n_sets_for(point.rows, point.hkv, point.topk), GIB)  # fmt: skip
    expect = reference_of(sets[0])
    ours = lambda a: qsa.qsa_sparse_paged_attention(*a)  # noqa: E731
    check(ours, sets[0], expect)
    sink = torch.empty(
        point.rows * point.hkv * -(-point.topk // 256), dtype=torch.int32, device="cuda"
    )
    runs = {"empty": empty_runner(sink), "chain": chain_runner(sink), "ours": ours}
    runs.update(seed_runs(seed_fn, sets[0], expect, point.name))
    graphs = {name: capture(run, sets) for name, run in runs.items()}
    return time_graphs(graphs, len(sets), REPS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--seed-triton", default=str(default_seed_path()))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a GPU")
    seed_fn = load_seed(Path(args.seed_triton))
    points = [p for p in grid() if p.pairs <= 128 and p.page == 64 and p.head_dim == 128]
    results = {}
    for point in points:
        t = measure(point, seed_fn)
        results[point.name] = t
        print(point.name, {k: round(v, 2) for k, v in t.items()}, flush=True)
    rows = []
    for name, t in results.items():
        tri = t.get("triton")
        valid = t["chain"] <= t["ours"]  # a floor only where it is one (see above)
        bound = "yes" if tri is not None and valid and tri / 4 < t["chain"] else ""
        cells = [t["empty"], t["chain"], t["ours"], tri, tri / 4 if tri else None]
        rows.append([name, *(fmt(c) for c in cells), fmt(tri / t["ours"]) if tri else "-", bound])
    header = ["point", "empty", "chain", "ours", "triton", "triton/4", "x triton", "4x under floor"]
    print(table(header, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
