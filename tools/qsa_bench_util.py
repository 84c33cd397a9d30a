"""Inputs, checks, timers and the gather probe of the QSA benchmarks (tools/bench_qsa.py and its dispatch
sweep, tools/qsa_dispatch_sweep.py): one place, so every mode measures the same way.

Inputs follow the issue: valid_count uniform in [topk/2, topk] and -1 past it, logical
indices drawn without replacement from a 16K-token context per request, pages scattered
over a 6 GiB pool, the cache being the serving layout [blocks, Hkv, page, 2D] transposed and
split (zero-copy: V right after K, so D=128 takes the bulk copies). Several input sets
rotate so L2 does not hold one call's gathers for the next.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from bench_util import time_replays

from flashinfer_jit._jit import cuda_device_index
from flashinfer_jit._version import __version__
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa.checks import offset_bits
from flashinfer_jit.qsa.reference import qsa_decode_torch
from jit_kernels import I32, I64, PTR, U32, KernelBuilder, KernelFamily, current_stream

# bench_util.PROTOCOLS: "rounds", the order every QSA run before session 26 was timed in;
# QSA_BENCH_PROTOCOL=alt: each replay after a clean read of twice the L2 (session 26 ran the
# sweep both ways: BENCHMARKS.md)
QSA_PROTOCOL = os.environ.get("QSA_BENCH_PROTOCOL", "rounds")
BANDWIDTH = 4.24e6  # bytes per microsecond (measured device-to-device copy on the H200)
PAGE, HEAD_DIM = 64, 128
L2_CYCLE_BYTES = 240e6  # 4x the H200's 60 MB L2: one graph's gathers pass it this often
# The correctness contract every variant is checked against before timing, the GPU tests'
# (tests/test_qsa.py assert_close): per (row, head) a norm-wise relative error under TOL, and
# every element within 2^-8 |ref| (the bf16 store) + 4e-3 of its head row's max |ref| (fp16
# P and fp32 sums on elements near zero). A looser ``tol`` (the seed's) scales both.
TOL = 5e-3
Args = tuple  # one call's arguments, as the public functions take them
_pool: list[torch.Tensor] = []
# The probe kernels of tools/kernels/: built like the package's, never shipped.
TOOLS_BUILDER = KernelBuilder(Path(__file__).resolve().parent / "kernels", __version__ + "+tools")


def pool(gib: float) -> torch.Tensor:
    """A flat uint8 pool of about ``gib`` GiB holding random e4m3 codes (made once)."""
    if not _pool:
        flat = torch.empty(int(gib * (1 << 30)) & ~4095, dtype=torch.uint8, device="cuda")
        for part in flat.split(1 << 28):
            codes = (torch.randn(part.numel(), device="cuda") * 0.5).to(torch.float8_e4m3fn)
            part.copy_(codes.view(torch.uint8))
        _pool.append(flat)
    return _pool[0]


def make_sets(
    rows: int,
    hq: int,
    hkv: int,
    topk: int,
    n_sets: int,
    gib: float,
    seed: int = 0,
    page: int = PAGE,
    head_dim: int = HEAD_DIM,
) -> list[Args]:
    """``n_sets`` argument tuples over one pool, each its own requests and selections."""
    torch.manual_seed(seed)
    flat = pool(gib)
    blocks = flat.numel() // (hkv * page * 2 * head_dim)
    kv = flat[: blocks * hkv * page * 2 * head_dim].view(blocks, hkv, page, 2 * head_dim)
    k_cache, v_cache = kv.transpose(1, 2).split(head_dim, dim=-1)
    context = max(16384, 2 * topk)
    requests = min(max(rows * n_sets, 64), 512)
    block_table = torch.randint(
        0, blocks, (requests, -(-context // page)), dtype=torch.int32, device="cuda"
    )
    sets = []
    for s in range(n_sets):
        idx = torch.rand(rows, context, device="cuda").argsort(dim=1)[:, :topk].to(torch.int32)
        count = torch.randint(topk // 2, topk + 1, (rows,), device="cuda", dtype=torch.int32)
        idx = torch.where(torch.arange(topk, device="cuda")[None, :] < count[:, None], idx, -1)
        indices = torch.cat([idx, count[:, None]], dim=1).contiguous()
        t2r = ((torch.arange(rows, device="cuda") + s * rows) % requests).to(torch.int32)
        q = torch.randn(rows, hq, head_dim, device="cuda").to(torch.bfloat16)
        gate = torch.randn(rows, hq, head_dim, device="cuda").to(torch.bfloat16)
        out = torch.empty_like(q)
        scale = 1 / math.sqrt(head_dim)
        sets.append((q, k_cache, v_cache, indices, block_table, t2r, out, gate, scale, 1.0))
    return sets


def n_sets_for(rows: int, hkv: int, topk: int, head_dim: int = HEAD_DIM) -> int:
    # Enough sets that one graph's gathers exceed L2 (60 MB) several times over.
    per_call = rows * hkv * topk * 0.75 * 2 * head_dim
    return int(min(16, max(2, math.ceil(L2_CYCLE_BYTES / per_call))))


def floor_us(args: Args) -> float:
    """Bytes one call must move (the selected K/V rows, q, gate, out, the indices) over
    BANDWIDTH."""
    q, k_cache, _, indices = args[:4]
    rows, hq, d = q.shape
    tokens = indices[:, -1].clamp(0, indices.shape[1] - 1).sum().item()
    nbytes = tokens * k_cache.shape[2] * 2 * d + 3 * rows * hq * d * 2 + indices.numel() * 4
    return nbytes / BANDWIDTH


def reference_of(args: Args) -> torch.Tensor:
    out = torch.empty_like(args[6])
    qsa_decode_torch(*args[:6], out, *args[7:])
    return out.float()


def check(run: Callable, args: Args, expect: torch.Tensor, tol: float = TOL) -> float:
    """The worst norm-wise relative error per (row, head) of ``run(args)`` against the
    torch path's output ``expect``; raises where TOL's contract (scaled by tol / TOL) fails."""
    out = args[6]
    out.fill_(float("nan"))
    run(args)
    torch.cuda.synchronize()
    got = out.float()
    if torch.isnan(got).any():
        raise AssertionError("NaN in output")
    diff, ref_norm = (got - expect).abs(), expect.norm(dim=-1)
    if (got[ref_norm == 0] != 0).any():
        raise AssertionError("a head row with nothing attended is not zero")
    rel = (diff.norm(dim=-1) / ref_norm.clamp_min(1e-30))[ref_norm > 0]
    worst = rel.max().item() if rel.numel() else 0.0  # (no row attended anything)
    bound = 2.0**-8 * expect.abs() + 4e-3 * expect.abs().amax(dim=-1, keepdim=True)
    excess = (diff - tol / TOL * bound).max().item()
    if worst >= tol or excess > 0:
        raise AssertionError(f"mismatch vs torch path: norm-wise {worst:.3e}, an element "
                             f"{excess:.3e} past its bound (tol {tol:g})")  # fmt: skip
    return worst


def capture(run: Callable, sets: Sequence[Args]) -> torch.cuda.CUDAGraph:
    """A graph holding one call per input set (compiled, loaded and replayed once)."""
    for args in sets:
        run(args)  # compile/load outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for args in sets:
            run(args)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graphs(graphs: dict[str, torch.cuda.CUDAGraph], calls: int, reps: int) -> dict:
    """Median µs per call of each graph (``calls`` calls a replay), timed by
    bench_util.time_replays in protocol QSA_PROTOCOL ("rounds": the graphs replayed in turn
    round after round, so a clock or power drift hits all alike; QSA_BENCH_PROTOCOL names
    another)."""
    return time_replays(graphs, calls, reps, QSA_PROTOCOL)


def time_graph(run: Callable, sets: Sequence[Args], reps: int = 30) -> float:
    """Median µs per call of a graph holding one call per input set."""
    return time_graphs({"run": capture(run, sets)}, len(sets), reps)["run"]


def time_eager(run: Callable, sets: Sequence[Args], reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for args in sets:
            run(args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(sets))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy TB/s (bytes read + written): this machine's ceiling today."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) * 1e-3) / 1e12


def timed(
    run: Callable, sets: Sequence[Args], expect: torch.Tensor, tol: float = TOL, reps: int = 30
) -> float | str:
    """Graph µs of ``run`` after a correctness check; an error string when either fails."""
    try:
        check(run, sets[0], expect, tol)
        return time_graph(run, sets, reps)
    except Exception as exc:  # one bad design must not end the run
        return f"ERR {type(exc).__name__}: {exc}"[:60]


def fmt(x: object) -> str:
    return "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [header, *[[fmt(c) for c in r] + ["-"] * (len(header) - len(r)) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


# The probe is a tool's kernel: built from tools/kernels/, never shipped.
_probe_family = KernelFamily(
    TOOLS_BUILDER,
    "qsa_gather_probe",
    "qsa_gather_probe.cuh",
    "fij_qsa::qsa_gather_probe",
    ("head_dim",),
    (PTR, U32, U32, U32, PTR, U32, U32, U32, PTR, I32, PTR, I64, I32, I32, I32, PTR),
)


def probe_runner(sets):
    """A run(args) that gathers what the decode would (slots resolved once, outside timing)."""
    slots = {id(a): qsa_plan.resolve_slots(a[3], a[4], a[5], a[1]) for a in sets}
    sink = torch.empty(max(a[0].shape[0] for a in sets) * 8 * 256, dtype=torch.int32, device="cuda")

    def run(args):
        q, k, v, indices = args[:4]
        s = slots[id(args)]
        device = cuda_device_index(q)
        counts = indices.data_ptr() + (indices.shape[1] - 1) * indices.stride(1) * 4
        launch_args = (k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3])
        launch_args += (s.data_ptr(), s.shape[1], counts, indices.stride(0), indices.shape[1] - 1)
        launch_args += (offset_bits(PAGE), k.shape[2], sink.data_ptr())
        _probe_family.get((HEAD_DIM,), device).launch(
            (q.shape[0], 8, 1), (256, 1, 1), current_stream(device), launch_args
        )

    return run
