"""Benchmark fp8_paged_mqa_logits on the GPU against the byte floor and DeepGEMM's figures.

    python tools/bench_mqa_logits.py [--quick | --lean | --sweep | --power] [--reps N]

Inputs follow ../shared/FACTS.md's DeepGEMM table: head_dim 128, block 64 (plus block 32
and 128 comparisons at two rows), seq lens uniform in [0.7 L, L], a shuffled KV pool, fp32
logits. Per row a few kernel variants (ring/direct kernel, warpgroups, stages) are checked
against a float64 reference on a few requests and then timed with CUDA events around the
eager call (internal output allocation, like DeepGEMM's), median over many reps, rotating
enough input sets that the KV pool does not sit in L2. For the small rows the host cost of
one call (perf_counter around the call, GPU idle) and the CUDA-graph replay time are
measured too. The summary table prints last. --sweep compares TMA configs, PDL and the
kernel's timing probes per call in a graph; --power shows the SM clock, power and
clock-event reasons while the kernel and its probes run back to back.
"""

# size: one benchmark CLI (rows, variants, sweeps, probes, power): its modes share the set-up and timers

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashinfer_jit.mqa_logits as mq  # noqa: E402
from flashinfer_jit.mqa_logits import MqaLogitsOptions  # noqa: E402
from flashinfer_jit.mqa_logits import plan as mq_plan  # noqa: E402
from flashinfer_jit.mqa_logits.ring import ring_params  # noqa: E402
from flashinfer_jit.mqa_logits.tma import TmaConfig, small_work, tma_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_util import warm_gpu  # noqa: E402
from mqa_logits_probe import probe_options  # noqa: E402

from jit_kernels import KernelUnavailable, sm_count  # noqa: E402

BW = 4.24e12  # measured device-to-device copy bandwidth (bytes read + written per second)
D = 128
ROWS = [  # B, next_n, H, L, DeepGEMM us, target us (eager), target us (graph replay)
    (1, 1, 64, 8192, 21.6, 18, 8),
    (32, 1, 64, 8192, 22.2, 18, 12),
    (256, 1, 64, 8192, 88.8, 72, None),
    (256, 2, 64, 8192, 94.4, 78, None),
    (64, 1, 64, 65536, 147.3, 128, None),
    (64, 2, 64, 65536, 158.3, 135, None),
    (256, 1, 32, 8192, 86.0, 70, None),
    (128, 3, 64, 16384, None, 85, None),
    (128, 4, 32, 16384, None, 85, None),
]
# Variants: None = the dispatcher's choice (on sm_90 the TMA kernel); a TmaConfig = the TMA
# kernel forced (stages 0 = as many as fit); ("probe", n, config) = the TMA kernel's timing
# probe n in config (None: the dispatcher's with the plain loop; 1 = stream the tiles only, 2 = stream + MMA,
# 3 = stream + epilogue, no valid output: what each part costs, tools/mqa_logits_probe.py);
# ("auto", {field: value}) = the dispatcher's TMA config with those fields replaced;
# "no-pdl" = the dispatcher's choice launched without PDL; (warpgroups, stages, portable,
# ring) the ring/direct kernels of mqa_logits/sm90_ring_wgmma.cuh; "generic" the runtime-geometry fallback.
VARIANTS = [
    None,
    TmaConfig(2, 0, 2, 2),
    TmaConfig(4, 0, 4, 1),
    ("probe", 1, TmaConfig(2, 0, 2, 2)),
    (2, 0, False, True),
    (3, 0, False, True),
    (4, 2, False, False),  # the register-fed direct kernel (auto above head_dim ~448)
    "generic",
]
LEAN_VARIANTS = [None, ("probe", 1, None), (3, 0, False, True), "generic"]
# --sweep: TMA configs, PDL and the auto config's probes, graph-timed.
SWEEP_VARIANTS = [
    None,
    "no-pdl",
    *(("probe", n, None) for n in (1, 2, 3)),
    *(TmaConfig(w, 0, w, qb) for w, qb in ((2, 1), (3, 1), (4, 1), (4, 2))),
]
BLOCK_ROWS = {(256, 1, 64, 8192), (128, 3, 64, 16384)}  # rows compared at blocks 32/128


