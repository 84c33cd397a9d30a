"""Per-CTA timeline of the sm_90a MQA logits kernel (the TMA form): where a call's time goes.

    python tools/trace_mqa_logits.py [--batch 32] [--next-n 1] [--heads 64] [--length 8192]
                                     [--long 65536] [--runs 3]

Builds a traced copy of the kernel: the templates copied to a temporary directory with
%globaltimer / %clock64 / %smid stores patched into mqa_logits/sm90_tma_wgmma.cuh (each patch anchor
must occur exactly once, so a template change that moves one fails here, loudly). Runs a
CUDA graph of 8 back-to-back calls, as tools/bench_mqa_logits.py times them, and reads the
last call's trace. Per CTA: start, grid-dependency wait, schedule, first tile, end, SM
and SM clock. Prints the phases (min / median / max over CTAs) and the critical CTA's tiles
per warpgroup. With --runs > 1 (new inputs each run), it also prints how consistently the
same SMs are the slow ones. The globaltimer ticks in steps of ~0.26 µs on the H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_mqa_logits as bench  # noqa: E402
from mqa_logits_probe import Probe, patched_family  # noqa: E402

import flashinfer_jit.mqa_logits as mq  # noqa: E402
from jit_kernels import KernelFamily  # noqa: E402

SLOTS = 256  # per CTA: 0-15 CTA events, 16 + 48 wg + 2 o (+1): tile o's arrival (done)
TILES = 24  # tiles traced per warpgroup
HEADER = r"""
extern "C" { __device__ unsigned long long fij_trace[1024 * 256]; }
__device__ __forceinline__ unsigned long long fij_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned long long fij_clk() {
  unsigned long long t; asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)); return t; }
