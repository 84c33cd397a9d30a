"""tools/qsa_cluster_sweep.py without a GPU: its variant table names every split count and
config once and passes only what run_kernels takes, the configs are ones the dispatcher's
checks accept, its points are the sweep grid's, and --list runs."""

from __future__ import annotations

import subprocess
import sys

from flashinfer_jit.qsa import kernels as qk

from .test_mqa_logits_tools import _tool

tool = _tool("qsa_cluster_sweep")


def test_variants_cover_each_split_and_config_once():
    table = tool.variants((1, 2, 3))
    configs = len(tool.CP_CONFIGS) + len(tool.BULK_CONFIGS)
    assert len(table) == 3 * configs
    assert {kw["num_splits"] for kw in table.values()} == {1, 2, 3}
    assert all(set(kw) == {"num_splits", "config", "pair", "bulk"} for kw in table.values())
    # the label says what runs: "p" two chunks a step, "bulk" the bulk copies
    for label, kw in table.items():
        assert label.endswith(" p") == kw["pair"] and label.endswith(" bulk") == kw["bulk"]
    # every config passes the shipped range and shared-memory checks
    for config, pair in tool.CP_CONFIGS:
        assert qk.checked_config(config, 128, False, pair) == config
    for config in tool.BULK_CONFIGS:
        assert qk.checked_config(config, 128, True) == config


def test_points_parse_and_list_runs():
    point = tool.parse("64/16/1/2048")
    assert (point.rows, point.hq, point.hkv, point.topk) == (64, 16, 1, 2048)
    assert all(tool.parse(p).name == p for p in tool.POINTS)  # the sweep grid's names
    command = [sys.executable, str(tool.__file__), "--list", "--splits", "2,3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count = len(tool.variants((2, 3)))
    assert done.stdout.startswith(f"{len(tool.POINTS)} points x {count} variants: k2 ")


def test_precompile_plans_what_decode_launch_would(monkeypatch):
    """Without a GPU (SM count and the compile stubbed): every variant resolves through the
    sweep grid's planner or is refused by the shipped checks (k1 with two chunks a step),
    and a split whose slots overflow the in-kernel list brings the slot pass's kernel."""
    got = []
    monkeypatch.setattr(tool, "sm_count", lambda device: 132)
    monkeypatch.setattr(tool, "prepare", lambda wanted, device: got.extend(wanted))
    tool.precompile(["16/64/4/4096"], tool.variants((1, 2)))
    families = {family.family for family, _ in got}
    assert families == {"qsa_decode_cluster", "qsa_decode_form", "qsa_slots"}  # k1: the loop forms
    assert len(got) == len(set(got))
    clusters = [params for family, params in got if family.family == "qsa_decode_cluster"]
    # (group, D, warps, stages, min CTAs, cluster, slot cap, bulk, pair): 4096 slots over 2
    # splits overflow the 1024-entry list, so no cluster kernel resolves its own
    assert clusters and all(params[6] == 0 for params in clusters)
