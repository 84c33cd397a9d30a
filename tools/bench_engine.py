"""Engine latency of every op on a GPU (issue 21, items 3-5): first calls and hot host cost.

    python tools/bench_engine.py [--json FILE] [--calls 3000]   # on the GPU machine
    python tools/bench_engine.py --peers DG_DIR ...             # the peers' first calls too
    python tools/bench_engine.py --dry-run                      # anywhere: what it measures

First calls, per op (the rows of FIRST_CALLS), each in a new process with
FLASHINFER_JIT_STRICT=1 (a fallback raises, so the kernels are what is timed) and no
prebuilt bundle: "cold" with an empty cache (render + NVRTC + store + load, and the
compiled launcher's build), then "warm" with the cache the cold run left (disk lookup +
load). The figure is the call and a synchronize, in ms; importing the package is timed
apart ("import ms"). The kernels a cold call compiled are read back from the cache's
records (count, and the NVRTC seconds of each, summed). With --peers, each peer's first
call (tools/engine_rows.py's PEER_ROWS) is timed the same way, its own compile cache empty
and then warm: what a cold first call of ours is read against; and each peer's hot call
(PEER_HOT_ROWS) alternates with ours, read against the same empty op.

Hot host cost, every row of tools/engine_rows.py in one process, the rows alternating
round by round: each call on an idle GPU (synchronized before it); "host us" the median
wall time of the Python call, "eager us" the median CUDA-event time around it (as
tools/profile_host.py), "x empty" the host time over the empty torch op's (the bar: 1.2).
Prints one table last; --json writes every figure.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))  # engine_rows, bench_util
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from bench_util import warm_gpu  # noqa: E402
from engine_rows import (  # noqa: E402
    EMPTY_ALLOC_OP,
    EMPTY_OP,
    PEER_HOT_ROWS,
    PEER_ROWS,
    ROWS,
    calls,
)

# The row whose first call stands for each op's (QSA: one row per set of kernels compiled).
FIRST_CALLS = (
    "concat 1x16 out=None",
    "mqa B=1 L=8192 out=None",
    "qsa attention rows=4 (cluster)",
    "qsa decode rows=4 (slots+1 pass)",
)
BAR = 1.2  # item 4: a cached call's host time within 1.2x of the empty torch op's
ROUNDS = 30  # hot rows alternate this many times
CHILD_TIMEOUT_S = 300
# A peer's compile cache, pointed into the row's temporary cache folder (cold, then warm).
PEER_CACHE_ENV = ("DG_JIT_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
ALL_ROWS = {**ROWS, **PEER_ROWS, **PEER_HOT_ROWS}
# The seed's Triton QSA (an anchor: imported, never copied), carried to the GPU machine in
# .device/anchors or beside the checkout (tools/qsa_dispatch_sweep.py looks the same way).
SEED_TRITON = ROOT / ".device/anchors/qsa_seed_triton.py"
if not SEED_TRITON.is_file():
    SEED_TRITON = ROOT.parent / "shared/anchors/qsa_seed_triton.py"


def child(row: str, profile: str | None = None) -> None:
    """One row's first and second call in this (new) process: JSON on the last line. With
    ``profile`` (a file), the first call runs under cProfile and its top entries go there."""
    if os.environ.get("FIJ_BENCH_DEEPGEMM"):  # --peers: the folder holding deep_gemm
        sys.path.insert(0, os.environ["FIJ_BENCH_DEEPGEMM"])
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    import flashinfer_jit  # noqa: F401 (what importing the package costs)

    import_ms = (time.perf_counter() - start) * 1e3
    call = ALL_ROWS[row].make("cuda")
    torch.cuda.synchronize()
    times = []
    for i in range(2):
        profiler = cProfile.Profile() if profile and i == 0 else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.runcall(call)
        else:
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
        if profiler is not None:
            with open(profile, "w") as f:
                pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(40)
    print(json.dumps({"import_ms": import_ms, "first_ms": times[0], "second_ms": times[1]}))


def run_child(row: str, cache: str, profile: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "FLASHINFER_JIT_CUBIN_PATH"}
    env.update(FLASHINFER_JIT_CACHE_DIR=cache, FLASHINFER_JIT_STRICT="1")
    env.update({name: f"{cache}/{name.lower()}" for name in PEER_CACHE_ENV})
    out = subprocess.run(
        [sys.executable, __file__, "--child", row, *(["--profile", profile] if profile else [])],
        env=env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if out.returncode != 0:
        raise RuntimeError(f"first call of {row!r} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compiled_kernels(cache: str) -> list[dict]:
    """The cache's records: what the cold call compiled, with NVRTC seconds."""
    records = []
    for meta in sorted(Path(cache).rglob("*.json")):
        record = json.loads(meta.read_text())
        if "compile_seconds" in record:
            records.append({"label": record["label"], "seconds": record["compile_seconds"]})
    return records


def first_calls(rows: tuple[str, ...], profile: str | None = None) -> list[dict]:
    """Cold, then warm first call per row; with ``profile`` (a folder) the warm call's
    cProfile top entries land there, one file a row."""
    results = []
    for i, row in enumerate(rows):
        with tempfile.TemporaryDirectory(prefix="fij-bench-") as cache:
            try:
                cold = run_child(row, cache)
                kernels = compiled_kernels(cache)
                warm = run_child(row, cache, profile and f"{profile}/warm_first_call_{i}.txt")
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the other rows go on
                print(f"{row}: FAILED {exc}", flush=True)
                results.append({"row": row, "op": ALL_ROWS[row].op, "error": str(exc)})
                continue
        results.append(
            {"row": row, "op": ALL_ROWS[row].op, "cold": cold, "warm": warm, "kernels": kernels}
        )
        print(
            f"{row}: cold {cold['first_ms']:.1f} ms ({len(kernels)} kernels), "
            f"warm {warm['first_ms']:.2f} ms",
            flush=True,
        )
    return results


