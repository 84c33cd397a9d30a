"""The QSA clusters in the slot pass's row order (kernels.ordered_split; qsa_decode_cluster
ORDER) and the long-selection crossover they serve on sm_90.

CPU: the rule, the variant's refusals. GPU: forced ordered clusters of 2-8 CTAs over a few
rows with every hazard and over several waves of many rows, and the dispatcher at topk 2048
and 4096 on each side of 512 and 832 pairs, against the float64 reference on fresh inputs
with poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import warmup as qsa_warmup
from flashinfer_jit.qsa.op import run_kernels
from flashinfer_jit.qsa.plan import QsaOptions, Variant, launch_choice

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of
from .test_qsa_gpu import GPU_SHAPES, strict  # noqa: F401 (fixture)
from .test_qsa_short_dispatch import _gpu_case, planned  # noqa: F401 (fixture)

SM90 = (9, 0)


# -- CPU -------------------------------------------------------------------------------------
def test_the_rule():
    """From topk 2048 at head_dim 128 (4096 at any) sm_90 splits up to 832 pairs, in row
    order from 384 (2-splits of head_dim 128 only); other archs: the seed's crossover."""
    assert qk.decode_min_programs(SM90, 2048, 128) == qk.DECODE_MIN_PROGRAMS_SM90_LONG == 832
    assert qk.decode_min_programs(SM90, 2047, 128) == qk.decode_min_programs(SM90, 2048, 64) == 512
    assert qk.decode_min_programs(SM90, 4096, 64) == 832
    assert qk.decode_min_programs((10, 0), 2048, 128) == qk.DECODE_MIN_PROGRAMS
    assert qk.ordered_split(SM90, 384, 2, 128, 2048) and qk.ordered_split(SM90, 831, 2, 128, 4096)
    assert not qk.ordered_split(SM90, 383, 2, 128, 2048)  # about one wave of 2-CTA clusters
    assert not qk.ordered_split(SM90, 640, 2, 128, 2047)  # short selections: not measured
    assert not qk.ordered_split(SM90, 640, 4, 128, 4096)
    assert not qk.ordered_split(SM90, 640, 2, 64, 4096)
    assert not qk.ordered_split((10, 0), 640, 2, 128, 4096)
    # launch_split carries the answer for the device it is given (none: no order)
    split = (160, 4, 4096, 128, 132, qk.H200_WAVE_CLUSTERS.__getitem__, 832)  # 640 pairs
    assert qk.launch_split(*split, SM90) == (2, None, None, True)
    assert qk.launch_split(*split) == qk.launch_split(*split, (10, 0)) == (2, None, None, False)


def test_the_variant_and_its_refusals():
    shape = (16, 128, 2048, 64, 640, 132, True)  # group, D, topk, page, pairs, SMs, bulk
    args = (QsaOptions(), *shape[:2], *shape[2:])
    ordered = launch_choice(Variant(2, order=True), *args)
    assert ordered.order and not ordered.fused and ordered.slots is not None
    assert ordered.slots[1][1] is True  # the slot pass writes the order
    assert ordered.kernel[1][-1] is True  # qsa_decode_cluster's ORDER
    plain = launch_choice(Variant(2), *args)  # topk 2048 fits the in-kernel slots: fused
    assert plain.fused and not plain.order and plain.slots is None
    with pytest.raises(ValueError, match="row order comes with the slot pass"):
        launch_choice(Variant(2, fused=True, order=True), *args)
    with pytest.raises(ValueError, match="order=False applies to the short single pass"):
        launch_choice(Variant(1, order=False), *args)


def test_prebuild_builds_the_ordered_split_for_sm90a_only():
    """The ordered 2-split (cp.async and bulk at head_dim 128) is prebuilt where ordered_split
    takes it; the other clusters for every arch."""
    specs = [s for s in qsa_warmup.all_specs(16, 128, 64, 1) if s.family == "qsa_decode_cluster"]
    ordered = [s for s in specs if s.param_dict["order"]]
    assert len(ordered) == 2 and {s.param_dict["cluster"] for s in ordered} == {2}
    for spec in ordered:
        assert qsa.OP.prebuilt_on(spec, "sm_90a")
        assert not any(qsa.OP.prebuilt_on(spec, a) for a in ("sm_100a", "sm_103a", "sm_107a"))
    assert all(qsa.OP.prebuilt_on(s, "sm_100a") for s in specs if not s.param_dict["order"])
    assert not any(s.param_dict["order"] for s in qsa_warmup.all_specs(16, 64, 64, 1)
                   if s.family == "qsa_decode_cluster")  # fmt: skip


# -- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("shape", GPU_SHAPES[:2] + GPU_SHAPES[4:])
@pytest.mark.parametrize("splits", [2, 3, 4, 8])
def test_gpu_cluster_split_k_in_row_order(shape, splits):
    """Clusters after the slot pass taking the rows longest first: each cluster reads its row
    from the slot pass's order, so every row is still written once, empty rows as zeros."""
    case = add_hazards(make_case(rows=7, device="cuda", seed=23 + splits, **shape))
    run_kernels(args_of(case), num_splits=splits, order=True)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
@pytest.mark.usefixtures("strict")
@pytest.mark.parametrize("splits", [2, 4])
def test_gpu_cluster_row_order_over_waves(splits):
    """Many rows of varied counts (several waves of clusters, the order a real permutation)."""
    shape = dict(hq=16, hkv=2, d=128, page=64, topk=700, width=12, num_blocks=400)
    case = make_case(rows=300, device="cuda", seed=5, combined=True, **shape)
    run_kernels(args_of(case), num_splits=splits, order=True)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, topk, splits, order",
    [(80, 4096, 2, True), (104, 4096, 1, False), (80, 2048, 2, True), (104, 2048, 1, False),
     (56, 2048, 2, True), (40, 4096, 2, False), (80, 1024, 1, False)],
)  # fmt: skip
def test_gpu_long_selections_split_past_a_wave(request, rows, topk, splits, order):
    """Hkv 8 at head_dim 128 (sm_90): from topk 2048 the 2-split below 832 pairs, in row
    order from 384 (448 and 640 pairs here; 320 in index order), the single pass from 832, and
    below topk 2048 from 512."""
    from jit_kernels import capability

    if capability(0) != SM90:
        pytest.skip("the long-selection crossover is sm_90's")
    seen = request.getfixturevalue("planned")
    case = _gpu_case(rows, (16, 8, 128, 64, topk, True), seed=rows + topk)
    got = qsa.qsa_sparse_paged_attention(*args_of(case))
    torch.cuda.synchronize()
    assert seen[-1].num_splits == splits and not seen[-1].short
    assert bool(seen[-1].order) == order
    assert_close(got, ref_of(case))
