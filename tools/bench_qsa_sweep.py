"""The --sweep-variants mode of tools/bench_qsa.py: every opt-in decode variant
(flashinfer_jit/qsa_variants.py) on the issue's four target calls.

Each target call takes the dispatcher's path: rows*Hkv >= DECODE_MIN_PROGRAMS the single
pass (SINGLE_VARIANTS apply), below it cluster split-K at the dispatcher's split count
(CLUSTER_VARIANTS). Every run is first checked against a float32 torch-path reference on
two input sets with the issue's bar (norm-wise relative error per (row, head) < 5e-3, head
rows with nothing attended exactly zero, no NaN); a failure prints "!!! FAIL" at once and
its cell reads FAIL. Then it is timed as CUDA-graph replays (µs per call, whole call:
slot pass included). The dispatcher is timed first and last (drift). The table prints last.
"""

from __future__ import annotations

import math
import traceback

import bench_qsa as bench
import torch

from flashinfer_jit import qsa
from flashinfer_jit import qsa_variants as qv
from flashinfer_jit.qsa_ref import qsa_decode_torch
from jit_kernels import sm_count

TARGETS = [(64, 64, 4, 2048), (512, 64, 4, 2048), (2048, 32, 4, 1024), (4, 64, 4, 2048)]
TOL = 5e-3


def dispatcher_splits(rows: int, hkv: int, topk: int) -> int:
    """1 (the single pass) or the cluster size the dispatcher picks."""
    single = qsa.use_fp8_decode_kernel(rows * hkv, torch.uint8)
    return 1 if single else qsa.split_count(rows, hkv, topk)


def float_reference(args) -> torch.Tensor:
    expect = torch.empty(args[0].shape, dtype=torch.float32, device=args[0].device)
    qsa_decode_torch(*args[:6], expect, *args[7:])
    return expect


def worst_error(got: torch.Tensor, expect: torch.Tensor) -> float:
    """max over (row, head) of ||got - ref|| / ||ref||; inf on NaN or on a nonzero head row
    whose reference is all zero."""
    got = got.float()
    if torch.isnan(got).any():
        return math.inf
    norm = expect.norm(dim=-1)
    empty = norm == 0
    if (got[empty] != 0).any():
        return math.inf
    rel = (got - expect).norm(dim=-1)[~empty] / norm[~empty]
    return rel.max().item() if rel.numel() else 0.0


def measure(run, sets, expects) -> float | str:
    """Graph µs of ``run`` after the correctness check, else "FAIL ..." / "ERR ..."."""
    try:
        for args, expect in zip((sets[0], sets[-1]), expects, strict=True):
            args[6].fill_(float("nan"))
            run(args)
            torch.cuda.synchronize()
            err = worst_error(args[6], expect)
            if not err < TOL:
                return f"FAIL err {err:.1e}"
        return bench.time_graph(run, sets)
    except Exception as exc:  # one broken variant must not end the sweep
        traceback.print_exc()
        return f"ERR {type(exc).__name__}"


def sweep_variants(gib: float) -> int:
    """Run the sweep, print the table last; returns the number of failed checks.

    Phases over all four calls: the dispatcher, the cp.async variants, the bulk-copy
    (mbarrier) variants, the dispatcher again. A bulk variant whose barrier never completes
    traps (an error, not a hang), which poisons the process's CUDA context: the riskiest
    runs go last so everything before them is measured.
    """
    labels = ["dispatcher"]
    labels += [f"1p {n}" for n in qv.SINGLE_VARIANTS] + [f"cl {n}" for n in qv.CLUSTER_VARIANTS]
    labels.append("dispatcher again")
    cells: dict[tuple[str, int], float | str] = {}
    failures = []
    sms = sm_count(torch.cuda.current_device())
    calls = []  # (column, name, sets, references, [(label, run, bulk)])
    for col, (rows, hq, hkv, topk) in enumerate(TARGETS):
        name = f"{rows}/{hq}/{hkv}/{topk}"
        try:
            sets = bench.make_sets(
                rows, hq, hkv, topk, bench.n_sets_for(rows, hkv, topk), gib, seed=30 + col
            )
            expects = [float_reference(sets[0]), float_reference(sets[-1])]
        except Exception as exc:
            traceback.print_exc()
            failures.append(f"{name}: inputs: {exc}")
            continue
        single = dispatcher_splits(rows, hkv, topk) == 1
        prefix, table = ("1p", qv.SINGLE_VARIANTS) if single else ("cl", qv.CLUSTER_VARIANTS)
        runs = []
        for vname, variant in table.items():
            if qv.refusal(variant, sets[0], device_sms=sms) is None:
                run = lambda a, v=variant: qv.run_variant(a, v)  # noqa: E731
                runs.append((f"{prefix} {vname}", run, "tma" in variant.features))
        calls.append((col, name, sets, expects, runs))

    def record(label, col, name, value):
        cells[(label, col)] = value
        if isinstance(value, str):
            failures.append(f"{label} on {name}: {value}")
            print(f"!!! FAIL {label} on {name}: {value}", flush=True)
        else:
            print(f"{name} {label}: {value:.1f} µs", flush=True)

    for phase in ("dispatcher", False, True, "dispatcher again"):
        for col, name, sets, expects, runs in calls:
            if isinstance(phase, str):
                record(phase, col, name, measure(bench.dispatcher, sets, expects))
                continue
            for label, run, bulk in runs:
                if bulk == phase:
                    record(label, col, name, measure(run, sets, expects))

    heads = [f"{r}/{hq}/{hkv}/{k} k{dispatcher_splits(r, hkv, k)}" for r, hq, hkv, k in TARGETS]
    body = [[label, *[cells.get((label, c), "·") for c in range(len(TARGETS))]] for label in labels]
    best_row, gain_row = ["best variant"], ["gain vs dispatcher"]
    for c in range(len(TARGETS)):
        base = [cells.get((lbl, c)) for lbl in ("dispatcher", "dispatcher again")]
        base = [b for b in base if isinstance(b, float)]
        ok = {lbl: v for (lbl, cc), v in cells.items() if cc == c and isinstance(v, float)}
        ok = {lbl: v for lbl, v in ok.items() if not lbl.startswith("dispatcher")}
        best = min(ok, key=ok.get) if ok else None
        best_row.append(best or "-")
        gain_row.append(f"{100 * (1 - ok[best] / min(base)):+.1f}%" if best and base else "-")
    targets = ["issue target µs"] + [str(bench.ISSUE_SHAPES[s][1]) for s in TARGETS]
    print(f"\n{len(failures)} failed checks" + "".join(f"\n  !!! {f}" for f in failures))
    print("\n== QSA decode variants: graph-replay µs per call (whole call), · = not applicable")
    print(bench.table(["variant", *heads], [*body, best_row, gain_row, targets]))
    return len(failures)