def hot_rows(calls_per_row: int, peers: bool = False) -> dict[str, dict]:
    """Median host and eager us per call of every row, the rows alternating; with ``peers``
    the peers' hot rows too (a peer that does not import is left out, said once)."""
    table = calls("cuda")
    for name, row in PEER_HOT_ROWS.items() if peers else ():
        try:
            table[name] = row.make("cuda")
        except Exception as exc:  # noqa: BLE001 (the peer's column is skipped)
            print(f"{name}: skipped ({type(exc).__name__}: {exc})", flush=True)
    for fn in table.values():  # compiled, loaded and replayable before anything is timed
        for _ in range(50):
            fn()
    warm_gpu()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host: dict[str, list[float]] = {name: [] for name in table}
    eager: dict[str, list[float]] = {name: [] for name in table}
    per_round = max(1, calls_per_row // ROUNDS)
    for _ in range(ROUNDS):
        for name, fn in table.items():
            for _ in range(per_round):
                torch.cuda.synchronize()
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                host[name].append((t1 - t0) * 1e6)
                eager[name].append(start.elapsed_time(end) * 1e3)
    empty, empty_alloc = statistics.median(host[EMPTY_OP]), statistics.median(host[EMPTY_ALLOC_OP])
    return {
        name: {
            "op": ALL_ROWS[name].op,
            "outputs": ALL_ROWS[name].outputs,
            "host_us": statistics.median(host[name]),
            "eager_us": statistics.median(eager[name]),
            "x_empty": statistics.median(host[name]) / empty,
            # rows that allocate their outputs, against the empty op that allocates too
            "x_empty_alloc": statistics.median(host[name]) / empty_alloc,
        }
        for name in table
    }


def print_table(first: list[dict], hot: dict[str, dict], device: str) -> None:
    width = max(map(len, ALL_ROWS))
    print(f"\nengine latency on {device}")
    print(f"{'first call (new process)':{width}}  cold ms  kernels  warm ms  import ms")
    for r in first:
        if "error" in r:
            print(f"{r['row']:{width}}  failed (see above)")
            continue
        cold, warm = r["cold"], r["warm"]
        kernels = "-" if r["op"] == "peer" else len(r["kernels"])  # ours: the cache's records
        print(
            f"{r['row']:{width}}  {cold['first_ms']:7.1f}  {kernels:>7}  "
            f"{warm['first_ms']:7.2f}  {warm['import_ms']:9.1f}"
        )
    head = f"{'hot call (cached, GPU idle)':{width}}  host us  eager us  x empty (bar {BAR})"
    print(f"\n{head}  x allocating empty")
    for name, h in hot.items():
        mark = (
            "" if h["op"] in ("torch", "peer") else ("  ok  " if h["x_empty"] <= BAR else "  over")
        )
        alloc = f"  {h['x_empty_alloc']:7.2f}" if h["outputs"] == "allocated" else ""
        print(
            f"{name:{width}}  {h['host_us']:7.1f}  {h['eager_us']:8.1f}  {h['x_empty']:7.2f}"
            f"{mark}{alloc}"
        )


def commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dry_run() -> None:
    print("first calls (cold: empty cache, then warm: that cache), one new process each:")
    for row in FIRST_CALLS:
        print(f"  {ROWS[row].op:5s} {row}")
    print("with --peers DG_DIR, the peers' first calls too, each with its own cache empty:")
    for row in PEER_ROWS:
        print(f"  {row}")
    print("and their hot calls beside ours:")
    for row in PEER_HOT_ROWS:
        print(f"  {row}")
    print(f"hot host cost, {ROUNDS} alternating rounds, beside {EMPTY_OP!r}:")
    for name, row in ROWS.items():
        print(f"  {row.op:5s} {name}" + (f" (outputs {row.outputs})" if row.outputs else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="hot calls per row")
    parser.add_argument("--json", metavar="FILE", help="write every figure here")
    parser.add_argument("--dry-run", action="store_true", help="list what it would measure")
    parser.add_argument("--commit", default=None, help="what the JSON records (default: git's)")
    parser.add_argument("--profile", metavar="DIR", help="cProfile each warm first call into DIR")
    parser.add_argument(
        "--peers",
        metavar="DG_DIR",
        help="also the peers' first calls (DeepGEMM from DG_DIR, the seed's Triton QSA, "
        "torch.compile of the pack's torch path), each with its own compile cache empty",
    )
    parser.add_argument("--seed-triton", default=str(SEED_TRITON), help="the seed's module")
    parser.add_argument("--hot-only", action="store_true", help="no first calls: the hot rows")
    parser.add_argument("--child", metavar="ROW", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.profile)
        return
    if args.dry_run:
        dry_run()
        return
    if not torch.cuda.is_available():
        parser.error("no GPU: --dry-run lists what would be measured")
    rows = FIRST_CALLS
    if args.peers:  # the children find the peers through the environment, the hot rows here
        os.environ.update(FIJ_BENCH_DEEPGEMM=args.peers, FIJ_BENCH_SEED_TRITON=args.seed_triton)
        sys.path.insert(0, args.peers)
        rows += tuple(PEER_ROWS)
    first = [] if args.hot_only else first_calls(rows, args.profile)
    hot = hot_rows(args.calls, peers=bool(args.peers))
    device = torch.cuda.get_device_name()
    print_table(first, hot, device)
    if args.json:
        report = {
            "date": datetime.date.today().isoformat(),
            "commit": args.commit or commit(),
            "device": device,
            "first_calls": first,
            "hot": hot,
        }
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
