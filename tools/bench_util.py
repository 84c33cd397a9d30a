"""Shared by the benchmarks in tools/."""

from __future__ import annotations

import time

import torch


def warm_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy for a while first: an idle H200 sits at a few hundred MHz and the
    first timings (the small, latency-bound rows) would otherwise catch the clock ramp."""
    x = torch.randn(4096, 4096, device="cuda")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            x = (x @ x).clamp_(-1, 1)
        torch.cuda.synchronize()
