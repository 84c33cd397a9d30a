"""The TMA logits kernel's SASS (CPU machine, NVRTC): TMA copies and QGMMA, no spills, and
no serialized wgmma, for the shipped configs and every config the dispatcher picks below
head_dim 128."""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit._jit import BUILDER
from flashinfer_jit.mqa_logits.tma import TmaConfig, tma_config, tma_family
from jit_kernels import compile_cubin, render

from .test_mqa_logits_build import _sass


@pytest.mark.parametrize(
    "next_n,heads,block", [(1, 64, 64), (2, 64, 32), (3, 64, 128), (4, 64, 64), (4, 32, 64)]
)
def test_cubin_uses_tma_and_wgmma_without_spills(next_n, heads, block, tmp_path):
    f32 = torch.float32
    params = (next_n, heads, 128, block, f32, f32, f32, *tma_config(next_n * heads, 0, 128, next_n))
    _check_tma_cubin(params, tmp_path)


@pytest.mark.parametrize("dim,block", [(32, 64), (64, 64), (64, 32), (256, 128)])
def test_other_head_dims_compile_to_tma_and_wgmma(dim, block, tmp_path):
    f32 = torch.float32
    _check_tma_cubin((2, 64, dim, block, f32, f32, f32, *tma_config(128, 0, dim)), tmp_path)


# The lean loop: no spills, and ptxas keeps the wgmma asynchronous (no C7518: the kernel
# makes the first request current before its loop so no MMA is in flight across a join).
@pytest.mark.parametrize(
    "next_n,dim,config",
    [(1, 32, TmaConfig(4, 32, 4, 2, 1)), (2, 32, TmaConfig(4, 40, 4, 2, 1)),
     (1, 64, TmaConfig(4, 16, 4, 2, 1)), (2, 64, TmaConfig(4, 20, 4, 2, 1)),
     # (next_n*heads 128 at head_dim 128, 4 warpgroups: lean only with setmaxnreg, below)
     (1, 128, TmaConfig(3, 9, 3, 2, 1)), (1, 128, TmaConfig(1, 3, 1, 1, 1)),
     # paired tiles (two accumulator sets: three warpgroups at most at next_n*heads = 64)
     (1, 32, TmaConfig(3, 36, 3, 2, 1, 1)), (1, 64, TmaConfig(3, 18, 3, 2, 1, 1)),
     (1, 128, TmaConfig(3, 12, 3, 2, 1, 1)), (1, 128, TmaConfig(2, 8, 2, 2, 1, 1)),
     # setmaxnreg (within the launch allocation)
     (2, 32, TmaConfig(4, 40, 4, 2, 1, 0, 112)), (2, 64, TmaConfig(4, 20, 4, 2, 1, 0, 112)),
     (2, 128, TmaConfig(4, 8, 4, 2, 1, 0, 112)), (2, 128, TmaConfig(3, 12, 4, 2, 1, 0, 160))],
)  # fmt: skip
def test_lean_compiles_without_spills_or_serialized_wgmma(next_n, dim, config, tmp_path):
    f32 = torch.float32
    params = (next_n, 64, dim, 64, f32, f32, f32, *config)
    _check_tma_cubin(params, tmp_path)
    compiled = compile_cubin(render(tma_family.spec(params), BUILDER.template_root), "sm_90a")
    assert compiled.messages == ""


# What the dispatcher serves below head_dim 128 (lean at next_n <= 2, paired at n = 64 head_dim
# 64, plain beyond): every config compiles without spills.
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("next_n,heads", [(1, 32), (1, 64), (2, 64), (3, 64), (4, 32), (4, 64)])
def test_dispatched_small_head_dims_compile_without_spills(next_n, heads, dim, tmp_path):
    f32 = torch.float32
    config = tma_config(next_n * heads, 0, dim, next_n)
    _check_tma_cubin((next_n, heads, dim, 64, f32, f32, f32, *config), tmp_path)


def _check_tma_cubin(params, tmp_path):
    spec = tma_family.spec(params)
    compiled = compile_cubin(render(spec, BUILDER.template_root), "sm_90a")
    # ptxas says nothing: a serialized wgmma (C7518/C7519) is a warning, not an error
    assert compiled.messages == "", f"{spec.label}: {compiled.messages}"
    sass, res = _sass(compiled.cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills: {res}"
    assert "UTMALDG.3D" in sass and "QGMMA" in sass
    assert not spec.supports("sm_100a")
    return sass
