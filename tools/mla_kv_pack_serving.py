"""The serving measure of concat_mla_kv_quant_fp8 (``tools/bench_mla_kv_pack.py``'s default):
µs per call as a serving step sees it, the measure ``auto``'s sm_90 rule is derived from.

Per (tokens, heads) point, four CUDA graphs are captured: ``specialized`` and ``cake``
(each its own planned plan, through the op), ``auto``, and the peer, ``torch.compile`` of
the bit-exact torch path (skipped where it does not compile). Each graph holds ``calls``
back-to-back calls cycling over ``sets`` independent input/output sets; per call = one
replay's CUDA-event time / ``calls``, so each kernel's own time plus the gap between kernels.
Cold inputs, as in a serving step where the layers between two packs stream far more
than L2: the sets cycle until their working set passes 4x L2 (240 MB on the H200's 60 MB),
so a set comes back only after 4x L2 of other traffic. A graph holds at most
``MAX_CALLS`` calls, which caps the cycle of calls under ~240 KB (there the sets in one
replay are all distinct); a read of 4x L2 of other memory before every replay (outside
the timed span) evicts them, so there too every call reads inputs that are not in L2.
The graphs are replayed in interleaved rounds (a clock or thermal drift hits all of them)
and the median round is kept. Every backend and the peer is first checked bit-exact
against the torch path. Byte floor = bytes read + written / 4.24 TB/s.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit import mla_kv_pack as mkp  # noqa: E402
from flashinfer_jit.mla_kv_pack import cake, heuristics  # noqa: E402
from flashinfer_jit.mla_kv_pack.reference import pack_torch  # noqa: E402
from jit_kernels import sm_count  # noqa: E402

CEILING_TBPS = 4.24
H200_L2_BYTES = 60 << 20
MAX_CALLS = 1024  # graph nodes per graph: capture costs ~15 µs of host time per call
TARGET_US = 2000.0  # GPU time of one replay: long enough that the two events' cost vanishes
ROUNDS = 15
MEM_CAP = 32 << 30  # input/output sets of one point, bytes
MAX_POINT_BYTES = 4 << 30  # skip points whose traffic exceeds ~4 GB
NAMES = ("specialized", "cake", "auto")
# The peer: torch.compile of the bit-exact torch path, checked and timed as the backends
# are; skipped where it does not compile. Static shapes, one compile per point: session
# 21's dynamic-shape compile ran 2.3x slower than a static one at the largest rows (2777
# against FACTS.md's 1189-1192 µs), which would flatter us.
PEER = "torch.compile"
PEER_RECOMPILES = 1024  # dynamo's per-function limit (default 8): one compile per point
MEASURE = "per call in a CUDA graph, input sets cycled past 4x L2 (evicted before each replay)"


def point_bytes(tokens: int, heads: int) -> int:
    # kv_nope read (512 B/row), key (192 B) and value (128 B) written, k_pe read once.
    return tokens * heads * (512 + 192 + 128) + tokens * 128


def cold_bytes() -> int:
    """4x L2: the working set past which a set is evicted before it comes back."""
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    return 4 * max(l2, H200_L2_BYTES)


def shape_of(tokens: int, heads: int, cold: int) -> tuple[int, int]:
    """(sets, calls) for one point: sets enough to pass ``cold`` bytes (at least two, so no
    call follows one on its own inputs; within MEM_CAP), calls enough for ~TARGET_US."""
    nbytes = point_bytes(tokens, heads)
    alloc = tokens * heads * 832 + tokens * 1152  # the latent rows hold k_pe
    sets = max(2, -(-cold // nbytes))
    sets = max(1, min(sets, MAX_CALLS, MEM_CAP // alloc))
    est_us = max(1.5, nbytes / (CEILING_TBPS * 1e6))
    calls = min(MAX_CALLS, max(sets, int(TARGET_US / est_us)))
    return sets, calls


def make_sets(tokens: int, heads: int, count: int) -> list[tuple]:
    """``count`` independent sets (kv_nope, k_pe as a view of the latent rows as serving
    passes it, key, value), each a slice of one allocation per tensor."""
    g = torch.Generator(device="cuda").manual_seed(tokens * 1000 + heads)
    kv = torch.randn(count, tokens, heads, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    latent = torch.randn(count, tokens, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    kv.mul_(50), latent.mul_(50)  # past e4m3's 448: the saturating cast is exercised
    key = torch.empty(count, tokens, heads, 192, dtype=torch.float8_e4m3fn, device="cuda")
    value = torch.empty(count, tokens, heads, 128, dtype=torch.float8_e4m3fn, device="cuda")
    return [(kv[i], latent[i, :, 512:], key[i], value[i]) for i in range(count)]


def backend_fn(name: str) -> Callable:
    """One call of the op with ``backend=name``: its own plan, as a caller gets it; PEER:
    the compiled torch path (one compiled function per process)."""
    if name == PEER:
        return _compiled_pack()
    return lambda kv, pe, k, v: mkp.concat_mla_kv_quant_fp8(kv, pe, k, v, backend=name)


@functools.cache
def _compiled_pack() -> Callable:
    import torch._dynamo

    # Past the limit dynamo would run the function eagerly: the column would time torch.
    torch._dynamo.config.recompile_limit = PEER_RECOMPILES
    packed = torch.compile(pack_torch, dynamic=False)
    return lambda kv, pe, k, v: packed(kv, pe, k, v, 128)


def check_exact(fn: Callable, s: tuple, ref: tuple) -> None:
    key, value = s[2], s[3]
    key.view(torch.uint8).fill_(0x5A)
    value.view(torch.uint8).fill_(0x5A)
    fn(*s)
    torch.cuda.synchronize()
    if not (
        torch.equal(key.view(torch.uint8), ref[0].view(torch.uint8))
        and torch.equal(value.view(torch.uint8), ref[1].view(torch.uint8))
    ):
        raise AssertionError("output differs from the torch path")


def capture(fn: Callable, sets: list[tuple], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls cycling over ``sets``, captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*sets[0])  # loads the kernel and fills the op's replay before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()  # the first replay uploads the graph: not timed
    torch.cuda.synchronize()
    return graph


def time_graphs(graphs: dict, calls: int, flush: torch.Tensor) -> dict[str, list[float]]:
    """µs per call of each graph, one sample per round, rounds interleaved."""
    events = []
    torch.cuda._sleep(5_000_000)  # ~2.5 ms: the host queues the first rounds meanwhile
    for _ in range(ROUNDS):
        for name, graph in graphs.items():
            flush.sum()  # reads 4x L2 of other memory: nothing of the sets stays in L2
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            events.append((name, a, b))
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {name: [] for name in graphs}
    for name, a, b in events:
        out[name].append(a.elapsed_time(b) * 1000 / calls)
    return out


# size: one point: sets, the reference, three backends and the peer checked, captured and timed
def run_point(tokens: int, heads: int, flush: torch.Tensor) -> dict:
    nbytes = point_bytes(tokens, heads)
    nsets, calls = shape_of(tokens, heads, flush.numel() * flush.element_size())
    cap = torch.cuda.get_device_capability()
    row: dict = {
        "tokens": tokens,
        "heads": heads,
        "bytes": nbytes,
        "floor_us": nbytes / (CEILING_TBPS * 1e6),
        "sets": nsets,
        "calls": calls,
        "cycle_bytes": min(nsets, calls) * nbytes,
        "plan": {
            "specialized_heads_per_warp": mkp.plan_specialized(tokens, heads),
            "cake_head_group": mkp.plan_cake(tokens, heads, sm_count(torch.cuda.current_device())),
        },
        "auto_pick": mkp.auto_order(tokens, heads, cap)[0],
        "us": {},
        "spread": {},
        "errors": [],
    }
    sets = make_sets(tokens, heads, nsets)
    kv, pe, key, value = sets[0]
    ref = (torch.empty_like(key), torch.empty_like(value))
    pack_torch(kv, pe, ref[0], ref[1], 128)
    graphs = {}
    for name in (*NAMES, PEER):
        try:  # one broken backend (or the peer) must not hide the others
            check_exact(backend_fn(name), sets[0], ref)
            graphs[name] = capture(backend_fn(name), sets, calls)
        except Exception as exc:
            row["errors"].append(f"{name}: {type(exc).__name__}: {exc}"[:300])
            traceback.print_exc()
    if graphs:
        for name, samples in time_graphs(graphs, calls, flush).items():
            row["us"][name] = statistics.median(samples)
            row["spread"][name] = (max(samples) - min(samples)) / row["us"][name]
    del graphs, sets, ref
    torch.cuda.empty_cache()
    return finish(row)


def finish(row: dict) -> dict:
    """The derived columns: the faster backend, auto over it, % of the byte floor."""
    us = row["us"]
    both = [n for n in ("specialized", "cake") if n in us]
    if both:
        row["faster"] = min(both, key=us.get)
        best = us[row["faster"]]
        row["pct_floor"] = 100 * row["floor_us"] / best
        if "auto" in us:
            row["auto_ratio"] = us["auto"] / best
        if row["auto_pick"] in us:  # the pick's own graph: what the rule is checked on
            row["pick_ratio"] = us[row["auto_pick"]] / best
    if "auto" in us and PEER in us:
        row["peer_ratio"] = us["auto"] / us[PEER]
    return row


HEADER = ("tokens", "heads", "floor", "spec (hpw)", "cake (G)", "faster", "auto (pick)",
          "auto/faster", "pick/faster", "% floor", PEER, "auto/peer", "sets x calls",
          "cycle MB", "spread", "errors")  # fmt: skip


def cells(row: dict) -> list[str]:
    us, plan, nan = row["us"], row["plan"], float("nan")
    flag = " !" if row.get("pick_ratio", 1.0) > 1.03 else ""  # over the 3 % the rule allows
    return [
        str(row["tokens"]),
        str(row["heads"]),
        f"{row['floor_us']:.2f}",
        f"{us.get('specialized', nan):.2f} ({plan['specialized_heads_per_warp']})",
        f"{us.get('cake', nan):.2f} ({plan['cake_head_group']})",
        row.get("faster", "-"),
        f"{us.get('auto', nan):.2f} ({row['auto_pick'][:4]})",
        f"{row.get('auto_ratio', nan):.3f}",
        f"{row.get('pick_ratio', nan):.3f}{flag}",
        f"{row.get('pct_floor', nan):.0f}%",
        f"{us.get(PEER, nan):.2f}",
        f"{row.get('peer_ratio', nan):.3f}",
        f"{row['sets']} x {row['calls']}",
        f"{row['cycle_bytes'] / 1e6:.0f}",
        f"{100 * max(row['spread'].values(), default=nan):.1f}%",
        "; ".join(row["errors"])[:50] or "ok",
    ]


def print_table(rows: list[dict]) -> None:
    table = [list(HEADER)] + [cells(r) for r in rows]
    widths = [max(len(c[i]) for c in table) for i in range(len(HEADER))]
    print(f"\nµs per call, {MEASURE}; median of {ROUNDS} interleaved rounds;")
    print("spec/cake: each backend's planned plan (hpw: heads per warp, G: head group);")
    print("pick/faster: auto's pick timed in its backend's graph ('!': over 3 %);")
    print(f"% floor: of the faster backend; {PEER}: the peer, auto/peer: ours over it;")
    print("spread: the widest (max - min) / median of the graphs.")
    for i, c in enumerate(table):
        print(" | ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def cake_programs() -> dict[int, str]:
    """Head group -> "ok" or why its program cannot load: without the DSL they come from
    the bundle named by FLASHINFER_JIT_CUBIN_PATH, and a missing one makes every point
    that plans it a cake error (said once here, before the sweep)."""
    out = {}
    for group in cake.HEAD_GROUPS:
        try:
            cake.family.get((group,), torch.cuda.current_device())
            out[group] = "ok"
        except Exception as exc:  # KernelUnavailable, a corrupt entry: report, go on
            out[group] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def sweep(tokens: list[int], heads: list[int], json_path: str | None) -> list[dict]:
    """Every point (heads outer), one progress line each; the JSON is rewritten after every
    point, so a run stopped at its time limit still leaves what it measured."""
    cold = cold_bytes()
    flush = torch.zeros(cold // 4, dtype=torch.float32, device="cuda")
    header = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "measure": MEASURE,
        "l2_bytes": cold // 4,
        "rounds": ROUNDS,
        "sm90_specialized": heuristics.SM90_SPECIALIZED_MAX_TOKENS,
        "cake_programs": cake_programs(),
    }
    print(f"device: {header['device']}  torch {header['torch']}  cycle/evict {cold >> 20} MiB")
    print(f"cake programs (head group: status): {header['cake_programs']}", flush=True)
    rows: list[dict] = []
    for h in heads:
        for t in tokens:
            if point_bytes(t, h) > MAX_POINT_BYTES:
                print(f"skip {t}x{h}: over {MAX_POINT_BYTES >> 30} GB", flush=True)
                continue
            rows.append(run_point(t, h, flush))
            print(" | ".join(cells(rows[-1])), flush=True)
            if json_path:
                Path(json_path).write_text(json.dumps({**header, "rows": rows}, indent=1))
    print_table(rows)
    return rows