#define FIJ_TRACE(slot, v) (fij_trace[blockIdx.x * 256 + (slot)] = (v))
"""
# (anchor, replacement) pairs applied to mqa_logits/sm90_tma_wgmma.cuh. Slots: 0 start, 1 clock at
# start, 2 after the wait, 3 after the schedule, 4 tiles, 5 SM, 8 + wg end, 12 + wg clock.
PATCHES = [
    (
        '#include "mqa_logits/sm90_tma_parts.cuh"\n',
        '#include "mqa_logits/sm90_tma_parts.cuh"\n' + HEADER,
    ),
    (
        "  fij::grid_dependency_wait();",
        "  if (threadIdx.x == 0) { FIJ_TRACE(0, fij_ns()); FIJ_TRACE(1, fij_clk()); }\n"
        "  fij::grid_dependency_wait();\n"
        "  if (threadIdx.x == 0) {\n    FIJ_TRACE(2, fij_ns());\n    unsigned sm;\n"
        '    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));\n    FIJ_TRACE(5, sm);\n  }',
    ),
    (
        "  const int len = sched[2];\n",
        "  const int len = sched[2];\n"
        "  if (threadIdx.x == 0) { FIJ_TRACE(3, fij_ns()); FIJ_TRACE(4, len); }\n",
    ),
    (
        "      const int4 m = arrive(i);\n",
        "      const int4 m = arrive(i);\n      const int o = (i - wg) / WGS;\n"
        f"      if (tid == 0 && o < {TILES}) FIJ_TRACE(16 + 48 * wg + 2 * o, fij_ns());\n",
    ),
    (
        "      finish(i % STAGES, m, acc);\n    }\n  }\n",
        "      finish(i % STAGES, m, acc);\n"
        f"      if (tid == 0 && o < {TILES}) FIJ_TRACE(17 + 48 * wg + 2 * o, fij_ns());\n    }}\n  }}\n"
        "  if (tid == 0) { FIJ_TRACE(8 + wg, fij_ns()); FIJ_TRACE(12 + wg, fij_clk()); }\n",
    ),
    # The lean loop: its tiles counted in arrival order (fij_a) and epilogue order (fij_d);
    # a redone tile is one arrival and one epilogue, a padding tile an arrival only.
    (
        "    const int wgu = __shfl_sync(0xffffffffu, wg, 0), lenu = __shfl_sync(0xffffffffu, len, 0);\n",
        "    const int wgu = __shfl_sync(0xffffffffu, wg, 0), lenu = __shfl_sync(0xffffffffu, len, 0);\n"
        "    int fij_a = 0, fij_d = 0;\n"
        f"    auto fij_arrived = [&] {{ if (tid == 0 && fij_a < {TILES}) FIJ_TRACE(16 + 48 * wg + 2 * fij_a, fij_ns()); ++fij_a; }};\n",
    ),
    (
        "      rows_out.put(res, m.y, m.z, tig);\n",
        "      rows_out.put(res, m.y, m.z, tig);\n"
        f"      if (tid == 0 && fij_d < {TILES}) FIJ_TRACE(17 + 48 * wg + 2 * fij_d, fij_ns());\n"
        "      ++fij_d;\n",
    ),
    (
        "      mbar_wait(full0 + 8 * s, c >= STAGES ? 1 : 0);\n",
        "      mbar_wait(full0 + 8 * s, c >= STAGES ? 1 : 0);\n      fij_arrived();\n",
    ),
    (
        "      mbar_wait(full0 + 8 * s, parity);\n",
        "      mbar_wait(full0 + 8 * s, parity);\n      fij_arrived();\n",
    ),
    (
        "      mbar_wait(full0 + 8 * (s + 1), parity);\n",
        "      mbar_wait(full0 + 8 * (s + 1), parity);\n      fij_arrived();\n",
    ),
]


def traced_family(root: Path) -> KernelFamily:
    """The TMA family (probe parameter last, tools/mqa_logits_probe.py) built from a traced
    copy of the templates under ``root``."""
    return patched_family(root, "mqa_logits_tma_trace", PATCHES)


def _spread(values) -> str:
    v = sorted(values)
    return f"{v[0]:7.2f} {statistics.median(v):7.2f} {v[-1]:7.2f}"


# size: one traced run and its report, in the order the report prints
def trace_call(
    family: KernelFamily, shape: tuple, seed: int, probe: int, long: int = 0
) -> dict[int, float]:
    """Trace one graph of 8 calls; print its phases; return {SM: first tile -> end, µs}.
    ``long``: one request of that length in each set (a skewed batch)."""
    batch, next_n, heads, length = shape
    gen = torch.Generator().manual_seed(seed)
    sets = [bench.make_set(batch, next_n, heads, length, 64, gen, long=long) for _ in range(8)]
    length = max(length, long)  # the calls' max_seq_len
    shape = (batch, next_n, heads, length)
    try:
        variant = ("probe", probe, None) if probe else None
        bench.set_variant(variant, shape)
        untraced = bench.time_graph_calls(sets, length, 40)
        traced_probe = Probe(family, probe)
        options = bench.variant_options(variant, shape)
        bench.set_runner(mq.OP.runner(dataclasses.replace(options, tma_family=traced_probe)))
        traced = bench.time_graph_calls(sets, length, 40)  # the last call's trace survives
        ptr, size = next(iter(family._loaded.values())).global_buffer("fij_trace")
        trace = torch.empty(size // 8, dtype=torch.int64)
        from cuda.bindings import driver

        (err,) = driver.cuMemcpyDtoH(trace.data_ptr(), ptr, size)
        assert int(err) == 0, err
    finally:
        bench.set_variant(None, shape)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    tr = trace.view(-1, SLOTS)[:ctas].double()
    wgs = bench.auto_config(*shape).warpgroups
    t0 = tr[:, 0].min()
    end = tr[:, 8 : 8 + wgs].max(1).values
    # Slots a warpgroup did not reach in the last call may hold an earlier call's times:
    # warpgroup w had ceil((len - w) / wgs) tiles.
    tiles = torch.stack([((tr[:, 4] - w + wgs - 1) // wgs).clamp(min=0) for w in range(wgs)], 1)
    arrivals = tr[:, [16 + 48 * w for w in range(wgs)]]
    inf = torch.full_like(arrivals, float("inf"))
    first = torch.where(tiles > 0, arrivals, inf).min(1).values
    ghz = (tr[:, 12] - tr[:, 1]) / (tr[:, 8] - tr[:, 0])

    def us(x) -> list[float]:
        return (x / 1000).tolist()

    print(
        f"\n== B={batch} next_n={next_n} H={heads} L={length} seed {seed}"
        f"{f' probe {probe}' if probe else ''}: {untraced:.1f} us per call"
        f" in a graph of 8 ({traced:.1f} traced); the traced call spans {(end.max() - t0) / 1e3:.2f} us"
    )
    print("   phase, us (min / median / max over CTAs)")
    print(f"   start, from the first CTA's    {_spread(us(tr[:, 0] - t0))}")
    print(f"   grid-dependency wait           {_spread(us(tr[:, 2] - tr[:, 0]))}")
    print(f"   schedule + ring init           {_spread(us(tr[:, 3] - tr[:, 2]))}")
    busy = tr[:, 4] > 0  # CTAs with tiles
    print(f"   to the first tile              {_spread(us((first - tr[:, 3])[busy]))}")
    print(f"   first tile to end              {_spread(us((end - first)[busy]))}")
    print(f"   end, from the first CTA's      {_spread(us(end - t0))}")
    print(f"   end, from the last wait's end  {_spread(us(end - tr[:, 2].max()))}")
    print(f"   tiles                          {_spread(tr[:, 4].tolist())}")
    print(f"   SM clock, GHz                  {_spread(ghz.tolist())}")
    # Traced tile arrivals over time, from the last grid-dependency wait's end: how fast the
    # call's KV arrives (all of it when each warpgroup has at most TILES tiles).
    arrivals_all = torch.stack(
        [tr[:, 16 + 48 * w : 16 + 48 * w + 2 * TILES : 2] for w in range(wgs)], 1
    )
    reached = torch.arange(TILES)[None, None, :] < tiles[:, :, None]  # slots of this call
    got, traced_tiles = arrivals_all[reached], int(reached.sum())
    release = tr[:, 2].max()
    steps = [float((got <= release + 1000 * k).sum()) / max(1, traced_tiles) for k in range(21)]
    print(
        "   tiles arrived by 0, 1, 2, ... us after the last wait ends, %: "
        + " ".join(f"{100 * x:.0f}" for x in steps)
    )
    c = int(end.argmax())
    print(
        f"   critical CTA {c} (SM {int(tr[c, 5])}): (arrival-done) us of its first {TILES} tiles per warpgroup"
    )
    for w in range(wgs):
        cells = []
        for o in range(min(TILES, int(tiles[c, w]))):
            a, d = tr[c, 16 + 48 * w + 2 * o], tr[c, 17 + 48 * w + 2 * o]
            done = "" if probe == 1 else f"-{(d - t0) / 1e3:.2f}"  # the probe finishes no tile
            cells.append(f"{(a - t0) / 1e3:.2f}{done}")
        print(f"     wg{w}: " + " ".join(cells))
    return dict(zip(tr[busy, 5].long().tolist(), us((end - first)[busy]), strict=True))


def _rank_correlation(a: dict[int, float], b: dict[int, float]) -> float:
    keys = sorted(set(a) & set(b))
    ra = {k: i for i, k in enumerate(sorted(keys, key=a.get))}
    rb = {k: i for i, k in enumerate(sorted(keys, key=b.get))}
    n = len(keys)
    return 1 - 6 * sum((ra[k] - rb[k]) ** 2 for k in keys) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_shape_args(parser, batch=32)
    parser.add_argument("--runs", type=int, default=1, help="runs, each with new inputs")
    parser.add_argument("--long", type=int, default=0, help="one request of this length (skewed)")
    parser.add_argument(
        "--probe", type=int, default=0, help="trace the kernel's timing probe (1: streaming only)"
    )
    args = parser.parse_args()
    shape = (args.batch, args.next_n, args.heads, args.length)
    bench.warm_gpu()
    with tempfile.TemporaryDirectory() as tmp:
        family = traced_family(Path(tmp) / "templates")
        per_sm = [
            trace_call(family, shape, seed, args.probe, args.long) for seed in range(args.runs)
        ]
    for i in range(1, len(per_sm)):
        rho = _rank_correlation(per_sm[0], per_sm[i])
        print(f"rank correlation of the SMs' first-tile-to-end times, run 0 vs run {i}: {rho:.2f}")


if __name__ == "__main__":
    main()
