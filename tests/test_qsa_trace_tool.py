"""tools/trace_qsa.py: its patches find their anchors in the QSA templates (each exactly once)
and every traced decode family compiles with the trace buffer; on a GPU, a traced call
records every CTA of the call and computes what the shipped kernel computes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from jit_kernels import compile_cubin, render

from .test_qsa import args_of, assert_close, make_case, ref_of

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool():
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module("trace_qsa")
    finally:
        sys.path.remove(str(TOOLS))


# one launch form of each family: (group, head_dim, config..., family-specific flags)
TRACED = {
    "decode_family": (16, 128, 4, 3, 4, False),
    "decode_form_family": (16, 128, 4, 2, 4, True, False, True),
    "cluster_family": (16, 128, 4, 2, 4, 2, 0, True, False, True),
    "decode_short_family": (16, 128, 1, 2, 16, True, False, True),
}


@pytest.mark.parametrize("name", sorted(TRACED))
def test_traced_families_compile_with_the_trace(tmp_path, name):
    pytest.importorskip("cuda.bindings.nvrtc")
    families = _tool().traced_families(tmp_path / "templates")
    family = families[name]
    spec = family.spec(TRACED[name])
    cubin = compile_cubin(render(spec, family.builder.template_root), "sm_90a").cubin
    assert b"fij_trace" in cubin and family.family.endswith("_trace")


@pytest.mark.gpu
def test_gpu_traced_call_records_every_cta(tmp_path, monkeypatch, capsys):
    tool = _tool()
    families = tool.traced_families(tmp_path / "templates")
    for module, name in tool.FAMILIES:
        monkeypatch.setattr(module, name, families[name])
    point = tool.grid.Point(8, 16, 1, 512)
    tool.trace_point(point, "k1", families, seed=1, gib=0.5)
    trace = tool.read_trace(families)
    ran = trace[:, 12] > trace[:, 1]
    assert int(ran.sum()) == point.pairs  # the single pass: one CTA a (row, kv head)
    assert sorted(trace[ran, 14].tolist()) == list(range(point.rows))  # each row once
    assert "a CTA's time =" in capsys.readouterr().out
    # the traced copy still computes the decode (k1 and the ordered 2-split)
    for variant in ("k1", "k2o"):
        case = make_case(rows=6, hq=16, hkv=2, d=128, page=64, topk=300, width=6,
                         num_blocks=40, device="cuda", seed=3, combined=True)  # fmt: skip
        tool.run_kernels(args_of(case), **tool.VARIANTS[variant])
        torch.cuda.synchronize()
        assert_close(case["out"], ref_of(case))
