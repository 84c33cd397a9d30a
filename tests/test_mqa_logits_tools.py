"""The benchmark tools' builds of the sm_90a TMA logits kernel (tools/): the trace, the
timing probes and the template variants patch anchors of the shipped template; these tests
keep the anchors there and the patched kernels what the tools say they are."""

from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path

import pytest
import torch

import flashinfer_jit.mqa_logits as mq
from flashinfer_jit._jit import BUILDER
from flashinfer_jit.mqa_logits.tma import TmaConfig, tma_config, tma_family
from jit_kernels import compile_cubin, render

from .test_mqa_logits import logits_with, make_inputs
from .test_mqa_logits_build import _sass
from .test_mqa_logits_tma import _sm90


@pytest.mark.gpu
def test_gpu_tma_probe_streams_without_writing(monkeypatch):
    """The benchmark's streaming probe runs to completion and writes nothing."""
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    probe = _tool("mqa_logits_probe").probe_options(TmaConfig(2, 0, 2, 2), 1)
    q, kv, w, table, seq, max_len = make_inputs([900, 5, 0, 4000], device="cuda")
    out = torch.full((4, mq.padded_seq_len(max_len)), float("nan"), device="cuda")
    logits_with(probe)(q, kv, w, table, seq, max_len, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


def _tool(name: str):
    """A module of tools/ (on sys.path there, as the tools run)."""
    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    return importlib.import_module(name)


@pytest.mark.parametrize("probe", [0, 1, 2, 3])
def test_trace_and_probe_tools_instrument_the_shipped_kernel(tmp_path, probe):
    """tools/trace_mqa_logits.py and tools/mqa_logits_probe.py patch anchors of the TMA
    template: they must still be there (each exactly once) and the patched kernel must
    compile, probe 0 to the shipped kernel's SASS plus the trace's stores."""
    family = _tool("trace_mqa_logits").traced_family(tmp_path / "templates")
    f32 = torch.float32
    kernel = family.spec((1, 64, 128, 64, f32, f32, f32, *tma_config(64), probe))
    cubin = compile_cubin(render(kernel, family.builder.template_root), "sm_90a").cubin
    assert b"fij_trace" in cubin


def test_probe_zero_is_the_shipped_kernel(tmp_path):
    """Probe 0 compiles to the shipped kernel's SASS (the probe patches change nothing else)."""
    probe = _tool("mqa_logits_probe")
    family = probe.patched_family(tmp_path / "templates", "probe_test", [])
    f32 = torch.float32
    params = (1, 64, 128, 64, f32, f32, f32, *tma_config(64))
    shipped = compile_cubin(render(tma_family.spec(params), BUILDER.template_root), "sm_90a")
    patched = compile_cubin(
        render(family.spec((*params, 0)), family.builder.template_root), "sm_90a"
    )
    sass = [_sass(k.cubin, tmp_path)[0] for k in (shipped, patched)]
    body = [s[s.index(".headerflags") :] for s in sass]  # past the mangled name
    assert body[0] == body[1]


def test_bench_variants_patch_the_shipped_kernel(tmp_path):
    """tools/bench_mqa_peer.py's VARIANTS patch anchors of the TMA template (each exactly
    once): every variant compiles in the setmaxnreg configs of next_n 2 (4 warpgroups at
    112) and 3 (3 at 160), and differs from the shipped kernel in one of them (a variant
    that patches nothing times the shipped kernel)."""
    bench = _tool("bench_mqa_peer")
    if not bench.VARIANTS:
        pytest.skip("no variants in tools/mqa_peer_rows.py to check")
    probe = _tool("mqa_logits_probe")
    f32 = torch.float32
    shapes = [(2, 64, 128, 64, f32, f32, f32, *tma_config(128, 0, 128, 2)),
              (3, 64, 128, 64, f32, f32, f32, *tma_config(192, 0, 128, 3))]  # fmt: skip

    def body(family, params) -> str:
        built = compile_cubin(render(family.spec(params), family.builder.template_root), "sm_90a")
        sass = _sass(built.cubin, tmp_path)[0]
        return sass[sass.index(".headerflags") :]

    shipped = [body(tma_family, params) for params in shapes]
    for name, patches in bench.VARIANTS.items():
        family = probe.variant(name, patches)
        assert [body(family, params) for params in shapes] != shipped, name


def test_probes_refuse_the_lean_loop():
    """The probes patch the plain consumer loop: a lean config would time the unpatched
    kernel under a probe's name (as --probes did in session 18), so it is refused."""
    probe = _tool("mqa_logits_probe")
    with pytest.raises(ValueError, match="plain loop"):
        probe.probe_options(TmaConfig(4, 8, 4, 2, 1, 0, 112), 1)
    with pytest.raises(ValueError, match="plain loop"):
        probe.probe_options(None, 2)
    assert probe.probe_options(TmaConfig(4, 8, 4, 2, 0, 0, 112), 3).config.lean == 0


def test_patch_templates_takes_other_files(tmp_path):
    """A variant's patch names its template when it is not the TMA one (the epilogue's
    tile.cuh, the schedule's util.cuh); an anchor found other than once stops the tool."""
    probe = _tool("mqa_logits_probe")
    name = "mqa_logits/util.cuh"
    anchor = "constexpr int kOnePassPerThread = 8;"
    probe.patch_templates(tmp_path / "t", [(name, anchor, "constexpr int kOnePassPerThread = 4;")])
    text = (tmp_path / "t" / name).read_text()
    assert "kOnePassPerThread = 4;" in text and anchor not in text
    with pytest.raises(SystemExit, match="exactly once"):
        probe.patch_templates(tmp_path / "u", [(name, "no such anchor", "")])


def test_peer_rows_policy_sweep_and_protocol_defaults(monkeypatch):
    """bench_mqa_peer: every row name is unique (--rows finds one row), each policy row times
    both KV policies forced (session 26's sweep), and the table's protocol is the default (a
    clean read before every call, one call per set, sides alternating)."""
    rows = _tool("mqa_peer_rows")
    names = [r.name for r in rows.ROWS + rows.EXTRA_ROWS]
    assert len(names) == len(set(names)) and rows.POLICY_ROWS
    for row in rows.POLICY_ROWS:
        forced = {o.kv_evict_first for _, o in rows.SWEEPS[row.name]}
        assert forced == {True, False} and row in rows.EXTRA_ROWS
    monkeypatch.setattr(sys, "argv", ["bench_mqa_peer.py"])
    args = _tool("bench_mqa_peer").parse_args()
    assert (args.clean_each, args.graph_calls, args.protocol) == (True, 0, "alt")
    monkeypatch.setattr(sys, "argv", ["bench_mqa_peer.py", "--no-clean-each", "--graph-calls", "8"])
    args = _tool("bench_mqa_peer").parse_args()
    assert (args.clean_each, args.graph_calls) == (False, 8)


def test_clean_each_reads_before_every_call_and_takes_the_reads_off(monkeypatch):
    """bench_util.per_call_in_graphs(clean_each=True): each captured call follows a clean read,
    a graph of reads alone is timed beside the sides, and its time is taken off theirs."""
    util = _tool("bench_util")
    order: list[str] = []

    class Graph:
        def replay(self) -> None:
            pass

    monkeypatch.setattr(util, "clean_read", lambda: lambda: order.append("read"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    timed = {}

    def time_replays(graphs, calls, reps, protocol):
        timed.update(calls)
        return {name: 10.0 if name == "read" else 25.0 for name in graphs}

    monkeypatch.setattr(util, "time_replays", time_replays)
    sides = {"a": [lambda: order.append("a0"), lambda: order.append("a1")]}
    got = util.per_call_in_graphs(sides, 3, "alt", clean_each=True)
    assert got == {"a": 15.0, "read": 10.0} and timed == {"a": 2, "read": 2}
    # warm-up then capture, each call right after a read; then the reads' own graph
    assert order == ["read", "a0", "read", "a1"] * 2 + ["read"] * 4
