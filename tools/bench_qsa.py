"""Benchmark QSA fp8 sparse paged decode on a GPU: designs, gather ceiling, crossover, issue table.

    python tools/bench_qsa.py [--no-designs] [--no-sweep]      # about 2 minutes on the H200
    python tools/bench_qsa.py --ncu-one [--ncu-config W,S,C,H]  # ONE decode launch, rows=512

Inputs follow the issue: D=128, page 64, valid_count uniform in [topk/2, topk] and -1 past
it, logical indices drawn without replacement from a 16K-token context per request, pages
scattered over a 6 GiB pool. Two cache layouts over the same pool bytes:
  * combined: the serving cache [blocks, Hkv, page, 2D] transposed and split (a token's K
    and V of one kv head are 256 contiguous bytes; kv heads are page * 2D bytes apart);
  * separate: two contiguous [blocks, page, Hkv, D] caches (a token's K of all kv heads is
    Hkv * D contiguous bytes, its V likewise).
and two selection orders: random (as the top-k hands it over) and sorted ascending.
"probe" is a kernel that only gathers the same bytes (templates/qsa_slots.cuh,
qsa_gather_probe): the access pattern's ceiling on this memory system. Designs are the
decode's (warps, stages, min CTAs/SM, kv heads per CTA) configs. Several input sets rotate
so L2 does not hold one call's gathers for the next; every design is checked against the
torch path before it is timed (a failure prints and the run goes on). Times are CUDA-graph
replays per call. The issue table prints last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashinfer_jit import qsa  # noqa: E402
from flashinfer_jit._jit import cuda_device_index, kernel_family  # noqa: E402
from flashinfer_jit.qsa_ref import qsa_decode_torch  # noqa: E402
from jit_kernels import current_stream  # noqa: E402

BANDWIDTH = 4.24e6  # bytes per microsecond (measured device-to-device copy on the H200)
PAGE, HEAD_DIM = 64, 128
# (rows, Hq, Hkv, topk) -> (Triton µs, target µs) from FACTS.md / the issue.
ISSUE_SHAPES = {
    (64, 64, 4, 2048): ("198 / 136 (graph 68)", 50),
    (512, 64, 4, 2048): ("432 / 350", 240),
    (2048, 32, 4, 1024): ("585 / 594", 460),
    (4, 64, 4, 2048): ("- / 119 (graph 46)", 10),
    (256, 32, 8, 4096): ("- / 590", None),
}
# Decode designs: (num_warps, num_stages, min_ctas, heads_per_cta).
DESIGNS = {
    "h1 w4": (4, 3, 4, 1),
    "h2 w4": (4, 3, 4, 2),
    "h4 w4": (4, 3, 4, 4),
    "h4 w8": (8, 2, 2, 4),
}
_probe_family = kernel_family(
    "qsa_gather_probe",
    "qsa_slots.cuh",
    "fij_qsa::qsa_gather_probe",
    ("head_dim",),
    ("P", "I", "I", "I", "P", "I", "I", "I", "P", "i", "P", "q", "i", "i", "i", "P"),
)
_pool: list[torch.Tensor] = []


def pool(gib: float) -> torch.Tensor:
    """A flat uint8 pool of about ``gib`` GiB holding random e4m3 codes (made once)."""
    if not _pool:
        flat = torch.empty(int(gib * (1 << 30)) & ~4095, dtype=torch.uint8, device="cuda")
        for part in flat.split(1 << 28):
            codes = (torch.randn(part.numel(), device="cuda") * 0.5).to(torch.float8_e4m3fn)
            part.copy_(codes.view(torch.uint8))
        _pool.append(flat)
    return _pool[0]


def caches(hkv: int, layout: str, gib: float):
    flat = pool(gib)
    blocks = flat.numel() // (hkv * PAGE * 2 * HEAD_DIM)
    n = blocks * hkv * PAGE * 2 * HEAD_DIM
    if layout == "combined":
        kv = flat[:n].view(blocks, hkv, PAGE, 2 * HEAD_DIM)
        k, v = kv.transpose(1, 2).split(HEAD_DIM, dim=-1)
        return k, v
    k = flat[: n // 2].view(blocks, PAGE, hkv, HEAD_DIM)
    v = flat[n // 2 : n].view(blocks, PAGE, hkv, HEAD_DIM)
    return k, v


def make_sets(
    rows, hq, hkv, topk, n_sets, gib, seed=0, layout="combined", order="random", span=None
):
    """``n_sets`` argument tuples over one pool, each its own requests and selections.

    ``span``: the fraction of the pool's blocks the block tables draw from (all of it when
    None), to separate the page-translation (TLB) reach from DRAM behaviour.
    """
    torch.manual_seed(seed)
    k_cache, v_cache = caches(hkv, layout, gib)
    context = max(16384, 2 * topk)
    requests = min(max(rows * n_sets, 64), 512)
    blocks = max(1, int(k_cache.shape[0] * (span or 1.0)))
    block_table = torch.randint(
        0, blocks, (requests, context // PAGE), dtype=torch.int32, device="cuda"
    )
    sets = []
    for s in range(n_sets):
        idx = torch.rand(rows, context, device="cuda").argsort(dim=1)[:, :topk].to(torch.int32)
        count = torch.randint(topk // 2, topk + 1, (rows,), device="cuda", dtype=torch.int32)
        valid = torch.arange(topk, device="cuda")[None, :] < count[:, None]
        if order == "sorted":  # the valid prefix ascending; -1 stays past it
            idx = torch.where(valid, idx, context).sort(dim=1).values
        idx = torch.where(valid, idx, -1)
        indices = torch.cat([idx, count[:, None]], dim=1).contiguous()
        t2r = ((torch.arange(rows, device="cuda") + s * rows) % requests).to(torch.int32)
        q = torch.randn(rows, hq, HEAD_DIM, device="cuda").to(torch.bfloat16)
        gate = torch.randn(rows, hq, HEAD_DIM, device="cuda").to(torch.bfloat16)
        sets.append(
            (
                q,
                k_cache,
                v_cache,
                indices,
                block_table,
                t2r,
                torch.empty_like(q),
                gate,
                1 / math.sqrt(HEAD_DIM),
                1.0,
            )
        )
    return sets


def n_sets_for(rows, hkv, topk) -> int:
    # Enough sets that one graph's gathers exceed L2 (60 MB) several times over.
    per_call = rows * hkv * topk * 0.75 * 2 * HEAD_DIM
    return int(min(16, max(2, math.ceil(240e6 / per_call))))


def floor_us(args) -> float:
    q, k_cache, _, indices = args[:4]
    rows, hq, d = q.shape
    tokens = indices[:, -1].clamp(0, indices.shape[1] - 1).sum().item()
    nbytes = tokens * k_cache.shape[2] * 2 * d + 3 * rows * hq * d * 2 + indices.numel() * 4
    return nbytes / BANDWIDTH


def reference_of(args) -> torch.Tensor:
    out = torch.empty_like(args[6])
    qsa_decode_torch(*args[:6], out, *args[7:])
    return out.float()


def check(run, args, expect) -> float:
    """Max error of ``run(args)`` against the torch path's output, normalized; raises on bad."""
    out = args[6]
    out.fill_(float("nan"))
    run(args)
    torch.cuda.synchronize()
    got = out.float()
    if torch.isnan(got).any():
        raise AssertionError("NaN in output")
    err = ((got - expect).abs() / (expect.abs() + 1e-2 * expect.abs().max())).max().item()
    if err > 2e-2:
        raise AssertionError(f"mismatch vs torch path: {err:.3e}")
    return err


