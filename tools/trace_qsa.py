"""Per-CTA timeline of the QSA decode kernels: where a call's time goes, and what a row costs
beside its chunks.

    python tools/trace_qsa.py --point 1024/16/1/2048 [--variant k1|k2|k2o|short] [--runs 2]

Builds traced copies of the decode families (single pass, its loop forms, the short pass, the
clusters): the templates copied to a temporary directory with %globaltimer / %smid stores
patched into qsa/body.cuh (each patch anchor must occur exactly once, so a template change
that moves one fails here, loudly). This process then launches them in place of the shipped
families (the module attributes plan.decode_launch reads; a tool process only), captures one
CUDA graph of calls over the point's input sets (the sweep's, tools/qsa_dispatch_sweep.py
point_sets) and reads the last call's trace. Per CTA: start, grid-dependency wait, the row's
count in hand, warp 0's first chunk landed, each warp's loop end, end; its SM, row and chunks.
Prints the phases (min / median / max over CTAs), the CTAs an SM held at once, and the least
squares line of a CTA's time from its wait's end to its end against its chunks: the intercept
is a row's fixed cost (prologue, merge, store), the slope a chunk's time at the call's
concurrency, printed beside what a chunk's bytes take at 4.24 TB/s shared by the CTAs then
running. The traced copy waits for the count in thread 0 (to time it), which the shipped
kernel does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import qsa_bench_grid as grid  # noqa: E402
from mqa_logits_probe import patch_templates  # noqa: E402
from qsa_bench_util import capture  # noqa: E402
from qsa_dispatch_sweep import point_sets  # noqa: E402

from flashinfer_jit import __version__  # noqa: E402
from flashinfer_jit.qsa import kernels as qk  # noqa: E402
from flashinfer_jit.qsa import short as qs  # noqa: E402
from flashinfer_jit.qsa.op import run_kernels  # noqa: E402
from jit_kernels import KernelBuilder, KernelFamily  # noqa: E402

SLOTS, CTAS_MAX = 16, 1 << 16  # per CTA: 0 start, 1 wait end, 2 count, 3 first chunk,
# 4-11 each warp's loop end, 12 end, 13 SM, 14 row, 15 chunks of this CTA
BODY = "qsa/body.cuh"
HEADER = r"""
extern "C" { __device__ unsigned long long fij_trace[65536 * 16]; }
__device__ __forceinline__ unsigned long long fij_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
#define FIJ_TRACE(slot, v) do { const unsigned fij_c = blockIdx.x + gridDim.x * blockIdx.y; \
  if (fij_c < 65536u) fij_trace[fij_c * 16 + (slot)] = (unsigned long long)(v); } while (0)
"""
PATCHES = [
    (BODY, '#include "qsa/util.cuh"\n', '#include "qsa/util.cuh"\n' + HEADER),
    (
        BODY,
        "  grid_dependency_wait();\n",
        "  if (threadIdx.x == 0) {\n    FIJ_TRACE(0, fij_ns()); FIJ_TRACE(3, 0);\n    unsigned sm;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n    FIJ_TRACE(13, sm);\n  }\n'
        "  grid_dependency_wait();\n  if (threadIdx.x == 0) FIJ_TRACE(1, fij_ns());\n",
    ),
    (
        BODY,
        "  const int chunks = (count + kChunk - 1) / kChunk;\n",
        "  const int chunks = (count + kChunk - 1) / kChunk;\n"
        "  if (threadIdx.x == 0) { FIJ_TRACE(14, row); FIJ_TRACE(2, fij_ns() + 0 * count); }\n",
    ),
    (
        BODY,
        "    else cp_async_wait<NUM_STAGES - 1>();\n",
        "    else cp_async_wait<NUM_STAGES - 1>();\n"
        "    if (k == 0 && threadIdx.x == 0) FIJ_TRACE(3, fij_ns());\n",
    ),
    (
        BODY,
        "  // ---- merge the warps",
        "  if (lane == 0 && warp < 8) FIJ_TRACE(4 + warp, fij_ns());\n"
        "  if (threadIdx.x == 0) FIJ_TRACE(15, n_local);\n  // ---- merge the warps",
    ),
    (
        BODY,
        "gate_head, output_scale);\n    return;",
        "gate_head, output_scale);\n    if (threadIdx.x == 0) FIJ_TRACE(12, fij_ns());\n    return;",
    ),
    (
        BODY,
        "output_scale, gate_pre);\n}",
        "output_scale, gate_pre);\n  if (threadIdx.x == 0) FIJ_TRACE(12, fij_ns());\n}",
    ),
]
FAMILIES = (  # module, attribute: the decode families plan.decode_launch reads at run time
    (qk, "decode_family"),
    (qk, "decode_form_family"),
    (qk, "cluster_family"),
    (qs, "decode_short_family"),
)
VARIANTS = {  # --variant: run_kernels' keywords
    "k1": {},
    "k2": {"num_splits": 2},
    "k2o": {"num_splits": 2, "fused": False, "order": True},
    "short": {"short": True},
}


def traced_families(root: Path) -> dict[str, KernelFamily]:
    """Each decode family's traced twin, built from a patched copy of the templates."""
    patch_templates(root, PATCHES)
    builder = KernelBuilder(root, f"{__version__}+qsa_trace")
    out = {}
    for module, name in FAMILIES:
        f = getattr(module, name)
        out[name] = KernelFamily(
            builder, f.family + "_trace", f.template, f.kernel, f.param_names, f.signature
        )
    return out


