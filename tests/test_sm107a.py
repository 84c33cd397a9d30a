"""sm_107a (Rubin), compiled only (issue 21): a representative shipped kernel of each
NVRTC family compiles without spills and its SASS holds the instructions the kernel is
written around, as tests/test_mqa_logits_build.py and tests/test_qsa.py check for sm_100a.
Every shipped specialization is compiled for it by ``prebuild`` (the CI main job)."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from flashinfer_jit import cli
from jit_kernels.params import cuobjdump

ARCH = "sm_107a"


def _compiled(spec, tmp_path) -> tuple[str, str]:
    """(SASS, resource usage) of ``spec`` compiled for sm_107a."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import TEMPLATE_ROOT
    from jit_kernels import compile_cubin, render

    path = tmp_path / "k.cubin"
    path.write_bytes(compile_cubin(render(spec, TEMPLATE_ROOT), ARCH).cubin)
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True).stdout
    res = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills on {ARCH}: {res}"
    return sass, res


def _shipped(op: str, family: str, label_part: str = ""):
    specs = [t.spec for t in cli._tasks([op], (ARCH,), None) if t.spec.family == family]
    specs = [s for s in specs if label_part in s.label]
    assert specs, (op, family, label_part)
    return specs[0]


def test_concat_kernel(tmp_path):
    sass, _ = _compiled(_shipped("mla_kv_pack", "mla_kv_pack"), tmp_path)
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in sass  # cvt.rn.satfinite.e4m3x2.f32
    assert re.search(r"LDG\.E\.[A-Z.]*128", sass), "16-byte loads"


def test_mqa_logits_ring_kernel(tmp_path):
    from flashinfer_jit.mqa_logits.ring import ring_family, ring_params

    f32 = torch.float32
    spec = ring_family.spec(ring_params((1, 64, 128, 64), (f32, f32, f32)))
    sass, _ = _compiled(spec, tmp_path)
    assert "HMMA" in sass, "e4m3 widened to f16, mma.sync"
    assert "UBLKCP" in sass, "the ring streams K with cp.async.bulk"
    assert "SYNCS.ARRIVE.TRANS" in sass, "mbarrier transaction counts"


def test_qsa_cluster_kernel(tmp_path):
    sass, _ = _compiled(_shipped("qsa", "qsa_decode_cluster", "bulk=True"), tmp_path)
    assert "HMMA" in sass
    assert "UBLKCP" in sass, "one cp.async.bulk per token on the combined cache"
    assert "UCGABAR_ARV" in sass and "UCGABAR_WAIT" in sass, "the cluster barrier"
    assert "ACQBULK" in sass, "griddepcontrol.wait (programmatic dependent launch)"
