"""Run DeepGEMM's own paged-MQA-logits test against flashinfer_jit.deep_gemm.

    python tools/run_deepgemm_test.py DEEPGEMM [--cases 0,3-5] [--shard K/N] [--no-bench]
    python tools/run_deepgemm_test.py DEEPGEMM --list            # the cases and what we skip
    python tools/run_deepgemm_test.py DEEPGEMM --cpu-smoke       # shrunken cases on CPU
    python tools/run_deepgemm_test.py GITDIR --export-to .deepgemm   # copy the files it needs

DEEPGEMM is a DeepGEMM checkout (or the folder --export-to wrote): only its Python files are
read, tests/test_attention.py, tests/generators.py, deep_gemm/testing and deep_gemm/utils.
DeepGEMM need not be built: a stand-in ``deep_gemm`` package (its ``__path__`` the checkout's
deep_gemm folder, so ``deep_gemm.testing`` and ``deep_gemm.utils`` load from there without
running its ``__init__``) carries this package's functions, and a stand-in ``deep_gemm._C``
answers the names those helpers import with functions that raise when called.

Each case test_paged_mqa_logits generates runs on its own (the test's sample_mqa_cases is
patched to hand it one case), so one failure does not hide the others; the summary lists
passed, failed and skipped cases (with why) and the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from deepgemm_shim import cpu_torch, served, shrink  # noqa: E402

NEEDED = ("tests/test_attention.py", "tests/generators.py", "deep_gemm/testing", "deep_gemm/utils")


class _Collected(Exception):
    """Raised by the patched sample_mqa_cases once it has seen the generated cases."""


def _stub(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(f"deep_gemm.{name} is not served by flashinfer_jit.deep_gemm")

    missing.__name__ = name
    return missing


def install_shim(checkout: Path) -> types.ModuleType:
    """Put the stand-in ``deep_gemm`` and ``deep_gemm._C`` into sys.modules."""
    import flashinfer_jit.deep_gemm as ours

    pkg = types.ModuleType("deep_gemm")
    pkg.__path__ = [str(checkout / "deep_gemm")]  # submodules load from the checkout
    native = types.ModuleType("deep_gemm._C")
    # The served functions, and the SM count the test sizes its metadata by (the installed
    # deep_gemm's where there is one, else ours: the device's).
    served_names = (*ours.__all__, "get_num_sms")
    for module in (pkg, native):
        for name in served_names:
            setattr(module, name, getattr(ours, name))
        module.__getattr__ = _stub  # PEP 562: every other name is a stub that raises
    sys.modules["deep_gemm"], sys.modules["deep_gemm._C"] = pkg, native
    return pkg


def load_test(checkout: Path, pkg: types.ModuleType) -> types.ModuleType:
    sys.path.insert(0, str(checkout / "tests"))  # `from generators import ...`
    spec = importlib.util.spec_from_file_location(
        "test_attention", checkout / "tests/test_attention.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.deep_gemm is pkg, "the test must call the stand-in deep_gemm"
    return module


def generated_cases(test: types.ModuleType) -> list[tuple]:
    seen: list[tuple] = []

    def collect(name: str, cases: list[tuple]) -> list[tuple]:
        seen.extend(cases)
        raise _Collected

    test.sample_mqa_cases = collect
    try:
        test.test_paged_mqa_logits()
    except _Collected:
        pass
    return seen


def run_case(test: types.ModuleType, case: tuple) -> str | None:
    """None when DeepGEMM's checks pass for this one case, else the failure."""
    test.sample_mqa_cases = lambda name, cases: [case]
    try:
        test.test_paged_mqa_logits()
    except Exception:  # noqa: BLE001 (every failure of a case is reported, then the next runs)
        return traceback.format_exc(limit=-3)
    return None


def pick(indices: str | None, shard: str | None, count: int) -> list[int]:
    chosen = list(range(count))
    if indices:
        chosen = []
        for part in indices.split(","):
            lo, _, hi = part.partition("-")
            chosen += range(int(lo), int(hi or lo) + 1)
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        chosen = chosen[k::n]
    return chosen


def export(git_dir: Path, dest: Path) -> None:
    """Copy the Python files the run needs out of a (bare) git directory."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "--git-dir", str(git_dir), "archive", "HEAD", *NEEDED],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    commit = subprocess.run(
        ["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (dest / "COMMIT").write_text(commit + "\n")
    print(f"exported DeepGEMM {commit} ({', '.join(NEEDED)}) to {dest}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("deepgemm", type=Path, help="DeepGEMM checkout (or a git dir with --export-to)")
    ap.add_argument("--cases", help="case indices to run, e.g. 0,3-5 (see --list)")
    ap.add_argument("--shard", help="K/N: every N-th of the chosen cases, from the K-th")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--arch", type=int, help="arch major the cases are generated for")
    ap.add_argument("--no-bench", action="store_true", help="skip the test's kineto timing")
    ap.add_argument("--cpu-smoke", action="store_true", help="shrunken cases on CPU (torch path)")
    ap.add_argument("--export-to", type=Path, help="copy the needed files from a git dir")
    args = ap.parse_args(argv)
    if args.export_to:
        export(args.deepgemm, args.export_to)
        return 0
    checkout = args.deepgemm.resolve()
    missing = [p for p in NEEDED if not (checkout / p).exists()]
    if missing:
        sys.exit(f"{checkout} lacks {missing}: pass a DeepGEMM checkout (or use --export-to)")
    if args.no_bench or args.cpu_smoke:
        os.environ["DG_USE_NVIDIA_TOOLS"] = "1"  # bench_kineto then returns without profiling
    test = load_test(checkout, install_shim(checkout))
    if args.cpu_smoke:
        test.torch = cpu_torch()
    arch = args.arch or (9 if args.cpu_smoke or not torch.cuda.is_available() else None)
    if arch is not None:
        test.get_arch_major = lambda: arch
    cases = generated_cases(test)
    plan = [(i, c, served(c)) for i, c in enumerate(cases)]
    print(
        f"DeepGEMM test_paged_mqa_logits generates {len(cases)} cases (arch {arch or 'of the GPU'})"
    )
    for i, case, why in plan:
        if args.list or why:
            print(f"  [{i:2}] {case} {'served' if why is None else 'SKIPPED: ' + why}")
    if args.list:
        return 0
    chosen = set(pick(args.cases, args.shard, len(cases)))
    results = []
    for i, case, why in plan:
        if i not in chosen or why is not None:
            continue
        start = time.time()
        failure = run_case(test, shrink(case) if args.cpu_smoke else case)
        results.append((i, case, failure, time.time() - start))
        print(f"[{i:2}] {'PASS' if failure is None else 'FAIL'} {time.time() - start:6.1f} s")
        if failure:
            print(failure)
    failed = [r for r in results if r[2] is not None]
    skipped = sum(why is not None for _, _, why in plan)
    print(
        f"\nsummary: {len(results) - len(failed)} passed, {len(failed)} failed, {skipped} skipped"
    )
    for i, case, _, _ in failed:
        print(f"  FAILED [{i}] {case}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