def _spread(values: list[float]) -> str:
    v = sorted(values)
    return f"{v[0]:8.2f} {statistics.median(v):8.2f} {v[-1]:8.2f}"


def read_trace(families: dict[str, KernelFamily]) -> torch.Tensor:
    """The trace buffer of the traced kernel loaded last (one decode kernel a point)."""
    from cuda.bindings import driver

    loaded = [k for f in families.values() for k in f._loaded.values()]
    ptr, size = loaded[-1].global_buffer("fij_trace")
    trace = torch.empty(size // 8, dtype=torch.int64)
    (err,) = driver.cuMemcpyDtoH(trace.data_ptr(), ptr, size)
    assert int(err) == 0, err
    return trace.view(-1, SLOTS)


def report(tr: torch.Tensor, point: grid.Point, per_call: float) -> None:
    ran = tr[:, 12] > tr[:, 1]  # CTAs of the last call (the buffer holds earlier calls' too)
    tr = tr[ran].double()
    t0 = tr[:, 0].min()
    us = lambda x: (x / 1000).tolist()  # noqa: E731
    print(f"\n== {point.name}: {per_call:.1f} us a call in the graph; {int(ran.sum())} CTAs")
    print("   phase, us (min / median / max over CTAs)")
    print(f"   start, from the first CTA's   {_spread(us(tr[:, 0] - t0))}")
    print(f"   grid-dependency wait          {_spread(us(tr[:, 1] - tr[:, 0]))}")
    print(f"   to the count in hand          {_spread(us(tr[:, 2] - tr[:, 1]))}")
    first = tr[:, 3] > 0  # (not traced in the paired-chunk loop)
    if bool(first.any()):
        print(f"   to warp 0's first chunk       {_spread(us((tr[:, 3] - tr[:, 1])[first]))}")
    loop_end = tr[:, 4:12].max(1).values
    print(f"   loops (warps' last end)       {_spread(us(loop_end - tr[:, 1]))}")
    print(f"   merge + store                 {_spread(us(tr[:, 12] - loop_end))}")
    print(f"   end, from the first CTA's     {_spread(us(tr[:, 12] - t0))}")
    print(f"   chunks a CTA                  {_spread(tr[:, 15].tolist())}")
    busy = tr[:, 12] - tr[:, 1]
    x, y = tr[:, 15], busy / 1000
    slope = float(
        ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum().clamp(min=1)
    )
    intercept = float(y.mean() - slope * x.mean())
    # CTAs running at once, sampled at each CTA's wait end (the SMs' share of HBM)
    starts, ends = tr[:, 1], tr[:, 12]
    running = [int(((starts <= s) & (ends > s)).sum()) for s in starts.tolist()]
    chunk_bytes = 16 * 2 * point.head_dim  # 16 tokens' K and V rows
    at_floor = chunk_bytes * statistics.median(running) / 4.24e12 * 1e6
    print(
        f"   a CTA's time = {intercept:.2f} us + {slope:.3f} us a chunk (least squares);"
        f" CTAs running at once {_spread([float(r) for r in running])};"
        f" a chunk's bytes at 4.24 TB/s over the median of them: {at_floor:.3f} us"
    )


def trace_point(
    point: grid.Point, variant: str, families: dict, seed: int, gib: float = 6.0
) -> None:
    """Trace one graph of calls over the point's sets (a ``gib`` GiB pool, the sweep's)."""
    sets = point_sets(point, gib, seed)
    run = lambda a: run_kernels(a, **VARIANTS[variant])  # noqa: E731
    graph = capture(run, sets)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(sets))
    report(read_trace(families), point, statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--point", required=True, help="rows/Hq/Hkv/topk (page 64, D 128)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="k1")
    parser.add_argument("--runs", type=int, default=1, help="runs, each with new inputs")
    parser.add_argument("--gib", type=float, default=6.0, help="cache pool size (the sweep's)")
    args = parser.parse_args()
    rows, hq, hkv, topk = (int(v) for v in args.point.split("/"))
    point = grid.Point(rows, hq, hkv, topk)
    with tempfile.TemporaryDirectory() as tmp:
        families = traced_families(Path(tmp) / "templates")
        for module, name in FAMILIES:
            setattr(module, name, families[name])
        for seed in range(1, args.runs + 1):
            trace_point(point, args.variant, families, seed, args.gib)


if __name__ == "__main__":
    main()
