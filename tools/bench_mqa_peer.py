"""fp8_paged_mqa_logits against DeepGEMM's sm90 kernel, timed the same way in one process.

    python tools/bench_mqa_peer.py [--deepgemm DIR] [--rows a,b] [--sweep] [--probes] [--reps N]
        [--no-clean-each] [--graph-calls N] [--protocol P]

Per row: independent input sets (own KV pool, tables, lengths, q, weights) until the
working set passes 240 MB (4x the H200's L2), at most 8, since a serving step reads a
different layer's cache in every call. Both sides are checked against a float64 reference
on a few requests, then timed by one helper (bench_util.per_call_in_graphs): per side, one
call per set (--graph-calls: at least N, cycling the sets) captured in one CUDA graph, each
call after a clean read of twice the L2 whose own time (a graph of reads alone) is taken
off (--no-clean-each: the calls back to back), the sides' replays alternating rep by rep
(--protocol), median replay / calls; rows with B <= 32 also eager (one call between two
events, cycling the sets). Why the clean read: between two layers' indexer calls a serving
step runs the layer's other kernels, so a call starts with an L2 of other data, and a call
back to back with itself inherits its dirty logits instead; a call is charged the write-back
of its own logits (the read after it evicts them). Session 26 measured both (MQA round 26).
DeepGEMM (imported from --deepgemm when given, else from the path; its column is skipped
when it cannot be imported) gets
`fp8_fp4_paged_mqa_logits((q, None), kv, w, context_lens_2d, block_table, schedule,
max_len, False, float32)` with the schedule computed once per set outside the timing, as a
serving step reuses it across layers; ours `fp8_paged_mqa_logits` with schedule_meta=None.
The 2-D context lens give row t of a request its position limit len - next_n + t, the
same rows the 1-D lens give ours. "ours_dg_api": our kernels through
flashinfer_jit.deep_gemm, called as DeepGEMM is (its speed must equal the native entry's). Byte floor: the pool bytes the visible tokens occupy
(values, scales) plus the logits written, over 4.24 TB/s. --sweep also times forced TMA
configs (SWEEPS). --probes also times the dispatcher's config as the TMA kernel's timing
probes (tools/mqa_logits_probe.py: 1 stream only, 2 stream + MMA, 3 stream + epilogue; they
write no valid logits, so they are not checked). The table prints last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_util import PROTOCOLS, eager, per_call_in_graphs, warm_gpu  # noqa: E402
from mqa_logits_probe import probe_options, variant  # noqa: E402
from mqa_peer_rows import AB, EXTRA_ROWS, ROWS, SWEEPS, VARIANT_CONFIGS, VARIANT_ROWS, VARIANTS, Row  # noqa: E402

import flashinfer_jit.mqa_logits as mq  # noqa: E402
from flashinfer_jit.mqa_logits import MqaLogitsOptions  # noqa: E402
from flashinfer_jit.mqa_logits import plan as mq_plan  # noqa: E402
from flashinfer_jit.mqa_logits.tma import TmaConfig, tma_config  # noqa: E402

BW = 4.24e12  # measured device-to-device copy bandwidth, bytes/s
SET_BYTES = 240e6  # 4x the 60 MiB L2


def deepgemm_supports(row: Row) -> bool:
    """What DeepGEMM's sm90 paged kernel takes: H 32/64, next_n 1/2, block 64, D 32/64/128
    (its operands' swizzle is the row's width)."""
    return (
        row.heads in (32, 64)
        and row.next_n in (1, 2)
        and row.block == 64
        and row.dim in (32, 64, 128)
    )


def make_set(row: Row, gen: torch.Generator) -> dict:
    b, length = row.batch, row.length
    lens = torch.randint(int(0.7 * length), length + 1, (b,), generator=gen, dtype=torch.int32)
    if row.long:
        lens[int(torch.randint(0, b, (1,), generator=gen))] = row.long
    max_len = int(lens.max())
    need = (lens + row.block - 1) // row.block
    num_blocks = int(need.sum())
    width = mq.min_block_table_width(max_len, row.block)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(b, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need.tolist()):
        table[i, :n] = perm[start : start + n]
        start += n
    d, blk = row.dim, row.block
    kv = torch.empty(num_blocks, blk * (d + 4), dtype=torch.uint8, device="cuda")
    kv[:, : blk * d] = (
        torch.randn(num_blocks, blk * d, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
    )
    kv[:, blk * d :] = (torch.rand(num_blocks, blk, device="cuda") + 0.5).view(torch.uint8)
    q = torch.randn(b, row.next_n, row.heads, d, device="cuda").to(torch.float8_e4m3fn)
    lens = lens.cuda()
    offs = torch.arange(row.next_n, device="cuda", dtype=torch.int32) - row.next_n + 1
    return {
        "q": q,
        "kv": kv.view(num_blocks, blk, 1, d + 4),
        "w": torch.randn(b * row.next_n, row.heads, device="cuda"),
        "table": table.cuda(),
        "lens": lens,
        "lens2d": (lens[:, None] + offs).clamp_min(0).contiguous(),
        "max_len": max_len,
    }


def check(logits: torch.Tensor, s: dict, row: Row, requests: int = 3) -> None:
    """float64 reference on a few requests, gathered independently of the op's code."""
    pool = s["kv"].view(s["kv"].shape[0], -1)
    d, blk = row.dim, row.block
    for b in torch.linspace(0, row.batch - 1, min(row.batch, requests)).long().tolist():
        n = int(s["lens"][b])
        pos = torch.arange(n, device="cuda")
        blocks = s["table"][b, pos // blk].long()[:, None]
        off = (pos % blk)[:, None]
        k = pool[blocks, off * d + torch.arange(d, device="cuda")].view(torch.float8_e4m3fn)
        sc = pool[blocks, blk * d + off * 4 + torch.arange(4, device="cuda")]
        sc = sc.contiguous().view(torch.float32)[:, 0].double()
        for t in range(row.next_n):
            valid = n - row.next_n + t + 1
            qt, wt = s["q"][b, t].double(), s["w"][b * row.next_n + t].double()
            kk = k[:valid].double()
            ref = ((qt @ kk.T).clamp_min(0) * wt[:, None]).sum(0) * sc[:valid]
            mag = ((qt.abs() @ kk.abs().T) * wt.abs()[:, None]).sum(0) * sc[:valid]
            err = (logits[b * row.next_n + t, :valid].double() - ref).abs()
            if not bool((err <= 2e-3 * mag + 1e-6).all()):
                raise AssertionError(f"request {b} slot {t}: max error {float(err.max())}")


def ncu_calls(rows: list[Row], dg) -> None:
    """Two calls of each side per row on one input set, nothing timed: for Nsight Compute
    (--kernel-name regex:'paged_mqa_logits_tma|sm90_fp8_paged_mqa_logits')."""
    gen = torch.Generator().manual_seed(0)
    for row in rows:
        s = make_set(row, gen)
        sides = [ours(s)] + ([theirs(dg, s)] if dg is not None and deepgemm_supports(row) else [])
        for call in sides:
            call()
            call()
        torch.cuda.synchronize()


def ours(
    s: dict,
    config: TmaConfig | None = None,
    options: MqaLogitsOptions | None = None,
    schedule: torch.Tensor | None = None,
) -> Callable[[], torch.Tensor]:
    """Our call on set s; ``config`` forces a TMA config, ``options`` replaces it
    (MqaLogitsOptions: each variant has its own plans and replays); ``schedule``: a
    schedule_meta computed beforehand (None: the kernel derives it, as the issue times)."""
    # out=None: each call allocates its logits, as DeepGEMM's does (an eager call pays it;
    # until session 26 ours was given its buffer)
    if config is None and options is None:  # the public entry point, as a user calls it
        args = (s["q"], s["kv"], s["w"], s["table"], s["lens"], s["max_len"])
        return lambda: mq.fp8_paged_mqa_logits(*args, schedule_meta=schedule)
    run = mq.OP.runner(options or MqaLogitsOptions(config=config)).run
    f32 = torch.float32
    args = (s["q"], s["kv"], s["w"], s["table"], s["lens"], s["max_len"], f32, f32, f32)
    args += (schedule, None, False)  # bf16_out: the seed's entry point
    return lambda: run(args)


def dispatcher_config(row: Row, s: dict) -> TmaConfig:
    """The TMA config the dispatcher picks for this row's call on set s."""
    small = mq_plan.small_work(
        row.batch, s["max_len"], torch.cuda.get_device_properties(0).multi_processor_count
    )
    return tma_config(row.next_n * row.heads, small, row.dim, row.next_n)


def theirs(dg, s: dict) -> Callable[[], torch.Tensor]:
    sched = dg.get_paged_mqa_logits_metadata(s["lens2d"], s["kv"].shape[1], dg.get_num_sms())
    args = ((s["q"], None), s["kv"], s["w"], s["lens2d"], s["table"], sched, s["max_len"])
    return lambda: dg.fp8_fp4_paged_mqa_logits(*args, False, torch.float32)


def ours_dg_api(s: dict) -> Callable[[], torch.Tensor]:
    """Our kernels through flashinfer_jit.deep_gemm, called exactly as DeepGEMM is."""
    from flashinfer_jit import deep_gemm as fij_dg

    sched = fij_dg.get_paged_mqa_logits_metadata(
        s["lens2d"], s["kv"].shape[1], fij_dg.get_num_sms()
    )
    args = ((s["q"], None), s["kv"], s["w"], s["lens2d"], s["table"], sched, s["max_len"])
    return lambda: fij_dg.fp8_fp4_paged_mqa_logits(*args, False, torch.float32)


def candidate_sides(row: Row, variants: bool, probes: bool) -> dict:
    """The row's template variants (--variants) and timing probes (--probes), by name: each a
    function of an input set returning its call."""
    sides: dict = {}
    for name, patches in VARIANTS.items() if variants and row.name in VARIANT_ROWS else ():
        family = variant(name, patches)
        sides[name] = lambda s, f=family: ours(
            s, options=MqaLogitsOptions(config=dispatcher_config(row, s), tma_family=f)
        )
        if row.name in VARIANT_CONFIGS:
            sides[f"{name}-q1"] = lambda s, f=family: ours(
                s, options=MqaLogitsOptions(config=VARIANT_CONFIGS[row.name], tma_family=f)
            )
    # the probes patch the plain loop: they run the dispatcher's config with it ("plain",
    # timed beside them where the dispatcher takes the lean one)
    if probes and row.head_dim_fits_tma():
        sides.setdefault(
            "plain", lambda s: ours(s, dispatcher_config(row, s)._replace(lean=0, pair=0))
        )
    for n in (1, 2, 3) if probes and row.head_dim_fits_tma() else ():
        sides[f"probe{n}"] = lambda s, n=n: ours(
            s, options=probe_options(dispatcher_config(row, s)._replace(lean=0, pair=0), n)
        )
    return sides


def input_sets(row: Row, gen: torch.Generator) -> tuple[list[dict], float]:
    """The row's independent input sets (past SET_BYTES, 2 to 8) and its byte floor (us)."""
    # (the skewed rows' one long request replaces a short one: counting it per request put
    # the skewed B=32 row's two sets, 46 MB, inside the L2 until session 25)
    tokens_per_set = (row.batch - (1 if row.long else 0)) * 0.85 * row.length + row.long
    per_set = tokens_per_set * (row.dim + 4)
    sets = [make_set(row, gen) for _ in range(int(min(8, max(2, -(-SET_BYTES // per_set)))))]
    tokens = statistics.mean(float(s["lens"].sum()) for s in sets)
    return sets, tokens * (row.dim + 4 + 4 * row.next_n) / BW * 1e6


def row_sides(row: Row, dg, first: dict, args: argparse.Namespace) -> dict:
    """What a row times, by name: each a function of an input set returning its call."""
    sides = {"ours": lambda s: ours(s)}
    if deepgemm_supports(row):
        sides["ours_dg_api"] = ours_dg_api
    # our entry point with its schedule computed once outside the timing, as DeepGEMM's
    # metadata is: what the kernel's own derivation of it costs
    sides["sched"] = lambda s: ours(s, schedule=mq.compute_paged_mqa_logits_schedule(s["lens"]))
    if dg is not None and deepgemm_supports(row):
        sides["deepgemm"] = lambda s: theirs(dg, s)
    if args.sweep and row.head_dim_fits_tma():
        # the dispatcher's config with the other consumer loop (sm90_tma_wgmma.cuh, LEAN)
        def flipped(s: dict) -> Callable[[], torch.Tensor]:
            config = dispatcher_config(row, s)
            return ours(s, config._replace(lean=1 - config.lean, pair=0))

        sides["plain" if dispatcher_config(row, first).lean else "lean"] = flipped
    for name, options in AB if args.ab else []:
        sides[name] = lambda s, o=options: ours(s, options=o)
    for name, options in SWEEPS.get(row.name, []) if args.sweep else []:
        sides[name] = lambda s, o=options: ours(s, options=o)
    for name, make in candidate_sides(row, args.variants, args.probes).items():
        sides.setdefault(name, make)  # (a sweep's "plain" is the probes' too)
    return sides


def run_row(row: Row, dg, args: argparse.Namespace, gen: torch.Generator) -> dict:
    sets, floor = input_sets(row, gen)
    res = {"floor": floor, "sets": len(sets), "served": ""}
    checked = {}
    for name, make in row_sides(row, dg, sets[0], args).items():
        try:
            calls = [make(sets[i % len(sets)]) for i in range(max(len(sets), args.graph_calls))]
            if name == "ours":
                mq_plan._plans.clear()
            if not name.startswith("probe"):  # probes write no valid logits
                check(calls[0](), sets[0], row)
            if name == "ours":
                res["served"] = " ".join(p.kernel.name[-60:] for p in mq_plan._plans.values())
            checked[name] = calls
        except Exception as exc:  # report and keep going
            print(f"  {row.name} {name} failed: {exc!r}", flush=True)
            traceback.print_exc(limit=3)
    res.update(per_call_in_graphs(checked, args.reps, args.protocol, args.clean_each))
    # ("no-pdl" too: whether the programmatic launch costs an eager call on an idle GPU)
    mine = ("ours", "ours_dg_api", "deepgemm", "no-pdl")
    small = row.batch <= 32
    res.update(eager({n: c for n, c in checked.items() if n in mine and small}, args.reps))
    return res


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(table: list[tuple[Row, dict]]) -> None:
    print("\nper call in a CUDA graph (us); eager for B <= 32; inputs cycled past 4x L2")
    print(
        "| row | B | next_n | H | D | block | L | floor | DeepGEMM | ours | ours/DG | % floor | eager DG | eager ours | others |"
    )
    print("|" + " --- |" * 15)
    for row, r in table:
        o, d = r.get("ours"), r.get("deepgemm")
        ratio = f"{o / d:.2f}" if o and d else "-"
        pct = f"{100 * r['floor'] / o:.0f}%" if o else "-"
        skip = ("ours", "deepgemm", "floor", "sets", "served", "ours_eager", "deepgemm_eager")
        extra = ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k not in skip)
        length = f"{row.length}" + (f"+1x{row.long}" if row.long else "")
        print(
            f"| {row.name} | {row.batch} | {row.next_n} | {row.heads} | {row.dim} | {row.block} | {length} "
            f"| {fmt(r['floor'])} | {fmt(d)} | {fmt(o)} | {ratio} | {pct} | {fmt(r.get('deepgemm_eager'))} "
            f"| {fmt(r.get('ours_eager'))} | {extra} |"
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepgemm", help="folder holding DeepGEMM's built deep_gemm package")
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--sweep", action="store_true", help="also time SWEEPS' forced configs")
    parser.add_argument("--probes", action="store_true", help="also time the timing probes")
    parser.add_argument("--variants", action="store_true", help="also time VARIANTS")
    parser.add_argument("--ab", action="store_true", help="also time AB's options, every row")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="alt",
        help="graph timing: alt (sides alternating after a clean L2 read), seq (runs 1-15's), "
        "seq-busy (seq with the GPU busy at each start event), seq-clean (seq after the read)",
    )
    parser.add_argument(
        "--graph-calls",
        type=int,
        default=0,
        help="calls a side's graph holds, cycling the sets (default: one per set)",
    )
    parser.add_argument(
        "--clean-each",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a clean L2 read before every call in the graphs, its time taken off (as a "
        "serving step's other kernels leave the L2 between two layers' calls; session 26's "
        "table); --no-clean-each: the calls back to back",
    )
    parser.add_argument("--ncu", action="store_true", help="two untimed calls a side (ncu)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.deepgemm:
        sys.path.insert(0, args.deepgemm)
    try:
        import deep_gemm as dg
    except Exception as exc:  # the peer's column is skipped
        print(f"DeepGEMM not importable ({exc!r}): its column is skipped")
        dg = None
    named = args.rows.split(",") if args.rows else []
    rows = [r for r in ROWS if not named or r.name in named] + [
        r for r in EXTRA_ROWS if r.name in named
    ]
    if args.ncu:
        ncu_calls(rows, dg)
        return
    warm_gpu()
    gen = torch.Generator().manual_seed(0)
    table = []
    for row in rows:
        try:
            res = run_row(row, dg, args, gen)
        except Exception:  # one row's failure must not lose the other rows' figures
            traceback.print_exc()
            continue
        table.append((row, res))
        print(
            row.name,
            {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()},
            flush=True,
        )
        torch.cuda.empty_cache()
    print_table(table)


if __name__ == "__main__":
    main()
