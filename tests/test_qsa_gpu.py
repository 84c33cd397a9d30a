"""QSA fp8 sparse paged decode on the GPU: single pass, cluster split-K, dispatch, hazards,
q magnitudes, a cache over 4 GiB, CUDA graphs, warm-up. Results are compared against the
float64 reference of tests/test_qsa.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import (
    qsa_sparse_paged_attention,
    qsa_sparse_paged_decode,
    warmup_qsa_fp8_decode,
)

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of

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
    case = add_hazards(make_case(rows=7, device="cuda", seed=11 + splits, combined=splits % 2 == 1,
                                 **shape))
    qsa._run_kernels(*args_of(case), num_splits=splits, fused=fused)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


# The round-5 opt-in variants (tools/bench_qsa.py OPT_IN): single-pass slot lookahead and
# stage configs, an 8-warp cluster. (num_splits, config, slot_ahead)
OPT_IN = [(1, None, 2), (1, None, 3), (1, (4, 4, 3), 1), (1, (4, 4, 3), 2), (4, (8, 3, 1), None),
          (2, (8, 3, 1), None), (8, (4, 6, 1), None), (4, (8, 5, 1), None)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", OPT_IN)
@pytest.mark.parametrize("topk, hq, hkv", [(40, 8, 2), (77, 16, 1), (1000, 64, 4)])
def test_gpu_opt_in_variants(variant, topk, hq, hkv, strict):
    """Every opt-in variant on short (fewer chunks than the lookahead) and long selections,
    with the -1 / valid-count / bad-request hazards."""
    splits, config, ahead = variant
    case = add_hazards(make_case(rows=9, hq=hq, hkv=hkv, d=128, page=64, topk=topk,
                                 width=-(-topk // 64) + 3, num_blocks=60, device="cuda",
                                 seed=topk + splits, combined=topk % 2 == 0))
    case["out"].fill_(float("nan"))
    qsa._run_kernels(*args_of(case), num_splits=splits, config=config, slot_ahead=ahead)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
def test_gpu_opt_in_flips_with_warmup(jit_cache, strict, monkeypatch):
    """The one-line flips (SINGLE_PASS_128, ONE_WAVE_CLUSTER_128): warm-up compiles what the
    flipped dispatcher then launches, and the results stay exact."""
    monkeypatch.setattr(qsa, "SINGLE_PASS_128", (4, 4, 3, 2))
    monkeypatch.setattr(qsa, "ONE_WAVE_CLUSTER_128", (8, 5, 1))
    kv = torch.zeros(60, 2, 64, 256, dtype=torch.uint8, device="cuda")
    kv.view(torch.float8_e4m3fn).copy_(torch.randn(kv.shape, device="cuda").to(torch.float8_e4m3fn))
    ready = warmup_qsa_fp8_decode(kv, torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
                                  num_query_heads=16, selection_width=1000)
    assert ("qsa_decode", (8, 128, 4, 4, 3, 2)) in ready
    assert any(p[2:5] == (8, 5, 1) for name, p in ready if name == "qsa_decode_cluster")
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")  # everything below was warmed up
    k_cache, v_cache = kv.transpose(1, 2).split(128, dim=-1)
    # rows=7 through the dispatcher: a 4-CTA one-wave cluster; the decode: the single pass
    assert qsa.split_count(7, 2, 1000) == 4
    for fn in (qsa_sparse_paged_attention, qsa_sparse_paged_decode):
        case = make_case(rows=7, hq=16, hkv=2, d=128, page=64, topk=1000, width=20,
                         num_blocks=60, num_requests=3, device="cuda", seed=5)
        case.update(k_cache=k_cache, v_cache=v_cache)
        case = add_hazards(case)
        got = fn(*args_of(case))
        torch.cuda.synchronize()
        assert_close(got, ref_of(case))
        assert (got[1] == 0).all() and (got[3] == 0).all()


@pytest.mark.gpu
def test_gpu_bad_split_arguments(strict):
    case = make_case(rows=2, device="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        qsa._run_kernels(*args_of(case), num_splits=9)
    with pytest.raises(ValueError, match="fused"):  # no cluster, no in-kernel slots
        qsa._run_kernels(*args_of(case), num_splits=1, fused=True)
    with pytest.raises(ValueError, match="slot_ahead"):
        qsa._run_kernels(*args_of(case), slot_ahead=5)
    with pytest.raises(ValueError, match="config"):
        qsa._run_kernels(*args_of(case), config=(4, 9, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, topk", [(4, 256), (2, 2048), (20, 1000)])
def test_gpu_dispatch_with_cluster_split_k(rows, topk, strict):
    """The dispatcher's cluster plan and its warm-up."""
    kv = torch.zeros(8, 4, 64, 256, dtype=torch.uint8, device="cuda")
    ready = warmup_qsa_fp8_decode(kv, torch.zeros(2, 4, dtype=torch.int32, device="cuda"),
                                  num_query_heads=32, selection_width=topk)
    assert "qsa_decode_cluster" in {name for name, _ in ready}
    case = make_case(rows=rows, hq=32, hkv=4, d=128, page=64, topk=topk, width=-(-topk // 64) + 2,
                     num_blocks=200, num_requests=3, device="cuda", seed=rows)
    got = qsa_sparse_paged_attention(*args_of(add_hazards(case)))
    torch.cuda.synchronize()
    assert_close(got, ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("factor", [2.0**-20, 2.0**-7, 2.0**12])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_q_magnitudes(factor, splits, strict):
    """QK runs in fp16 on a per-head power-of-two rescale of q: tiny and huge q stay exact."""
    case = make_case(rows=4, hq=8, hkv=2, d=128, page=32, topk=96, width=4, num_blocks=12,
                     device="cuda", seed=13)
    case["q"] = (case["q"].float() * factor).to(torch.bfloat16)
    case["q"][0, 0, :64] *= 2.0**-30  # a head whose halves differ by 2^30
    case["softmax_scale"] = case["softmax_scale"] / factor
    qsa._run_kernels(*args_of(case), num_splits=splits)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [qsa_sparse_paged_decode, qsa_sparse_paged_attention])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_gpu_hazards(fn, dtype, strict):
    case = add_hazards(make_case(rows=8, hq=16, hkv=2, d=128, page=16, topk=70, width=6,
                                 num_blocks=20, device="cuda", seed=3, dtype=dtype))
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
def test_gpu_matches_torch_path():
    case = make_case(rows=6, hq=32, hkv=4, d=128, page=64, topk=256, width=8, num_blocks=32,
                     device="cuda", seed=21)
    got = qsa_sparse_paged_attention(*args_of(case)).clone()
    torch_out = torch.empty_like(got)
    qsa.qsa_decode_torch(*args_of({**case, "out": torch_out}))
    assert (got.float() - torch_out.float()).abs().max().item() < 2e-2


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
    case = make_case(rows=2, hq=8, hkv=1, d=d, page=page, topk=128, width=6, num_requests=1,
                     num_blocks=6, device="cuda", seed=1)
    case.update(k_cache=k_cache, v_cache=v_cache,
                block_table=torch.tensor([top], dtype=torch.int32, device="cuda"))
    cluster = lambda *a: qsa._run_kernels(*a, num_splits=2, fused=True) or a[6]  # noqa: E731
    for fn in (qsa_sparse_paged_decode, qsa_sparse_paged_attention, cluster):
        case["out"].fill_(float("nan"))
        got = fn(*args_of(case))
        torch.cuda.synchronize()
        small = dict(case, k_cache=k_cache[top], v_cache=v_cache[top],
                     block_table=torch.arange(6, dtype=torch.int32).view(1, 6))
        assert_close(got, ref_of(small))
    del kv


GRAPH_RUNS = {
    "decode": lambda args: qsa_sparse_paged_decode(*args),
    "dispatch": lambda args: qsa_sparse_paged_attention(*args),
    "cluster8_fused": lambda args: qsa._run_kernels(*args, num_splits=8, fused=True),
    "cluster2_slots": lambda args: qsa._run_kernels(*args, num_splits=2, fused=False),
    "decode_ahead2": lambda args: qsa._run_kernels(*args, slot_ahead=2),
    "decode_s4_ahead2": lambda args: qsa._run_kernels(*args, config=(4, 4, 3), slot_ahead=2),
    "cluster4_w8": lambda args: qsa._run_kernels(*args, num_splits=4, config=(8, 3, 1)),
    "cluster8_s6": lambda args: qsa._run_kernels(*args, num_splits=8, config=(4, 6, 1)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("run", list(GRAPH_RUNS))
def test_gpu_cuda_graph(rows, run, strict):
    """Capture once, replay with fresh inputs copied into the static buffers."""
    case = make_case(rows=rows, hq=64, hkv=4, d=128, page=64, topk=256, width=8, num_blocks=48,
                     num_requests=4, device="cuda", seed=2)
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
        fresh = make_case(rows=rows, hq=64, hkv=4, d=128, page=64, topk=256, width=8,
                          num_blocks=48, num_requests=4, device="cuda", seed=seed)
        for key in ("q", "k_cache", "v_cache", "logical_indices", "block_table", "token_to_req",
                    "output_gate"):
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
    assert {name for name, _ in ready} == {"qsa_slots", "qsa_decode", "qsa_decode_cluster"}
    # Every kernel a call can reach is now loaded: a later call compiles nothing.
    os.environ["FLASHINFER_JIT_DISABLE"] = "1"
    try:
        k_cache, v_cache = kv.transpose(1, 2).split(128, dim=-1)
        # rows * Hkv = 4, topk 512: the dispatcher takes a fused 4-CTA cluster
        case = make_case(rows=2, hq=16, hkv=2, d=128, page=64, topk=512, width=4, num_blocks=8,
                         num_requests=2, device="cuda")
        assert qsa.split_count(2, 2, 512) == 4
        case.update(k_cache=k_cache, v_cache=v_cache)
        qsa_sparse_paged_attention(*args_of(case))
        qsa_sparse_paged_decode(*args_of(case))
    finally:
        del os.environ["FLASHINFER_JIT_DISABLE"]