def vname(v) -> str:
    if v is None or isinstance(v, str):
        return v or "auto"
    if v[0] == "auto":
        return "auto-" + ",".join(f"{k}{x}" for k, x in v[1].items())
    if v[0] == "probe":
        return f"probe{v[1]}-" + ("auto" if v[2] is None else vname(v[2]).removeprefix("tma"))
    if isinstance(v, TmaConfig):
        return f"tma{v.warpgroups}x{v.stages or 'max'}p{v.producers}q{v.qbuf}"
    kind = "ring" if v[3] else "direct"
    return f"{kind}{'-mma' if v[2] else ''}{v[0]}x{v[1] or 'max'}"


def add_shape_args(parser: argparse.ArgumentParser, batch: int) -> None:
    """--batch, --next-n, --heads, --length: one row's shape, for the tools that run one."""
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--next-n", type=int, default=1)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--length", type=int, default=8192)


def make_set(batch, next_n, heads, length, block, gen, device="cuda", shuffle=True, long=0):
    """One input set; ``long``: one request of that length among the others (skewed)."""
    lens = torch.randint(int(0.7 * length), length + 1, (batch,), generator=gen, dtype=torch.int32)
    if long:
        lens[int(torch.randint(0, batch, (1,), generator=gen))] = long
    need = (lens + block - 1) // block
    num_blocks = int(need.sum())
    width = mq.min_block_table_width(max(length, long), block)
    perm = (torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)).to(
        torch.int32
    )
    table = torch.zeros(batch, width, dtype=torch.int32)
    start = 0
    for b in range(batch):
        n = int(need[b])
        table[b, :n] = perm[start : start + n]
        start += n
    kv = torch.empty(num_blocks, block * (D + 4), dtype=torch.uint8, device=device)
    vals = torch.randn(num_blocks, block * D, device=device).to(torch.float8_e4m3fn)
    kv[:, : block * D] = vals.view(torch.uint8)
    kv[:, block * D :] = (torch.rand(num_blocks, block, device=device) + 0.5).view(torch.uint8)
    kv = kv.view(num_blocks, block, 1, D + 4)
    q = torch.randn(batch, next_n, heads, D, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(batch * next_n, heads, device=device)
    return q, kv, w, table.to(device), lens.to(device)


def check(logits, q, kv, w, table, lens, requests=4):
    """float64 reference on a few requests (gathered independently of the op's torch path)."""
    batch, next_n, heads, _ = q.shape
    block = kv.shape[1]
    pool = kv.view(kv.shape[0], -1)
    for b in torch.linspace(0, batch - 1, min(batch, requests)).long().tolist():
        n = int(lens[b])
        pos = torch.arange(n, device=q.device)
        blk = table[b, pos // block].long()
        off = pos % block
        k = pool[blk[:, None], off[:, None] * D + torch.arange(D, device=q.device)].view(
            torch.float8_e4m3fn
        )
        sc = pool[blk[:, None], block * D + off[:, None] * 4 + torch.arange(4, device=q.device)]
        sc = sc.contiguous().view(torch.float32)[:, 0].double()
        k = k.double()
        for t in range(next_n):
            valid = n - next_n + t + 1
            s = q[b, t].double() @ k[:valid].T
            wt = w[b * next_n + t].double()
            ref = (s.clamp_min(0) * wt[:, None]).sum(0) * sc[:valid]
            mag = ((q[b, t].double().abs() @ k[:valid].abs().T) * wt.abs()[:, None]).sum(0) * sc[
                :valid
            ]
            err = (logits[b * next_n + t, :valid].double() - ref).abs()
            if not bool((err <= 2e-3 * mag + 1e-6).all()):
                raise AssertionError(
                    f"mismatch in request {b} slot {t}: max err {float(err.max())}"
                )


def time_eager(sets, max_len, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        q, kv, w, table, lens = sets[i % len(sets)]
        start.record()
        logits(q, kv, w, table, lens, max_len)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(sets, max_len, reps):
    """Host cost of one eager call with the GPU idle: perf_counter around the call."""
    times = []
    for i in range(reps):
        q, kv, w, table, lens = sets[i % len(sets)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits(q, kv, w, table, lens, max_len)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def time_graph(sets, max_len, reps):
    """Replay time of a captured call (out= and schedule_meta=None), one graph per set."""
    graphs, outs = [], []  # each output lives as long as its graph (a capture frees the cache)
    for q, kv, w, table, lens in sets[:8]:
        outs.append(torch.empty(q.shape[0] * q.shape[1], mq.padded_seq_len(max_len), device="cuda"))
        logits(q, kv, w, table, lens, max_len, out=outs[-1])
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            logits(q, kv, w, table, lens, max_len, out=outs[-1])
        graphs.append(g)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(reps):
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_of_calls(sets, max_len) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One captured graph holding one call (out=, schedule_meta=None) per input set, up to
    8, back to back as a serving step's graph runs them; and the outputs it writes (one per
    call), which the caller keeps while it replays the graph: entering a capture empties
    torch's cache, so a freed output would leave the graph writing unmapped memory."""
    outs = [
        torch.empty(s[0].shape[0] * s[0].shape[1], mq.padded_seq_len(max_len), device="cuda")
        for s in sets[:8]
    ]

    def calls() -> None:
        for (q, kv, w, table, lens), out in zip(sets[:8], outs, strict=True):
            logits(q, kv, w, table, lens, max_len, out=out)

    calls()  # compile and load before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph, outs


def time_graph_calls(sets, max_len, reps):
    """Per call inside graph_of_calls: kernel time + the in-graph launch gap, without the
    graph launch itself (~9 us for an empty op's graph on the H200 machine)."""
    graph, outs = graph_of_calls(sets, max_len)
    return _event_us(graph.replay, max(10, reps // 4)) / len(outs)


def floor_us(sets, next_n):
    tokens = statistics.mean(float(s[4].sum()) for s in sets)
    return tokens * (D + 4 + 4 * next_n) / BW * 1e6


def auto_config(batch: int, next_n: int, heads: int, length: int) -> TmaConfig:
    """The dispatcher's TMA config for a row (mqa_logits_tma.small_work decides)."""
    return tma_config(next_n * heads, small_work(batch, length, sm_count(0)), next_n=next_n)


def variant_options(v, shape: tuple[int, int, int, int]) -> MqaLogitsOptions:
    """The options of variant v (see VARIANTS) for a row's shape (batch, next_n, heads, length)."""
    if isinstance(v, tuple) and v[0] == "probe":  # (the probes patch the plain loop)
        config = v[2] if v[2] is not None else auto_config(*shape)._replace(lean=0, pair=0)
        return probe_options(config, v[1])
    config = None
    if isinstance(v, tuple) and v[0] == "auto":  # the dispatcher's TMA config, modified
        config = auto_config(*shape)._replace(**v[1])
    elif isinstance(v, tuple):
        config = v
    return MqaLogitsOptions(config=config, force_generic=v == "generic", pdl=v != "no-pdl")


_variant = mq.OP.default  # the op's runner with the variant being timed (set_variant)
F32 = torch.float32


def set_runner(runner) -> None:
    """Time the op through ``runner`` (an ``OP.runner(options)``) from now on."""
    global _variant
    _variant = runner


def set_variant(v, shape: tuple[int, int, int, int]) -> None:
    """Time variant v (see VARIANTS) for a row's shape from now on."""
    set_runner(mq.OP.runner(variant_options(v, shape)))


def logits(q, kv, w, table, lens, max_len, out=None) -> torch.Tensor:
    """fp8_paged_mqa_logits with the variant set_variant chose, on the public call's path."""
    return _variant((q, kv, w, table, lens, max_len, F32, F32, F32, None, out, False))


def run_row(batch, next_n, heads, length, block, reps, variants, gen, timer=None):
    set_bytes = batch * 0.85 * length * (D + 4)
    n_sets = int(min(48, max(2, 240e6 // max(set_bytes, 1))))
    sets = [make_set(batch, next_n, heads, length, block, gen) for _ in range(n_sets)]
    results = {}
    for v in variants:
        set_variant(v, (batch, next_n, heads, length))
        try:
            forced = _variant.options.config
            tma = isinstance(forced, TmaConfig) or _variant.options.tma_family is not None
            if isinstance(v, tuple) and not tma:  # a forced ring/direct config that cannot fit
                ring_params((next_n, heads, D, block), (F32, F32, F32), forced)
            q, kv, w, table, lens = sets[0]
            mq_plan._plans.clear()
            _variant.replays.clear()
            got = logits(q, kv, w, table, lens, length)
            served = next(iter(mq_plan._plans.values())).kernel.name
            if tma and "mqa_logits_tma" not in served:
                raise KernelUnavailable(f"the TMA kernel did not serve ({served})")
            if _variant.options.tma_family is None:  # probes: no logits
                check(got, q, kv, w, table, lens)
            if not results:  # the first variant after the sets are made reads up to ~5 %
                (timer or time_eager)(sets, length, reps)  # slow (clock ramp): time it twice
            results[vname(v)] = (timer or time_eager)(sets, length, reps)
        except KernelUnavailable as exc:
            results[vname(v)] = None
            print(f"  [{batch},{next_n},{heads},{length},blk{block}] {vname(v)} n/a: {exc}")
        except Exception as exc:  # report and keep going
            results[vname(v)] = None
            print(f"  [{batch},{next_n},{heads},{length},blk{block}] {vname(v)} failed: {exc!r}")
            traceback.print_exc(limit=2)
        finally:
            set_variant(None, (batch, next_n, heads, length))
    return sets, results


# The streaming probe's knobs: (warpgroups, stages, producer warps).
PROBES = [
    None,
    *(("probe", 1, TmaConfig(2, s, p, 2)) for s in (8, 16, 0) for p in (1, 2)),
]


def _event_us(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def pool_probe(reps: int) -> None:
    """What limits the streaming: the order of the KV blocks in the pool (TLB reach, DRAM
    pages), the bytes in flight (stages), the copy issue rate (producer warps)?"""
    rows = []
    for shuffle in (True, False):
        gen = torch.Generator().manual_seed(0)
        sets = [make_set(256, 1, 64, 8192, 64, gen, shuffle=shuffle) for _ in range(2)]
        for v in PROBES:
            set_variant(v, (256, 1, 64, 8192))
            logits(*sets[0], 8192)
            rows.append(
                ("shuffled" if shuffle else "sequential", vname(v), time_eager(sets, 8192, reps))
            )
            set_variant(None, (256, 1, 64, 8192))
        rows.append(
            ("shuffled" if shuffle else "sequential", "auto graph", time_graph(sets, 8192, reps))
        )
        del sets
    print("\npool order probe, B=256 next_n=1 H=64 L=8192 block 64 (eager us unless noted):")
    print("| pool | variant | us |")
    for pool, name, t in rows:
        print(f"| {pool} | {name} | {t:.1f} |")


def sweep(reps: int) -> None:
    warm_gpu()
    gen = torch.Generator().manual_seed(0)
    names = [vname(v) for v in SWEEP_VARIANTS]
    table = []
    for batch, next_n, heads, length, *_ in ROWS:
        sets, res = run_row(
            batch, next_n, heads, length, 64, reps, SWEEP_VARIANTS, gen, time_graph_calls
        )
        table.append((batch, next_n, heads, length, floor_us(sets, next_n), res))
        del sets
        torch.cuda.empty_cache()
    print("\nTMA config sweep, per call in a CUDA graph of 8 calls, us (block 64):")
    print("| B | next_n | H | L | floor | " + " | ".join(names) + " |")
    for batch, next_n, heads, length, floor, res in table:
        cells = " | ".join("-" if res.get(n) is None else f"{res[n]:.1f}" for n in names)
        print(f"| {batch} | {next_n} | {heads} | {length} | {floor:.1f} | {cells} |")


SMI_QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
POWER_ROWS = [(128, 3, 64, 16384), (64, 2, 64, 65536), (256, 1, 64, 8192)]


def _smi() -> str:
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    return (done.stdout or done.stderr).strip()


def sustained(sets, max_len, seconds: float = 2.0) -> tuple[float, list[str]]:
    """Per call (us) while a graph of 8 calls replays back to back for `seconds`, and
    nvidia-smi's SM clock, power, temperature and clock-event reasons at 1/2 and 3/4 of it
    (reason 0x4: the software power cap)."""
    graph, outs = graph_of_calls(sets, max_len)
    samples: list[str] = []

    def sample() -> None:
        time.sleep(seconds / 2)
        samples.append(_smi())
        time.sleep(seconds / 4)
        samples.append(_smi())

    sampler = threading.Thread(target=sample)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sampler.start()
    t0, replays = time.time(), 0
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            graph.replay()
        replays += 20
        torch.cuda.current_stream().synchronize()  # keep the queue short
    end.record()
    end.synchronize()
    sampler.join()
    return start.elapsed_time(end) * 1e3 / (replays * len(outs)), samples


def power(_reps: int) -> None:
    """What bounds the compute-heavy rows: the SM clock and power while the dispatcher's
    kernel and its probes run back to back (one variant at a time)."""
    warm_gpu()
    gen = torch.Generator().manual_seed(0)
    variants = [None, *(("probe", n, None) for n in (1, 2, 3))]
    print(f"idle: {_smi()}  ({SMI_QUERY})")
    print("| B | next_n | H | L | variant | us per call | clock, power, temp, reasons (x2) |")
    for batch, next_n, heads, length in POWER_ROWS:
        sets = [make_set(batch, next_n, heads, length, 64, gen) for _ in range(8)]
        for v in variants:
            set_variant(v, (batch, next_n, heads, length))
            try:
                us, samples = sustained(sets, length)
            finally:
                set_variant(None, (batch, next_n, heads, length))
            cells = " / ".join(samples)
            print(f"| {batch} | {next_n} | {heads} | {length} | {vname(v)} | {us:.1f} | {cells} |")
        del sets
        torch.cuda.empty_cache()


# size: the CLI's modes and table layout, read top to bottom
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="auto variant only")
    parser.add_argument(
        "--lean", action="store_true", help="auto + LEAN_VARIANTS, 100 reps (one device call)"
    )
    parser.add_argument(
        "--pool-probe",
        action="store_true",
        help="only B=256 next_n=1: auto and the streaming probe on a shuffled and a sequential pool",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the TMA kernel's config grid, timed as CUDA-graph replays (kernel time, no host)",
    )
    parser.add_argument(
        "--power",
        action="store_true",
        help="SM clock, power and clock-event reasons while the kernel and its probes run back "
        "to back (nvidia-smi)",
    )
    args = parser.parse_args()
    if args.power:
        power(args.reps)
        return
    if args.sweep:
        sweep(args.reps)
        return
    if args.pool_probe:
        pool_probe(args.reps)
        return
    variants = [None] if args.quick else LEAN_VARIANTS if args.lean else VARIANTS
    if args.lean:
        args.reps = min(args.reps, 100)
    gen = torch.Generator().manual_seed(0)
    torch.cuda.init()
    warm_gpu()
    print(
        f"device: {torch.cuda.get_device_name()}  SMs: {torch.cuda.get_device_properties(0).multi_processor_count}"
    )

    summary, per_variant, blocks, graphs = [], [], [], []
    t_start = time.time()
    for batch, next_n, heads, length, dg, target, gtarget in ROWS:
        try:
            sets, res = run_row(batch, next_n, heads, length, 64, args.reps, variants, gen)
            floor = floor_us(sets, next_n)
            ok = {k: v for k, v in res.items() if v is not None}
            best = min(ok, key=ok.get) if ok else None
            per_variant.append((batch, next_n, heads, length, res))
            summary.append(
                (
                    batch,
                    next_n,
                    heads,
                    length,
                    floor,
                    res.get("auto"),
                    ok.get(best),
                    best,
                    dg,
                    target,
                )
            )
            replay = time_graph(sets, length, args.reps)  # the auto kernel without host time
            in_graph = time_graph_calls(sets, length, args.reps)
            host = host_us(sets, length, args.reps)
            graphs.append((batch, next_n, heads, length, replay, in_graph, gtarget, host))
            del sets
            for block in (32, 128) if (batch, next_n, heads, length) in BLOCK_ROWS else ():
                bsets, bres = run_row(batch, next_n, heads, length, block, args.reps, [None], gen)
                blocks.append(
                    (batch, next_n, heads, length, block, bres.get("auto"), res.get("auto"))
                )
                del bsets
        except Exception as exc:
            print(f"row {batch},{next_n},{heads},{length} failed: {exc!r}")
            traceback.print_exc(limit=3)
        torch.cuda.empty_cache()
        print(
            f"row {batch},{next_n},{heads},{length} done at {time.time() - t_start:.0f} s",
            flush=True,
        )

    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    names = [vname(v) for v in variants]
    print("\nper-variant eager us (block 64):")
    print("| B | next_n | H | L | " + " | ".join(names) + " |")
    for batch, next_n, heads, length, res in per_variant:
        print(
            f"| {batch} | {next_n} | {heads} | {length} | "
            + " | ".join(f(res.get(n)) for n in names)
            + " |"
        )
    print("\nblock size comparison (auto variant, eager us):")
    print("| B | next_n | H | L | block | us | block-64 us | ratio |")
    for batch, next_n, heads, length, block, t, t64 in blocks:
        ratio = f"{t / t64:.2f}" if t and t64 else "-"
        print(
            f"| {batch} | {next_n} | {heads} | {length} | {block} | {f(t)} | {f(t64)} | {ratio} |"
        )
    print(
        "\nCUDA graphs of auto (out=, schedule_meta=None): one call per replay (graph launch"
        " included) and per call in one graph of 8 calls; host time per eager call:"
    )
    print("| B | next_n | H | L | replay us | per call in graph us | graph target us | host us |")
    for batch, next_n, heads, length, t, t_in, target, host in graphs:
        print(
            f"| {batch} | {next_n} | {heads} | {length} | {f(t)} | {f(t_in)} | {target or '-'} "
            f"| {f(host)} |"
        )
    print(
        "\nfp8_paged_mqa_logits, H200, D=128, block 64, seq lens in [0.7L, L], fp32 logits, eager:"
    )
    print(
        "| B | next_n | H | L | floor us | ours us (auto) | ours us (best) | best variant | % floor (best) "
        "| DeepGEMM us | target us |"
    )
    for batch, next_n, heads, length, floor, auto, best_t, best, dg, target in summary:
        pct = f"{100 * floor / best_t:.0f}%" if best_t else "-"
        print(
            f"| {batch} | {next_n} | {heads} | {length} | {f(floor)} | {f(auto)} | {f(best_t)} | {best} | {pct} "
            f"| {f(dg) if dg else 'unsupported'} | {target} |"
        )


if __name__ == "__main__":
    main()
