"""flashinfer_jit.deep_gemm on a GPU: every kernel family (TMA, ring, direct, generic) against
the float64 reference with 1-D and 2-D lengths, clean_logits both ways, float32 and bfloat16
logits; repeat calls bitwise equal; the native entry's values; CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

import flashinfer_jit.deep_gemm as dg
import flashinfer_jit.mqa_logits as mq

from . import test_mqa_logits_gpu
from .deep_gemm_cases import check, make_case, visible
from .test_deep_gemm import clean_writes_only_the_tail

pytestmark = pytest.mark.gpu
LENS = [0, 1, 2, 63, 64, 65, 200, 1000, 2049]
# The native GPU tests' variants (the fixture forces each, strict: no fallback to torch);
# auto is the TMA kernel on sm_90 at head_dim 128.
VARIANTS = ["auto", "ring_3x6", "portable", "direct_2x2", "generic"]


@pytest.fixture
def variant(request, monkeypatch):
    """The DeepGEMM surface's call path on the native op's variant ``request.param``."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    return dg.OP.runner(test_mqa_logits_gpu.variant_options(request.param))


def call(case, clean_logits=False, logits_dtype=torch.float32, runner=None):
    """The public ``fp8_fp4_paged_mqa_logits``, or ``runner`` (a variant) with its arguments."""
    meta = dg.get_paged_mqa_logits_metadata(
        case.context_lens, case.kv_cache.shape[1], dg.get_num_sms()
    )
    args = (case.kv_cache, case.weights, case.context_lens, case.block_table, meta,
            case.max_context_len, clean_logits, logits_dtype)  # fmt: skip
    if runner is not None:  # into NaN: a visible position left unwritten fails check()
        rows, cols = case.q.shape[0] * case.q.shape[1], mq.padded_seq_len(case.max_context_len)
        out = torch.full((rows, cols), float("nan"), dtype=logits_dtype, device=case.q.device)
        return runner.run((case.q, *args, out, None))  # out, indices
    return dg.fp8_fp4_paged_mqa_logits((case.q, None), *args)


@pytest.mark.parametrize("variant", VARIANTS, indirect=True)
@pytest.mark.parametrize("two_d", [False, True], ids=["lens1d", "lens2d"])
@pytest.mark.parametrize("clean_logits", [False, True], ids=["raw", "clean"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("next_n,heads", [(1, 64), (2, 32), (2, 64)])
def test_gpu_matches_reference(variant, two_d, clean_logits, logits_dtype, next_n, heads):
    case = make_case(LENS, next_n, heads, two_d=two_d, seed=next_n + heads, device="cuda")
    logits = call(case, clean_logits, logits_dtype, variant)
    assert logits.dtype == logits_dtype and logits.is_cuda
    check(logits, case, clean_logits)


@pytest.mark.parametrize("block_kv", [32, 128])
@pytest.mark.parametrize("next_n,heads", [(3, 32), (4, 64)])
def test_gpu_other_blocks_and_depths(block_kv, next_n, heads, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = make_case(LENS, next_n, heads, block_kv=block_kv, two_d=True, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        check(call(case, True, dtype), case, clean_logits=True)


def test_gpu_repeat_calls_are_bitwise_equal_and_match_native(monkeypatch):
    """DeepGEMM's test compares 20 repeats bitwise over the visible positions."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = make_case(LENS, 2, 64, two_d=False, device="cuda")
    rows = torch.tensor(visible(case.context_lens, 2), device="cuda")
    seen = torch.arange(case.max_context_len, device="cuda")[None, :] < rows[:, None]
    first = call(case).masked_fill(~seen, 0)
    for _ in range(5):
        assert torch.equal(call(case).masked_fill(~seen, 0), first)
    native = mq.fp8_paged_mqa_logits(
        case.q, case.kv_cache, case.weights, case.block_table, case.context_lens,
        case.max_context_len,
    )  # fmt: skip
    assert torch.equal(native.masked_fill(~seen, 0), first)


@pytest.mark.parametrize("two_d", [False, True], ids=["lens1d", "lens2d"])
def test_gpu_replays_read_new_lengths_in_place(two_d, monkeypatch):
    """Repeat calls replay the stored launch, reading the lengths in place (2-D lens: the
    newest slot's column at its offset): new values in the same tensor, then a new tensor."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = make_case(LENS, 2, 64, two_d=two_d, seed=3, device="cuda")
    full = case.context_lens.clone()
    shorter = torch.minimum(full, torch.full_like(full, 130))
    dg.OP.default.replays.clear()
    check(call(case, True), case, clean_logits=True)  # the full path stores the launch
    stored = len(dg.OP.default.replays)
    assert stored == 1
    for source in (shorter, full):
        case.context_lens.copy_(source)
        check(call(case, True), case, clean_logits=True)
    case.context_lens = shorter.clone()
    check(call(case, True), case, clean_logits=True)
    assert len(dg.OP.default.replays) == stored  # every later call replayed


def test_gpu_strided_pool(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    dense = make_case(LENS, 2, 64, two_d=True, seed=9, device="cuda")
    padded = make_case(LENS, 2, 64, two_d=True, seed=9, block_pad=132, device="cuda")
    dg.OP.default.replays.clear()
    a, b = call(dense, True), call(padded, True)
    check(b, padded, clean_logits=True)
    assert torch.equal(a, b)
    assert len(dg.OP.default.replays) == 1  # the gathered copy's launch is not stored
    check(call(padded, True), padded, clean_logits=True)  # gathered again, not replayed


def test_gpu_cuda_graph_with_clean_and_metadata(monkeypatch):
    """Metadata, logits and the clean pass captured together; replays follow new lengths."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = make_case([300, 1000, 64, 2049], 2, 64, two_d=True, device="cuda")
    full = case.context_lens.clone()
    shorter = full.clone()  # every request shorter (a new schedule), the oldest slot halved
    shorter[:, -1] -= torch.tensor([299, 100, 1, 1000], dtype=torch.int32, device="cuda")
    shorter[:, 0] = torch.minimum(shorter[:, 0] // 2, shorter[:, -1])
    lens = full.clone()
    call(case, True)  # compile and load outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            meta = dg.get_paged_mqa_logits_metadata(lens, 64, dg.get_num_sms())
            logits = dg.fp8_paged_mqa_logits(
                case.q, case.kv_cache, case.weights, lens, case.block_table, meta,
                case.max_context_len, True,
            )  # fmt: skip
    for source in (shorter, full):
        lens.copy_(source)
        case.context_lens = source
        graph.replay()
        torch.cuda.synchronize()
        check(logits, case, clean_logits=True)


def test_gpu_clean_kernel_writes_only_the_tail(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # the kernel, not the masked fill
    clean_writes_only_the_tail("cuda")