def time_graph(run, sets, reps=30) -> float:
    """Median µs per call of a graph holding one call per input set."""
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
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(sets))
    return statistics.median(times)


def time_eager(run, sets, reps=20) -> float:
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


def kernel_breakdown(run, sets, reps=5) -> str:
    """Mean device µs per call of each kernel, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for args in sets:
                run(args)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("<")[0].split("(")[0][-24:]
            totals[name] = totals.get(name, 0.0) + event.device_time / (reps * len(sets))
    return ", ".join(f"{k} {v:.1f}" for k, v in sorted(totals.items(), key=lambda kv: -kv[1]))


def design(config, splits=1):
    return lambda args: qsa._run_kernels(*args, num_splits=splits, config=config)


def dispatcher(args):
    qsa.qsa_sparse_paged_attention(*args)


def probe_runner(sets):
    """A run(args) that gathers what the decode would (slots resolved once, outside timing)."""
    slots = {id(a): qsa._resolve_slots(a[3], a[4], a[5], a[1]) for a in sets}
    sink = torch.empty(max(a[0].shape[0] for a in sets) * 8 * 256, dtype=torch.int32, device="cuda")

    def run(args):
        q, k, v, indices = args[:4]
        s = slots[id(args)]
        device = cuda_device_index(q)
        _probe_family.get((HEAD_DIM,), device).launch(
            (q.shape[0], 8, 1),
            (256, 1, 1),
            current_stream(device),
            (
                k.data_ptr(),
                *k.stride()[:3],
                v.data_ptr(),
                *v.stride()[:3],
                s.data_ptr(),
                s.shape[1],
                indices.data_ptr() + (indices.shape[1] - 1) * indices.stride(1) * 4,
                indices.stride(0),
                indices.shape[1] - 1,
                qsa._offset_bits(PAGE),
                k.shape[2],
                sink.data_ptr(),
            ),
        )

    return run


def fmt(x) -> str:
    return "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))


def table(header, rows) -> str:
    cells = [header, *[[fmt(c) for c in r] + ["-"] * (len(header) - len(r)) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def timed(run, sets, expect):
    """Graph µs of ``run`` after a correctness check; an error string when either fails."""
    try:
        check(run, sets[0], expect)
        return time_graph(run, sets)
    except Exception as exc:  # one bad design must not end the run
        return f"ERR {type(exc).__name__}: {exc}"[:60]


def best_of(times: dict):
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    return min(ok, key=ok.get) if ok else None


def bench_designs(gib) -> None:
    """Probe ceiling and every design, per shape x layout x selection order."""
    print("\n== designs: graph µs per call (slot pass included; probe = gather only)")
    rows_out = []
    for shape in [(64, 64, 4, 2048), (512, 64, 4, 2048), (2048, 32, 4, 1024), (256, 32, 8, 4096)]:
        rows, hq, hkv, topk = shape
        for layout in ("combined", "separate"):
            for order in ("random", "sorted"):
                try:
                    sets = make_sets(
                        *shape, n_sets_for(rows, hkv, topk), gib, seed=3, layout=layout, order=order
                    )
                    expect = reference_of(sets[0])
                    probe = time_graph(probe_runner(sets), sets)
                    times = {
                        name: timed(design(cfg), sets, expect)
                        for name, cfg in DESIGNS.items()
                        if hkv % cfg[3] == 0
                    }
                    floor = floor_us(sets[0])
                    rows_out.append(
                        [
                            f"{rows}/{hq}/{hkv}/{topk}",
                            layout,
                            order,
                            floor,
                            probe,
                            *[times.get(n) for n in DESIGNS],
                            best_of(times),
                        ]
                    )
                    del sets
                except Exception as exc:
                    traceback.print_exc()
                    rows_out.append([f"{rows}/{hq}/{hkv}/{topk}", layout, order, f"ERR {exc}"[:60]])
    print(
        table(["rows/Hq/Hkv/topk", "layout", "order", "floor", "probe", *DESIGNS, "best"], rows_out)
    )


def bench_span(gib) -> None:
    """rows=512: the probe and the default design as the pages' spread over the pool shrinks.

    If time falls with the span well beyond what L2 (60 MB) can hold, the gather is bound by
    address translation (TLB reach), not by DRAM.
    """
    print("\n== pool span, rows=512 Hq=64 Hkv=4 topk=2048 combined/random: graph µs per call")
    out = []
    for span_gib in (0.25, 0.5, 1.0, 2.0, 4.0, gib):
        sets = make_sets(512, 64, 4, 2048, 2, gib, seed=6, span=span_gib / gib)
        expect = reference_of(sets[0])
        out.append(
            [
                span_gib,
                time_graph(probe_runner(sets), sets),
                timed(design(qsa.DECODE_CONFIG[HEAD_DIM]), sets, expect),
                floor_us(sets[0]),
            ]
        )
        del sets
    print(table(["span GiB", "probe", "default design", "floor"], out))


def bench_small(gib) -> None:
    """rows=4: split counts x designs (split-K only: one (row, kv head) CTA is far too few)."""
    print("\n== rows=4 Hq=64 Hkv=4 topk=2048, combined/random: graph µs per call by splits")
    shape = (4, 64, 4, 2048)
    sets = make_sets(*shape, 16, gib, seed=4)
    expect = reference_of(sets[0])
    # Workspace split-K (slot pass + decode) and cluster split-K, whose splits merge through
    # DSMEM (cluster = splits <= 8), with the slot pass ("slots") or slots resolved in the
    # kernel ("fused": the call is one launch).
    configs = {
        "h1 w4": lambda k: (4, 3, 4, 1),
        "h1 w8": lambda k: (8, 2, 2, 1),
        "h2 w8": lambda k: (8, 2, 2, 2),
        "h4 w8": lambda k: (8, 2, 2, 4),
        "cluster h1 w4 slots": lambda k: (4, 3, 4, 1, k, 0),
        "cluster h1 w4 fused": lambda k: cluster_cfg((4, 3, 4, 1), k, 2048),
        "cluster h1 w8 fused": lambda k: cluster_cfg((8, 2, 2, 1), k, 2048),
        "cluster h2 w8 fused": lambda k: cluster_cfg((8, 2, 2, 2), k, 2048),
    }
    splits_list = (2, 4, 8, 16, 32)
    out = []
    for name, cfg in configs.items():
        cells = []
        for k in splits_list:
            c = cfg(k)
            cells.append(None if len(c) > 4 and k > 8 else timed(design(c, k), sets, expect))
        out.append([name, *cells])
    print(table(["design", *[f"split {k}" for k in splits_list]], out))
    print(f"dispatcher kernels: {kernel_breakdown(dispatcher, sets)}")
    fused = design(cluster_cfg((4, 3, 4, 1), 8, 2048), 8)
    print(f"cluster h1 w4 fused, 8 splits, kernels: {kernel_breakdown(fused, sets)}")


def cluster_cfg(base, splits: int, topk: int):
    """A fused cluster config: the slot list sized to one split's share (pow2, >= 256)."""
    chunks = -(-topk // 16)
    per_split = -(-chunks // splits) * 16
    cap = max(256, 1 << (per_split - 1).bit_length())
    return (*base, splits, cap if cap <= 4096 else 0)


def bench_sweep(gib) -> None:
    """Single pass (each design) vs split-K vs the dispatcher, G=16, Hkv=4."""
    print("\n== crossover sweep: graph µs, G=16 Hkv=4 combined/random")
    out = []
    for topk in (2048, 8192):
        for rows in (16, 32, 64, 128, 256):
            shape = (rows, 64, 4, topk)
            try:
                sets = make_sets(*shape, n_sets_for(rows, 4, topk), gib, seed=rows)
                expect = reference_of(sets[0])
                single = {n: timed(design(DESIGNS[n]), sets, expect) for n in ("h1 w4", "h4 w8")}
                clus = {
                    k: timed(design(cluster_cfg((4, 3, 4, 1), k, topk), k), sets, expect)
                    for k in (2, 4, 8)
                }
                ck = best_of(clus)
                split = {k: timed(design(DESIGNS["h1 w4"], k), sets, expect) for k in (2, 4, 8)}
                bk = best_of(split)
                auto = qsa._pick_splits(rows, 4, topk, torch.cuda.current_device())
                out.append(
                    [
                        topk,
                        rows,
                        rows * 4,
                        single["h1 w4"],
                        single["h4 w8"],
                        split.get(bk),
                        bk,
                        clus.get(ck),
                        ck,
                        auto,
                        time_graph(dispatcher, sets),
                        floor_us(sets[0]),
                    ]
                )
                del sets
            except Exception as exc:
                out.append([topk, rows, rows * 4, f"ERR {exc}"[:60]])
    print(
        table(
            [
                "topk",
                "rows",
                "rows*Hkv",
                "single h1",
                "single h4w8",
                "best split",
                "best k",
                "best cluster",
                "cluster k",
                "auto k",
                "dispatch",
                "floor",
            ],
            out,
        )
    )


def bench_issue(gib) -> None:
    print(
        "\n== QSA fp8 sparse paged decode on the H200 (D=128, page 64; our µs = graph replay "
        "of the dispatcher per call, slot pass included)"
    )
    out = []
    for shape, (triton, target) in ISSUE_SHAPES.items():
        rows, hq, hkv, topk = shape
        try:
            sets = make_sets(rows, hq, hkv, topk, n_sets_for(rows, hkv, topk), gib, seed=1)
            check(dispatcher, sets[0], reference_of(sets[0]))
            ours = time_graph(dispatcher, sets, reps=50)
            eager = time_eager(dispatcher, sets)
            floor = floor_us(sets[0])
            print(f"kernels {rows}/{hq}/{hkv}/{topk}: {kernel_breakdown(dispatcher, sets)}")
            out.append(
                [
                    rows,
                    hq,
                    hkv,
                    topk,
                    ours,
                    eager,
                    floor,
                    f"{100 * floor / ours:.0f}%",
                    triton,
                    target,
                    "PASS" if target is None or ours <= target else "MISS",
                ]
            )
            del sets
        except Exception as exc:
            traceback.print_exc()
            out.append([rows, hq, hkv, topk, f"ERR {type(exc).__name__}: {exc}"[:70]])
    print(
        table(
            [
                "rows",
                "Hq",
                "Hkv",
                "topk",
                "our µs",
                "eager µs",
                "floor µs",
                "% of floor",
                "Triton µs (FACTS)",
                "target µs",
                "verdict",
            ],
            out,
        )
    )


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


def ncu_one(gib: float, config) -> None:
    """Exactly one decode launch (rows=512 Hq=64 Hkv=4 topk=2048, combined, random)."""
    args = make_sets(512, 64, 4, 2048, 1, gib, seed=5)[0]
    qsa._run_kernels(*args, num_splits=1, config=config)
    torch.cuda.synchronize()
    print(f"one qsa_decode launch done, config {config or qsa.DECODE_CONFIG[HEAD_DIM]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-designs", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--gib", type=float, default=6.0, help="cache pool size")
    parser.add_argument("--ncu-one", action="store_true", help="one decode launch, then exit")
    parser.add_argument("--ncu-config", default=None, help="W,S,C,H for --ncu-one")
    opts = parser.parse_args()
    if opts.ncu_one:
        cfg = tuple(int(x) for x in opts.ncu_config.split(",")) if opts.ncu_config else None
        ncu_one(opts.gib, cfg)
        return
    print(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"copy {copy_bandwidth():.2f} TB/s (read + write)"
    )
    print(
        f"dispatch: single pass when rows*Hkv >= {qsa.DECODE_MIN_PROGRAMS}; "
        f"configs (warps, stages, min CTAs/SM, heads/CTA) {qsa.DECODE_CONFIG}"
    )
    sections = [
        (not opts.no_designs, bench_designs),
        (not opts.no_designs, bench_span),
        (not opts.no_designs, bench_small),
        (not opts.no_sweep, bench_sweep),
        (True, bench_issue),
    ]
    for enabled, section in sections:
        if enabled:
            try:
                section(opts.gib)
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
