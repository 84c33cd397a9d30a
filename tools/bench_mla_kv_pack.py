"""Benchmark concat_mla_kv_quant_fp8: both fused backends, auto, their plans, torch.

    python tools/bench_mla_kv_pack.py [--tokens 1,16,...] [--heads 1,12,...] [--json FILE]
    python tools/bench_mla_kv_pack.py --variants [--tokens ...] [--heads ...] [--json FILE]
    python tools/bench_mla_kv_pack.py --write-tuned RESULTS  # no GPU: --variants' JSON

Default: the serving measure (tools/mla_kv_pack_serving.py): per call in a CUDA graph,
input sets cycled past 4x L2, specialized and cake (each its planned plan) and auto at
every point, then the sm_90 rule derived from it (tools/mla_kv_pack_rule.py). ``auto``'s
sm_90 rule comes from this measure.

``--variants``: every plan variant of both backends (specialized with several
heads-per-warp splits, cake with every head group; the planned one marked '*'), each
checked bit-exact against the torch path, then timed with one CUDA-event pair around each
call, median of many calls, inputs rotating over enough sets to exceed L2 where memory
allows. A long sleep kernel is queued before each batch of calls so the host's launch cost
stays hidden behind the GPU; for a tiny kernel the time still counts the event and launch
latency on the GPU (~2 µs on the H200). The tuned plan tables (``--write-tuned``) come from
these. Host overhead (µs per call, tiny inputs, many calls back to back, wall clock): the
op with outputs given (its fast path), the bare engine launch of the same kernel, and an
empty torch op (``Tensor.add_(0)`` on a 1-element tensor) for scale.
Byte floor = bytes read + written / 4.24 TB/s.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tool modules

from mla_kv_pack_serving import CEILING_TBPS, MAX_POINT_BYTES, point_bytes  # noqa: E402

from flashinfer_jit import mla_kv_pack as mkp  # noqa: E402
from flashinfer_jit.mla_kv_pack import MlaKvPackOptions, cake, heuristics  # noqa: E402
from flashinfer_jit.mla_kv_pack.op import BACKENDS  # noqa: E402
from flashinfer_jit.mla_kv_pack.reference import pack_torch  # noqa: E402
from jit_kernels import sm_count  # noqa: E402

L2_BYTES = 60 << 20
KERNEL_REPS, TORCH_REPS = 60, 8
# The serving sweep's grid (issue 19 item 14): both ends and 64x128, 1x16, 16384x16.
SWEEP_TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,4096,16384,65536,131072"
SWEEP_HEADS = "1,2,4,8,12,16,32,64,128"
VARIANT_TOKENS, VARIANT_HEADS = "1,16,64,1024,16384,131072", "1,12,16,128"


def make_sets(tokens: int, heads: int, count: int):
    sets = []
    for i in range(count):
        g = torch.Generator(device="cuda").manual_seed(i)
        kv = (torch.randn(tokens, heads, 256, device="cuda", generator=g) * 50).to(torch.bfloat16)
        latent = (torch.randn(tokens, 576, device="cuda", generator=g) * 50).to(torch.bfloat16)
        key = torch.empty(tokens, heads, 192, dtype=torch.float8_e4m3fn, device="cuda")
        value = torch.empty(tokens, heads, 128, dtype=torch.float8_e4m3fn, device="cuda")
        sets.append((kv, latent[:, 512:], key, value))  # k_pe as serving passes it
    return sets


def time_calls(fn, sets, reps: int) -> float:
    """Median µs of ``fn(*set)`` over ``reps`` calls, one CUDA-event pair per call."""
    for s in sets[:2]:
        fn(*s)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(10):
        fn(*sets[i % len(sets)])
    host_us = (time.perf_counter() - start) / 10 * 1e6
    torch.cuda.synchronize()
    times: list[float] = []
    batch = 20
    while len(times) < reps:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(batch)
        ]
        # ~2 GHz: queue enough sleep that the host enqueues the whole batch meanwhile.
        torch.cuda._sleep(int(batch * (host_us + 10) * 2000 * 1.5))
        for i, (a, b) in enumerate(events):
            s = sets[(len(times) + i) % len(sets)]
            a.record()
            fn(*s)
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) * 1000 for a, b in events]
    return statistics.median(times)


def host_overhead(tokens: int = 1, heads: int = 16, calls: int = 3000) -> dict[str, float]:
    """Wall-clock µs per call on the host, ``calls`` back to back, tiny inputs."""
    kv, pe, key, value = make_sets(tokens, heads, 1)[0]
    first = mkp.auto_order(tokens, heads, torch.cuda.get_device_capability())[0]
    plan = BACKENDS[first][1](kv, pe, MlaKvPackOptions())
    # The bare launch: the same kernel and arguments (recorded from one run), precomputed.
    kernel, recorded = plan.kernel, []
    plan.kernel = type("Recorder", (), {"launch": lambda self, *a: recorded.append(a[3])})()
    plan.run(kv, pe, key, value)
    plan.kernel, args = kernel, recorded[0]
    stream = torch.cuda.current_stream().cuda_stream
    one = torch.zeros(1, device="cuda")
    cases = {
        "op (outputs given)": lambda: mkp.concat_mla_kv_quant_fp8(kv, pe, key, value),
        "op (outputs allocated)": lambda: mkp.concat_mla_kv_quant_fp8(kv, pe),
        "bare engine launch": lambda: plan.kernel.launch(plan.grid, plan.block, stream, args),
        "empty torch op (add_)": lambda: one.add_(0),
    }
    out = {}
    for name, fn in cases.items():
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return out


def forced(backend: str, **plan) -> Callable:
    """A launch of ``backend`` with a forced plan (MlaKvPackOptions), through the op."""
    runner = mkp.OP.runner(MlaKvPackOptions(**plan))
    return lambda kv, pe, k, v: runner((kv, pe, k, v, 128, backend))


def variants(tokens: int, heads: int) -> dict[str, tuple]:
    """name -> (launch fn, backend, param, planned?)."""
    out = {}
    planned = mkp.plan_specialized(tokens, heads)
    for hpw in sorted({planned, 1, 2, 4, 8, 16} & set(range(1, heads + 1))):
        out[f"spec/hpw={hpw}"] = (
            forced("specialized", heads_per_warp=hpw),
            "specialized",
            hpw,
            hpw == planned,
        )
    group = mkp.plan_cake(tokens, heads, sm_count(torch.cuda.current_device()))
    for g in cake.HEAD_GROUPS:
        out[f"cake/G={g}"] = (
            forced("cake", head_group=g),
            "cake",
            g,
            g == group,
        )
    return out


def run_point(tokens: int, heads: int) -> dict:
    nbytes = point_bytes(tokens, heads)
    count = max(1, min(32, -(-2 * L2_BYTES // nbytes)))
    sets = make_sets(tokens, heads, count)
    kv, pe, key, value = sets[0]
    ref_key = torch.empty_like(key)
    ref_value = torch.empty_like(value)
    pack_torch(kv, pe, ref_key, ref_value, 128)
    row = {
        "tokens": tokens,
        "heads": heads,
        "bytes": nbytes,
        "floor_us": nbytes / (CEILING_TBPS * 1e6),
        "variants": {},
        "errors": [],
    }
    for name, (fn, backend, param, planned) in variants(tokens, heads).items():
        try:
            key.view(torch.uint8).fill_(0x5A)
            value.view(torch.uint8).fill_(0x5A)
            fn(kv, pe, key, value)
            torch.cuda.synchronize()
            if not (
                torch.equal(key.view(torch.uint8), ref_key.view(torch.uint8))
                and torch.equal(value.view(torch.uint8), ref_value.view(torch.uint8))
            ):
                raise AssertionError("output differs from the torch path")
            us = time_calls(fn, sets, KERNEL_REPS)
            row["variants"][name] = {
                "backend": backend,
                "param": param,
                "planned": planned,
                "us": us,
            }
        except Exception as exc:  # one broken variant must not hide the others
            row["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
    try:
        auto = lambda kv, pe, k, v: mkp.concat_mla_kv_quant_fp8(kv, pe, k, v, backend="auto")  # noqa: E731
        row["auto_pick"] = mkp.auto_order(tokens, heads, torch.cuda.get_device_capability())[0]
        row["auto_us"] = time_calls(auto, sets, KERNEL_REPS)
        torch_fn = lambda kv, pe, k, v: pack_torch(kv, pe, k, v, 128)  # noqa: E731
        row["torch_us"] = time_calls(torch_fn, sets[:2], TORCH_REPS)
    except Exception as exc:
        row["errors"].append(f"auto/torch: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    del sets
    torch.cuda.empty_cache()
    return row


def summarize(row: dict) -> list[str]:
    def pick(backend: str, planned_only: bool):
        vs = [
            (v["us"], n)
            for n, v in row["variants"].items()
            if v["backend"] == backend and (v["planned"] or not planned_only)
        ]
        return min(vs) if vs else (float("nan"), "-")

    spec, spec_best = pick("specialized", True), pick("specialized", False)
    cake_, cake_best = pick("cake", True), pick("cake", False)
    best = min(spec[0], cake_[0])
    auto = row.get("auto_us", float("nan"))
    floor = row["floor_us"]
    return [
        str(row["tokens"]),
        str(row["heads"]),
        f"{floor:.2f}",
        f"{spec[0]:.2f}",
        f"{spec_best[0]:.2f} ({spec_best[1].split('/')[1]})",
        f"{cake_[0]:.2f}",
        f"{cake_best[0]:.2f} ({cake_best[1].split('/')[1]})",
        f"{100 * floor / best:.0f}%",
        f"{row.get('torch_us', float('nan')):.1f}",
        row.get("auto_pick", "-"),
        f"{auto:.2f}",
        f"{100 * (auto / best - 1):+.1f}%",
        "; ".join(row["errors"])[:60] or "ok",
    ]


def write_tuned(results: Path) -> int:
    from flashinfer_jit.mla_kv_pack.tuning import Tuned, block_from_measurements

    data = json.loads(results.read_text())
    block = block_from_measurements(data["rows"], data["device"])
    Tuned(block, cake.HEAD_GROUPS)  # validates
    path = mkp.WORKLOADS
    workloads = json.loads(path.read_text())
    workloads["tuned"] = block
    text = json.dumps(workloads, indent=2)
    # One line per list of scalars keeps the tables readable: a row per head count.
    text = re.sub(
        r"\[\s+([^\[\]{}]*?)\s+\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    path.write_text(text + "\n")
    print(
        f"wrote the tuned block ({len(block['heads'])} x {len(block['tokens'])} points) to {path}"
    )
    return 0


HEADER = [
    "tokens",
    "heads",
    "floor us",
    "spec us",
    "spec best (hpw)",
    "cake us",
    "cake best (G)",
    "% floor",
    "torch us",
    "auto",
    "auto us",
    "auto vs best",
    "errors",
]


def variant_sweep(tokens: list[int], heads: list[int], json_path: str | None) -> None:
    """``--variants``: every plan variant timed with one event pair per call, host overhead."""
    device = torch.cuda.get_device_name()
    print(f"device: {device}  torch {torch.__version__}", flush=True)
    rows = []
    for h in heads:
        for t in tokens:
            if point_bytes(t, h) > MAX_POINT_BYTES:
                print(f"skip {t}x{h}: over {MAX_POINT_BYTES >> 30} GB", flush=True)
                continue
            rows.append(run_point(t, h))
            detail = ", ".join(
                f"{n} {v['us']:.2f}{'*' if v['planned'] else ''}"
                for n, v in rows[-1]["variants"].items()
            )
            print(f"{t}x{h}: {detail}", flush=True)
    host = {}
    try:
        host = host_overhead()
    except Exception:  # the kernel table must still print
        traceback.print_exc()
    if json_path:
        Path(json_path).write_text(
            json.dumps({"device": device, "rows": rows, "host_us": host}, indent=1)
        )
    cells = [HEADER] + [summarize(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADER))]
    print("\nhost overhead, µs per call (1 token x 16 heads, back to back, wall clock):")
    for name, us in host.items():
        print(f"  {name:24s} {us:7.2f}")
    print("\n(us: one event pair per call; spec/cake us: the planned variant; best: the fastest")
    print(" variant tried; % floor: of the faster planned backend)")
    for i, c in enumerate(cells):
        print(" | ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))


def serving_sweep(tokens: list[int], heads: list[int], json_path: str | None) -> None:
    """The default: the serving measure at every point, then the sm_90 rule it implies."""
    import mla_kv_pack_rule as rule
    import mla_kv_pack_serving as serving

    rows = serving.sweep(tokens, heads, json_path)
    points = [
        rule.Point(r["tokens"], r["heads"], r["us"]["specialized"], r["us"]["cake"])
        for r in rows
        if "specialized" in r["us"] and "cake" in r["us"]
    ]
    if torch.cuda.get_device_capability() != (9, 0) or not points:
        return  # the rule is sm_90's
    now = rule.violations(
        points, lambda t, h: rule.pick(heuristics.SM90_SPECIALIZED_MAX_TOKENS, t, h)
    )
    print(f"\nheuristics.SM90_SPECIALIZED_MAX_TOKENS: {len(now)} of {len(points)} points over 3 %")
    for line in now:
        print(f"  {line}")
    try:
        derived = rule.derive(points)
    except ValueError as exc:
        print(f"no rule: {exc}")
        return
    print("\nderived (python tools/mla_kv_pack_rule.py RESULTS.json prints the same):\n")
    print(rule.render(derived, points, {"device": torch.cuda.get_device_name()}))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", help=f"default: {SWEEP_TOKENS} ({VARIANT_TOKENS} --variants)")
    parser.add_argument("--heads", help=f"default: {SWEEP_HEADS} ({VARIANT_HEADS} --variants)")
    parser.add_argument("--json", help="also write every measurement here")
    parser.add_argument("--variants", action="store_true", help="every plan variant (see above)")
    parser.add_argument(
        "--write-tuned",
        metavar="RESULTS",
        help="no GPU needed: turn a --variants --json file into the workloads JSON's tuned block",
    )
    args = parser.parse_args()
    if args.write_tuned:
        return write_tuned(Path(args.write_tuned))
    grid = (VARIANT_TOKENS, VARIANT_HEADS) if args.variants else (SWEEP_TOKENS, SWEEP_HEADS)
    tokens = [int(t) for t in (args.tokens or grid[0]).split(",")]
    heads = [int(h) for h in (args.heads or grid[1]).split(",")]
    sweep = variant_sweep if args.variants else serving_sweep
    sweep(tokens, heads, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
