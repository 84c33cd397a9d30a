"""Host cost of eager ``fp8_paged_mqa_logits`` calls on the GPU (B=1, next_n=1, H=64, L=8192).

    python tools/profile_host_mqa.py [--calls 3000]

Prints the mean host time per call (perf_counter, out=None and out= given), then runs
cProfile over the calls and prints the top 25 functions by tottime. The GPU work of a
call is tiny, so the loop measures the Python path: the fast-path key, the plan
lookup, the argument packing and cuLaunchKernel.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit import fp8_paged_mqa_logits, padded_seq_len  # noqa: E402
from tools.bench_mqa_logits import make_set  # noqa: E402


def per_call_us(args, calls: int, out) -> float:
    """Median host time of one call with the GPU idle (synchronized before each call, so
    a full launch queue never blocks the host)."""
    times = []
    for i in range(calls + 50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fp8_paged_mqa_logits(*args, out=out)
        if i >= 50:
            times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    q, kv, w, table, lens = make_set(1, 1, 64, 8192, 64, gen)
    call = (q, kv, w, table, lens, 8192)
    out = torch.empty(1, padded_seq_len(8192), device="cuda")
    print(f"host us per eager call, out=None: {per_call_us(call, args.calls, None):.1f}")
    print(f"host us per eager call, out=given: {per_call_us(call, args.calls, out):.1f}")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fp8_paged_mqa_logits(*call)
        torch.cuda.synchronize()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile over {args.calls} eager calls (out=None), top 25 by tottime:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
