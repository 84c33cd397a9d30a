"""What ``prebuild`` plans before it compiles (issue 21): the default archs, which
families build for which arch, ``--dry-run``'s counts, and the order tasks run in."""

from __future__ import annotations

import pytest

from flashinfer_jit import cli
from jit_kernels import DEFAULT_OFFLINE_ARCHS, arch_for_capability, target_archs
from jit_kernels.prebuild import BuildTask, kernel_counts
from jit_kernels.spec import KernelSpec


def test_sm_107a_is_a_default_arch(monkeypatch):
    monkeypatch.delenv("FLASHINFER_JIT_ARCHS", raising=False)
    assert DEFAULT_OFFLINE_ARCHS == ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    assert arch_for_capability(10, 7) == "sm_107a"  # its arch-specific target, like 10.0
    import torch

    if not torch.cuda.is_available():
        assert target_archs() == DEFAULT_OFFLINE_ARCHS


def test_cake_kernels_skip_sm_107a():
    """CuTe DSL 4.8.1 refuses sm_107a: the cake family says so, prebuild plans none."""
    tasks = cli._tasks(["mla_kv_pack"], DEFAULT_OFFLINE_ARCHS, None)
    cake = {t.arch for t in tasks if t.spec.family == "mla_kv_pack_cake"}
    assert cake == {"sm_90a", "sm_100a", "sm_103a"}
    assert any(t.arch == "sm_107a" for t in tasks)  # the NVRTC kernel still builds there


def test_kernel_counts_group_by_op_and_arch():
    spec = KernelSpec("f", "t.cuh", "k", (("n", 1),))
    tasks = [BuildTask("b", spec, "sm_90a"), BuildTask("a", spec, "sm_90a")]
    tasks += [BuildTask("a", spec, "sm_100a")] * 2
    tasks += [BuildTask("b", spec, "sm_100a")]
    counts = [("b", "sm_90a", 1), ("b", "sm_100a", 1), ("a", "sm_90a", 1), ("a", "sm_100a", 2)]
    assert kernel_counts(tasks) == counts  # in the order they come, not sorted as text


def test_dry_run_prints_counts_and_compiles_nothing(capsys, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(cache))

    def no_build(*args, **kwargs):
        raise AssertionError("a dry run compiled")

    monkeypatch.setattr(cli, "build_all", no_build)
    archs = ",".join(DEFAULT_OFFLINE_ARCHS)
    assert cli.main(["prebuild", "--dry-run", "--arch", archs]) == 0
    out = capsys.readouterr().out
    expected = kernel_counts(cli._tasks(None, DEFAULT_OFFLINE_ARCHS, None))
    for op, arch, count in expected:
        assert any(line.split() == [op, arch, str(count)] for line in out.splitlines()), out
    total = sum(count for *_, count in expected)
    assert f"{total} kernels for {', '.join(DEFAULT_OFFLINE_ARCHS)}" in out
    assert not cache.exists()  # not even the cache folder


@pytest.mark.parametrize("op", ["qsa", "mqa_logits", "mla_kv_pack"])
def test_every_default_arch_gets_kernels(op):
    archs = {t.arch for t in cli._tasks([op], DEFAULT_OFFLINE_ARCHS, None)}
    assert archs == set(DEFAULT_OFFLINE_ARCHS)


def test_profile_tool_reports_a_cold_build(tmp_path, monkeypatch, capsys):
    """tools/profile_prebuild.py (docs/prebuild-time.md's figures) on sm_107a's two concat
    kernels: counts, distinct inputs, per-op seconds and the JSON rows."""
    import importlib.util
    import json
    import sys
    from pathlib import Path

    pytest.importorskip("cuda.bindings.nvrtc")
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path / "cache"))
    path = Path(__file__).resolve().parent.parent / "tools" / "profile_prebuild.py"
    spec = importlib.util.spec_from_file_location("profile_prebuild", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "rows.json"
    argv = ["profile_prebuild", "--ops", "mla_kv_pack", "--arch", "sm_107a", "-j", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out)])
    tool.main()
    printed = capsys.readouterr().out
    assert "2 kernels, 2 distinct compiler inputs" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [row[3] for row in rows] == ["compiled", "compiled"]
