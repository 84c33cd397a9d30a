"""tools/run_deepgemm_test.py without a GPU: it exports DeepGEMM's Python test files, lists
the cases test_paged_mqa_logits generates with what is skipped, and runs shrunken cases of
DeepGEMM's own checks on the torch path (each run in a fresh interpreter: the runner puts a
stand-in ``deep_gemm`` into sys.modules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "run_deepgemm_test.py"
GIT_DIR = Path(os.environ.get("DEEPGEMM_GIT_DIR", "/work/.mirror/deepseek-ai+DeepGEMM/repo"))


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    if not (GIT_DIR / "HEAD").exists():
        pytest.skip(f"no DeepGEMM git dir at {GIT_DIR} (set DEEPGEMM_GIT_DIR)")
    dest = tmp_path_factory.mktemp("deepgemm")
    res = run(str(GIT_DIR), "--export-to", str(dest))
    assert res.returncode == 0, res.stderr
    return dest


def test_lists_sm90_cases(checkout):
    res = run(str(checkout), "--list", "--arch", "9")
    assert res.returncode == 0, res.stderr
    assert "generates 24 cases (arch 9)" in res.stdout
    assert res.stdout.count(" served") == 24 and "SKIPPED" not in res.stdout


def test_lists_sm100_skips_with_reasons(checkout):
    res = run(str(checkout), "--list", "--arch", "10")
    assert res.returncode == 0, res.stderr
    for why in ("FP4 q and KV", "varlen batches (indices)", "bfloat16 weights"):
        assert f"SKIPPED: {why}" in res.stdout


def test_cpu_smoke_runs_deepgemms_checks(checkout):
    res = run(str(checkout), "--cpu-smoke", "--cases", "4,19")  # bf16 and f32, next_n 2
    assert res.returncode == 0, res.stdout + res.stderr
    assert "summary: 2 passed, 0 failed, 0 skipped" in res.stdout
