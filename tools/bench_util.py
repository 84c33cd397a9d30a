"""Shared by the benchmarks in tools/."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

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


# How time_replays orders and separates the timed replays: "alt" the sides alternating rep
# by rep (the order rotating), each replay after a clean read of twice the L2; "rounds" the
# same without the read or the rotation (QSA's tools until a re-baseline); "seq" each side's
# reps back to back (MQA runs 1-15); "seq-busy" that with a ~30 us spin kernel queued before
# each start event (the GPU busy when the timed span opens); "seq-clean" that with alt's
# clean read before each replay (which of alt's two changes moves a figure).
PROTOCOLS = ("alt", "rounds", "seq", "seq-busy", "seq-clean")
CLEAN_READ = ("alt", "seq-clean")
L2_BYTES = 60e6  # the H200's 60 MiB L2, rounded (what the clean read covers twice)
SPIN_CYCLES = 50_000  # ~30 us at the H200's clocks


def clean_read() -> Callable[[], object]:
    """A call reading twice the L2 (a float32 sum into a 0-d tensor): after it, the L2 holds
    clean lines of its buffer only (capturable in a graph)."""
    buf, sink = torch.empty(int(2 * L2_BYTES / 4), device="cuda"), torch.empty((), device="cuda")
    return lambda: torch.sum(buf, dim=None, out=sink)


def time_replays(
    graphs: dict[str, torch.cuda.CUDAGraph],
    calls: dict[str, int] | int,
    reps: int,
    protocol: str = "alt",
) -> dict[str, float]:
    """Median µs per call of each graph (``calls``: the calls a replay of it makes), its
    replays timed one at a time between two events as ``protocol`` says (PROTOCOLS).
    (Session 25, MQA: timed one side after another, the first side of a row read 1-2.5 %
    slower than the same kernel timed later in the row; alternating without the read, an
    evict-first kernel replayed after DeepGEMM read up to 6 % faster than itself elsewhere
    in the rotation: its stream evicted its own lines first and hit the last set's lines
    DeepGEMM's normal-policy reads had left in L2.)"""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: one of {PROTOCOLS}")
    scrub = clean_read() if protocol in CLEAN_READ else None
    names = list(graphs)
    if protocol.startswith("seq"):
        rounds = [[name] * reps for name in names]
    elif protocol == "alt":
        rounds = [names[i % len(names) :] + names[: i % len(names)] for i in range(reps)]
    else:
        rounds = [names] * reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in names}
    for order in rounds:
        for name in order:
            if scrub is not None:
                scrub()  # L2 holds none of any side's sets
            elif protocol == "seq-busy":
                torch.cuda._sleep(SPIN_CYCLES)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            n = calls if isinstance(calls, int) else calls[name]
            times[name].append(start.elapsed_time(end) * 1e3 / n)
    return {name: statistics.median(t) for name, t in times.items()}


def per_call_in_graphs(
    sides: dict[str, list[Callable[[], object]]],
    reps: int,
    protocol: str = "alt",
    clean_each: bool = False,
) -> dict[str, float]:
    """Each side's calls captured back to back in one CUDA graph, replayed three times,
    then timed by time_replays: median µs per call. ``clean_each``: every call follows a
    clean_read inside the graph, and the reads' own time (a graph of reads alone, timed in
    the same order, returned as "read") is taken off each side's: a call starts on an L2 of
    other data and pays the write-back of what it leaves dirty (the read after it evicts it)."""
    if clean_each:
        read = clean_read()
        calls = len(next(iter(sides.values())))
        sides = {n: [lambda c=c: (read(), c()) for c in cs] for n, cs in sides.items()}
        result = per_call_in_graphs({**sides, "read": [read] * calls}, reps, protocol)
        return {n: t - result["read"] if n != "read" else t for n, t in result.items()}
    graphs, keep = {}, []
    for name, calls in sides.items():
        keep += [c() for c in calls]  # compile, load; outputs live as long as the graphs
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            keep += [c() for c in calls]
    for _ in range(3):
        for graph in graphs.values():
            graph.replay()
    result = time_replays(graphs, {name: len(c) for name, c in sides.items()}, reps, protocol)
    del keep, graphs
    return result


def eager(sides: dict[str, list[Callable[[], object]]], reps: int) -> dict[str, float]:
    """One call between two events, cycling the sets (host and launch included); the
    sides alternate call by call, so clock changes hit both alike."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(reps):
        for name, calls in sides.items():
            torch.cuda.synchronize()
            start.record()
            calls[i % len(calls)]()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {f"{name}_eager": statistics.median(t) for name, t in times.items()}
