"""QSA fp8 sparse paged decode on the GPU: single pass, cluster split-K, dispatch, hazards,
q magnitudes, a cache over 4 GiB, CUDA graphs, warm-up. Results are compared against the
float64 reference of tests/test_qsa.py.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa import (
    qsa_sparse_paged_attention,
    qsa_sparse_paged_decode,
    warmup_qsa_fp8_decode,
)
from flashinfer_jit.qsa.op import run_kernels
from flashinfer_jit.qsa.short import short_min_pairs

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of
from .test_qsa_short_dispatch import planned  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


# -- GPU ---------------------------------------------------------------------------------------
@pytest.fixture
def strict(monkeypatch):
    """Any fallback to the torch path is an error: the kernels must serve these calls."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", raising=False)


GPU_SHAPES = [
    dict(hq=16, hkv=1, d=128, page=64, topk=200, width=5, num_blocks=40),
    dict(hq=8, hkv=2, d=64, page=16, topk=77, width=8, num_blocks=30),
    dict(hq=5, hkv=1, d=256, page=128, topk=300, width=3, num_blocks=12),
    dict(hq=4, hkv=4, d=128, page=32, topk=64, width=4, num_blocks=20),
    dict(hq=64, hkv=4, d=128, page=64, topk=512, width=16, num_blocks=64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("combined", [False, True])
def test_gpu_single_pass(shape, combined, strict):
    case = make_case(rows=5, device="cuda", combined=combined, seed=7, **shape)
    got = qsa_sparse_paged_decode(*args_of(case))
    torch.cuda.synchronize()
    assert_close(got, ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:4])
@pytest.mark.parametrize("splits, fused", [(2, None), (3, False), (7, None), (8, False)])
def test_gpu_cluster_split_k(shape, splits, fused, strict):
    """Splits as one cluster merged through DSMEM, with and without in-kernel slots."""
    case = add_hazards(
        make_case(rows=7, device="cuda", seed=11 + splits, combined=splits % 2 == 1, **shape)
    )
    run_kernels(args_of(case), num_splits=splits, fused=fused)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", range(2, qk.CLUSTER_MAX + 1))
@pytest.mark.parametrize("config", [qk.WAVE_CONFIG, qk.CLUSTER_PAIR_CONFIG])
@pytest.mark.parametrize("topk, hq", [(40, 16), (77, 3), (1000, 64)])
def test_gpu_one_wave_splits(splits, config, topk, hq, strict):
    """The one-wave split's kernels (qsa_kernels.launch_split): every cluster size at both
    of its configs, two chunks a step, in-kernel slots; selections shorter than a chunk per
    split and longer than the stages hold, odd group sizes, with the hazards."""
    overrides = dict(fused=True, config=config, pair=True)
    _check_launch(rows=5, hq=hq, hkv=1 if hq % 4 else 4, topk=topk, splits=splits, **overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", range(2, qk.WAVE_SLOT_PASS_SPLITS + 1))
@pytest.mark.parametrize("topk, hq", [(77, 3), (3000, 16)])
def test_gpu_one_wave_splits_after_the_slot_pass(splits, topk, hq, strict):
    """The one-wave kernels after the slot pass (a split's slots past the in-kernel list)."""
    overrides = dict(fused=False, config=qk.WAVE_CONFIG, pair=True)
    _check_launch(rows=5, hq=hq, hkv=1 if hq % 4 else 4, topk=topk, splits=splits, **overrides)


def _check_launch(rows, hq, hkv, topk, splits, **overrides):
    """``_run_kernels`` with ``overrides`` on a D=128, page-64 case with the hazards (the
    combined cache at even topk) into a NaN-poisoned out, against the reference; rows 1
    and 3 (a zero count, a bad request) must be all zeros."""
    case = add_hazards(
        make_case(rows=rows, hq=hq, hkv=hkv, d=128, page=64, topk=topk, width=-(-topk // 64) + 3,
                  num_blocks=max(60, 3 * (-(-topk // 64) + 3)), device="cuda", seed=topk + splits,
                  combined=topk % 2 == 0)
    )  # fmt: skip
    case["out"].fill_(float("nan"))
    run_kernels(args_of(case), num_splits=splits, **overrides)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


# Launch choices other than the shipped ones (tools/bench_qsa.py --lean compares them):
# (num_splits, overrides of _run_kernels). Bulk copies need the combined cache (even topk
# below); the others run on both layouts.
OPT_IN = [
    (1, dict(slot_entries=1, pdl=False)),
    (1, dict(slot_entries=8, pdl=True)),
    (1, dict(tmma=False, lean=False)),  # the single pass before its loop forms
    (1, dict(tmma=False, lean=True)),
    (1, dict(bulk=False)),
    (1, dict(config=(4, 4, 3))),
    (2, dict(bulk=True)),
    (8, dict(bulk=True, config=(4, 3, 4))),
    (4, dict(config=(8, 3, 1), pdl=True)),
    (2, dict(fused=False, slot_entries=2)),
    (1, dict(tmma=True, lean=False)),  # groups <= 8 (hq 8, hkv 2 below); ignored at 16
    (1, dict(tmma=True, lean=True, bulk=False)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", OPT_IN)
@pytest.mark.parametrize("topk, hq, hkv", [(40, 8, 2), (77, 16, 1), (1000, 64, 4)])
def test_gpu_opt_in_variants(variant, topk, hq, hkv, strict):
    """Every alternative launch choice on short (fewer chunks than stages) and long
    selections, with the -1 / valid-count / bad-request hazards."""
    splits, overrides = variant
    if overrides.get("bulk") and topk % 2:
        pytest.skip("bulk copies need the combined cache")
    _check_launch(rows=9, hq=hq, hkv=hkv, topk=topk, splits=splits, **overrides)


@pytest.mark.gpu
def test_gpu_bad_split_arguments(strict):
    case = make_case(rows=2, device="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        run_kernels(args_of(case), num_splits=9)
    with pytest.raises(ValueError, match="fused"):  # no cluster, no in-kernel slots
        run_kernels(args_of(case), num_splits=1, fused=True)
    with pytest.raises(ValueError, match="slot_entries"):
        run_kernels(args_of(case), slot_entries=3)
    with pytest.raises(ValueError, match="bulk copies need head_dim 128"):  # d=64, plain cache
        run_kernels(args_of(case), bulk=True)
    with pytest.raises(ValueError, match="config"):
        run_kernels(args_of(case), config=(4, 9, 1))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, topk", [(4, 256), (6, 256), (2, 2048), (20, 1000), (16, 4096), (8, 4096)]
)
def test_gpu_dispatch_with_cluster_split_k(rows, topk, request):
    """The dispatcher's cluster plan and its warm-up (topk 4096 over 64 and 32 pairs: the
    one-wave split of 2 and 3 CTAs after the slot pass)."""
    seen = request.getfixturevalue("planned")  # strict; each call's variant
    kv = torch.zeros(8, 4, 64, 256, dtype=torch.uint8, device="cuda")
    ready = warmup_qsa_fp8_decode(
        kv,
        torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
        num_query_heads=32,
        selection_width=topk,
    )
    assert "qsa_decode_cluster" in {name for name, _ in ready}
    seen.clear()  # the call's plan alone (not warm-up's)
    case = make_case(
        rows=rows,
        hq=32,
        hkv=4,
        d=128,
        page=64,
        topk=topk,
        width=-(-topk // 64) + 2,
        num_blocks=200,
        num_requests=3,
        device="cuda",
        seed=rows,
    )
    got = qsa_sparse_paged_attention(*args_of(add_hazards(case)))
    torch.cuda.synchronize()
    want = qsa_plan.dispatch_split(
        rows, 4, topk, 128, case["k_cache"].dtype, 0, group=8, bulk=False
    )
    assert seen == [want] and want.num_splits > 1, seen
    if topk == 4096:  # (the H200's clusters) its slots past the kernel's list: the slot pass
        assert want.num_splits == {16: 2, 8: 3}[rows] and not qk.fused_fits(topk, want.num_splits)
    assert_close(got, ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [2.0**-20, 2.0**-7, 2.0**12])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_q_magnitudes(factor, splits, strict):
    """QK runs in fp16 on a per-head power-of-two rescale of q: tiny and huge q stay exact."""
    case = make_case(
        rows=4, hq=8, hkv=2, d=128, page=32, topk=96, width=4, num_blocks=12, device="cuda", seed=13
    )
    case["q"] = (case["q"].float() * factor).to(torch.bfloat16)
    case["q"][0, 0, :64] *= 2.0**-30  # a head whose halves differ by 2^30
    case["softmax_scale"] = case["softmax_scale"] / factor
    run_kernels(args_of(case), num_splits=splits)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [qsa_sparse_paged_decode, qsa_sparse_paged_attention])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_gpu_hazards(fn, dtype, strict):
    case = add_hazards(
        make_case(
            rows=8,
            hq=16,
            hkv=2,
            d=128,
            page=16,
            topk=70,
            width=6,
            num_blocks=20,
            device="cuda",
            seed=3,
            dtype=dtype,
            combined=dtype == torch.uint8,  # the combined cache: bulk copies (D=128)
        )
    )
    got = fn(*args_of(case))
    torch.cuda.synchronize()
    assert_close(got, ref_of(case))
    assert (got[1] == 0).all() and (got[3] == 0).all() and (got[4] == 0).all()


@pytest.mark.gpu
def test_gpu_rows_zero_and_topk_zero(strict):
    case = make_case(rows=0, device="cuda")
    qsa_sparse_paged_attention(*args_of(case))
    case = make_case(rows=3, topk=0, device="cuda")
    got = qsa_sparse_paged_attention(*args_of(case))
    torch.cuda.synchronize()
    assert (got == 0).all()


@pytest.mark.gpu
def test_gpu_cache_over_4gib(strict):
    """Selected pages sit past byte 2**32 of the cache: offsets need 64-bit math."""
    d, page, hkv = 128, 64, 1
    block_bytes = page * hkv * 2 * d
    num_blocks = (5 << 30) // block_bytes
    kv = torch.empty(num_blocks, hkv, page, 2 * d, dtype=torch.uint8, device="cuda")
    top = list(range(num_blocks - 6, num_blocks))
    gen = torch.Generator().manual_seed(0)
    fill = (torch.randn(len(top), hkv, page, 2 * d, generator=gen) * 2).to(torch.float8_e4m3fn)
    kv[top] = fill.view(torch.uint8).cuda()
    k_cache, v_cache = kv.transpose(1, 2).split(d, dim=-1)
    case = make_case(
        rows=2,
        hq=8,
        hkv=1,
        d=d,
        page=page,
        topk=128,
        width=6,
        num_requests=1,
        num_blocks=6,
        device="cuda",
        seed=1,
    )
    case.update(
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=torch.tensor([top], dtype=torch.int32, device="cuda"),
    )

    def cluster(*args, bulk: bool):
        run_kernels(args, num_splits=2, fused=True, bulk=bulk)
        return args[6]

    for fn in (
        qsa_sparse_paged_decode,  # bulk copies (the combined cache)
        qsa_sparse_paged_attention,  # a one-wave cluster: cp.async
        functools.partial(cluster, bulk=True),
        functools.partial(cluster, bulk=False),
    ):
        case["out"].fill_(float("nan"))
        got = fn(*args_of(case))
        torch.cuda.synchronize()
        small = dict(
            case,
            k_cache=k_cache[top],
            v_cache=v_cache[top],
            block_table=torch.arange(6, dtype=torch.int32).view(1, 6),
        )
        assert_close(got, ref_of(small))
    del kv


GRAPH_RUNS = {
    "decode": lambda args: qsa_sparse_paged_decode(*args),
    "dispatch": lambda args: qsa_sparse_paged_attention(*args),
    "cluster8_fused": lambda args: run_kernels(args, num_splits=8, fused=True),
    "cluster2_slots": lambda args: run_kernels(args, num_splits=2, fused=False),
    "decode_pdl_slots4": lambda args: run_kernels(args, pdl=True, slot_entries=4),
    "cluster4_pdl": lambda args: run_kernels(args, num_splits=4, pdl=True),
    "cluster2_pdl": lambda args: run_kernels(args, num_splits=2, pdl=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("run", list(GRAPH_RUNS))
def test_gpu_cuda_graph(rows, run, strict):
    """Capture once, replay with fresh inputs copied into the static buffers. rows=40 on the
    combined cache (bulk copies; its 2-split clusters fill more than one CTA per SM)."""
    shape = dict(
        rows=rows, hq=64, hkv=4, d=128, page=64, topk=256, width=8, num_blocks=48,
        num_requests=4, device="cuda", combined=rows == 40,
    )  # fmt: skip
    case = make_case(**shape, seed=2)
    fn = lambda *args: GRAPH_RUNS[run](args)  # noqa: E731
    fn(*args_of(case))  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args_of(case))
        with torch.cuda.graph(graph, stream=stream):
            fn(*args_of(case))
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (99, 100):  # replays twice with fresh inputs in the static buffers
        fresh = make_case(**shape, seed=seed)
        for key in (
            "q",
            "k_cache",
            "v_cache",
            "logical_indices",
            "block_table",
            "token_to_req",
            "output_gate",
        ):
            case[key].copy_(fresh[key])
        case["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
def test_gpu_warmup_then_no_compile(jit_cache, strict):
    kv = torch.zeros(8, 2, 64, 256, dtype=torch.uint8, device="cuda")
    bt = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    ready = warmup_qsa_fp8_decode(kv, bt, num_query_heads=16, selection_width=512)
    shipped = qsa.OP.default.options
    single = "qsa_decode_form" if shipped.tmma or shipped.lean else "qsa_decode"  # its loop form
    expected = {"qsa_slots", single, "qsa_decode_cluster"}
    if qsa_plan.capability(0) == (9, 0):  # and sm_90's short single pass (qsa/short.py)
        expected.add("qsa_decode_short")
    assert {name for name, _ in ready} == expected
    # Every kernel a call can reach is now loaded: a later call compiles nothing.
    os.environ["FLASHINFER_JIT_DISABLE"] = "1"
    try:
        k_cache, v_cache = kv.transpose(1, 2).split(128, dim=-1)
        # topk 512, Hkv 2: rows=2 takes a fused 4-CTA cluster of cp.async gathers (16 CTAs),
        # rows=80 a fused 2-CTA cluster of bulk copies (320 CTAs: more than two waves); many
        # rows the single pass or (sm_90) the short pass, 2 warps a row, 1 from 31 an SM
        split = functools.partial(qsa_plan.dispatch_split, group=8, bulk=True)
        assert [split(r, 2, 512, 128, torch.uint8, 0).num_splits for r in (2, 80)] == [4, 2]
        sms = qsa_plan.sm_count(0)
        for rows in (2, 80, -(-short_min_pairs(sms, 512, True) // 2), -(-31 * sms // 2)):
            case = make_case(
                rows=rows,
                hq=16,
                hkv=2,
                d=128,
                page=64,
                topk=512,
                width=4,
                num_blocks=8,
                num_requests=2,
                device="cuda",
            )
            case.update(k_cache=k_cache, v_cache=v_cache)
            qsa_sparse_paged_attention(*args_of(case))
            qsa_sparse_paged_decode(*args_of(case))
    finally:
        del os.environ["FLASHINFER_JIT_DISABLE"]
