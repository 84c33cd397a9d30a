"""One fp8_paged_mqa_logits launch for Nsight Compute (B=256, next_n=1, H=64, L=8192, block 64).

    ncu --clock-control none --kernel-name regex:paged_mqa_logits --launch-skip 1 \\
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section Occupancy \\
        python tools/ncu_mqa_logits.py [--variant W,S,PORTABLE,RING] [--batch B] ...

The first call compiles/loads and warms up (skipped by --launch-skip 1); the second is
the profiled launch. --variant forces (warpgroups, stages, portable, ring) as the
benchmark's variants do, e.g. 4,2,0,0 for the direct kernel, or
tma,W,S,PRODUCERS,QBUF[,PROBE] (mqa_logits.tma.TmaConfig; PROBE: tools/mqa_logits_probe.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_mqa_logits as bench  # noqa: E402
from mqa_logits_probe import probe_options  # noqa: E402

from flashinfer_jit.mqa_logits import OP, MqaLogitsOptions  # noqa: E402
from flashinfer_jit.mqa_logits.tma import TmaConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    bench.add_shape_args(parser, batch=256)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument(
        "--variant",
        default=None,
        help="W,S,PORTABLE,RING or tma,W,S,PRODUCERS,QBUF[,PROBE] (default: auto)",
    )
    args = parser.parse_args()
    options = MqaLogitsOptions()
    if args.variant and args.variant.startswith("tma,"):
        w, s, p, qb, *probe = (int(x) for x in args.variant.split(",")[1:])
        config = TmaConfig(w, s, p, qb)
        options = probe_options(config, probe[0]) if probe else MqaLogitsOptions(config=config)
    elif args.variant:
        w, s, p, r = (int(x) for x in args.variant.split(","))
        options = MqaLogitsOptions(config=(w, s, bool(p), bool(r)))
    logits = OP.runner(options).call
    gen = torch.Generator().manual_seed(0)
    q, kv, w, table, lens = bench.make_set(
        args.batch, args.next_n, args.heads, args.length, args.block, gen
    )
    for _ in range(2):  # launch 1: warm-up (skipped by ncu), launch 2: profiled
        logits(q, kv, w, table, lens, args.length)
    torch.cuda.synchronize()
    print("ok: 2 launches of fp8_paged_mqa_logits")


if __name__ == "__main__":
    main()
