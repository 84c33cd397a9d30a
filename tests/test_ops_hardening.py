"""The ops under hostile inputs (issue 19, items 11-13): a QSA pool whose unused blocks
hold NaN codes, a backend that cannot be built, bool and float sizes, outputs that overlap.

The GPU tests (marker ``gpu``) skip without one; they run on the H200."""

from __future__ import annotations

import math
import time

import pytest
import torch

from flashinfer_jit import mla_kv_pack as mkp
from flashinfer_jit import qsa
from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8
from flashinfer_jit.mqa_logits import min_block_table_width, padded_seq_len
from flashinfer_jit.qsa.reference import qsa_decode_torch
from jit_kernels import PTR, KernelFamily, KernelUnavailable, prepare
from jit_kernels import family as family_mod

from .test_mla_kv_pack import make_inputs as mla_inputs
from .test_mqa_logits import _args as mqa_args
from .test_mqa_logits import _call as mqa_call
from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of

NAN_CODE = 0x7F  # e4m3 NaN


# -- item 11: NaN bytes in unused pool blocks ------------------------------------------------
def _poisoned(case: dict) -> dict:
    """The case with block 0 (which unattended entries gather) unused and every unused
    block's K and V bytes set to the e4m3 NaN code."""
    table, nb = case["block_table"].clone(), case["k_cache"].shape[0]
    used = {int(b) for b in table.flatten().tolist() if 0 <= b < nb}
    if 0 in used:
        spare = min(set(range(1, nb)) - used)
        table[table == 0] = spare
        used = (used - {0}) | {spare}
    unused = torch.tensor(sorted(set(range(nb)) - used), device=table.device)
    assert 0 in unused.tolist()
    poisoned = {**case, "block_table": table, "out": torch.full_like(case["out"], math.nan)}
    clean = {**poisoned, "out": torch.full_like(case["out"], math.nan)}
    storage = case["k_cache"]._base if case["k_cache"]._base is not None else None
    k, v = case["k_cache"].clone(), case["v_cache"].clone()
    if storage is not None:  # the combined cache: K and V are views of one pool
        pool = storage.clone()
        d = case["k_cache"].shape[-1]
        k, v = pool.transpose(1, 2).split(d, dim=-1)
        clean_pool = pool.clone()
        clean["k_cache"], clean["v_cache"] = clean_pool.transpose(1, 2).split(d, dim=-1)
        pool.view(torch.uint8)[unused] = NAN_CODE
    else:
        clean["k_cache"], clean["v_cache"] = k.clone(), v.clone()
        k.view(torch.uint8)[unused] = NAN_CODE
        v.view(torch.uint8)[unused] = NAN_CODE
    poisoned["k_cache"], poisoned["v_cache"] = k, v
    return clean, poisoned


QSA_SHAPES = [
    dict(rows=2, hq=8, hkv=2, d=64, page=16, topk=40, num_blocks=24),
    dict(rows=8, hq=16, hkv=2, d=128, page=16, topk=70, width=6, num_blocks=20),
    dict(rows=300, hq=16, hkv=4, d=128, page=64, topk=64, width=2, num_blocks=12),
]


@pytest.mark.parametrize("shape", QSA_SHAPES)
@pytest.mark.parametrize("combined", [False, True])
def test_qsa_torch_path_ignores_nan_in_unused_blocks(shape, combined):
    clean, poisoned = _poisoned(add_hazards(make_case(seed=5, combined=combined, **shape)))
    want = qsa_decode_torch(*args_of(clean))
    got = qsa_decode_torch(*args_of(poisoned))
    assert not torch.isnan(got).any(), f"{int(torch.isnan(got).any(-1).any(-1).sum())} NaN rows"
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", QSA_SHAPES)
@pytest.mark.parametrize("combined", [False, True])
def test_gpu_qsa_ignores_nan_in_unused_blocks(shape, combined, monkeypatch):
    """The kernels (strict: a fallback to torch is an error) and the torch path on the GPU,
    each into NaN outputs, against the float64 reference and bit-equal clean or poisoned."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", raising=False)
    case = add_hazards(make_case(seed=5, combined=combined, device="cuda", **shape))
    clean, poisoned = _poisoned(case)
    ref = ref_of(clean)
    for run in (qsa.qsa_sparse_paged_attention, qsa_decode_torch):
        clean["out"].fill_(math.nan)
        poisoned["out"].fill_(math.nan)
        want = run(*args_of(clean)).clone()
        got = run(*args_of(poisoned)).clone()
        torch.cuda.synchronize()
        assert not torch.isnan(got).any(), run.__name__
        assert_close(got, ref)
        assert torch.equal(got, want), run.__name__


# -- item 12: a refusal is remembered --------------------------------------------------------
class _NoCompiler:
    """A builder with no compiler (no CuTe DSL, no bundle): every build is an ImportError."""

    def __init__(self, cache: object = None):
        self.calls = self.lookups = 0
        self.cache = cache if cache is not None else object()

    def lookup(self, spec, arch):  # renders the template and searches the cache
        self.lookups += 1

    def build(self, spec, arch):
        self.calls += 1
        raise ImportError("No module named 'cutlass'")


def _family(builder) -> KernelFamily:
    return KernelFamily(builder, "stub", "stub.py", "_k", ("group",), (PTR,), compiler="cute")


def test_a_refusal_is_remembered_per_params_and_device(monkeypatch):
    monkeypatch.setattr(family_mod, "device_arch", lambda device: "sm_90a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE", raising=False)
    builder = _NoCompiler()
    family = _family(builder)
    for _ in range(3):
        with pytest.raises(KernelUnavailable, match="no compiler"):
            family.get((1,), 0)
    assert builder.calls == 1
    with pytest.raises(KernelUnavailable):
        family.get((2,), 0)
    with pytest.raises(KernelUnavailable):
        family.get((1,), 1)
    assert builder.calls == 3  # other params, another device: tried on their own
    start = time.perf_counter()
    for _ in range(2000):
        try:
            family.get((1,), 0)
        except KernelUnavailable:
            pass
    per_call = (time.perf_counter() - start) / 2000
    assert builder.calls == 3 and per_call < 50e-6, per_call


def test_a_refusal_is_forgotten_when_its_cause_changes(monkeypatch):
    monkeypatch.setattr(family_mod, "device_arch", lambda device: "sm_90a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE", raising=False)
    builder = _NoCompiler()
    family = _family(builder)
    with pytest.raises(KernelUnavailable):
        family.get((1,), 0)
    builder.cache = object()  # another cache (other roots): look again
    with pytest.raises(KernelUnavailable):
        family.get((1,), 0)
    assert builder.calls == 2


def test_prepare_of_refused_kernels_searches_nothing(monkeypatch):
    """prepare() asked the builder for each refused kernel on every call (with JIT disabled
    and nothing prebuilt: 8 files opened a call), not the dict lookup a get pays."""
    monkeypatch.setattr(family_mod, "device_arch", lambda device: "sm_90a")
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE", raising=False)
    builder = _NoCompiler()
    family = _family(builder)
    wanted = [(family, (1,)), (family, (2,))]
    for call in range(3):
        try:
            prepare(wanted, 0)  # raises (1,)'s refusal on the first call
        except KernelUnavailable:
            assert call == 0
        for _, params in wanted:
            with pytest.raises(KernelUnavailable):
                family.get(params, 0)
    assert builder.lookups == 2


@pytest.mark.gpu
def test_gpu_auto_pack_serves_without_retrying_an_unbuildable_backend(monkeypatch, fresh_replays):
    """No DSL and no bundle: auto's first choice (cake at 128 x 128) is refused once,
    then specialized serves every call from the replay, at specialized's host cost."""
    from flashinfer_jit.mla_kv_pack import cake

    builder = _NoCompiler()
    real = cake.family
    stub = KernelFamily(builder, real.family, real.template, real.kernel, real.param_names,
                        real.signature, compiler="cute")  # fmt: skip
    monkeypatch.setattr(cake, "family", stub)
    kv, pe = mla_inputs(128, 128, device="cuda")
    assert mkp.auto_order(128, 128)[0] == "cake"  # sm_90's measured table: cake first here
    key = torch.empty(128, 128, 192, dtype=torch.float8_e4m3fn, device="cuda")
    value = torch.empty(128, 128, 128, dtype=torch.float8_e4m3fn, device="cuda")
    want_key, want_value = concat_mla_kv_quant_fp8(kv.cpu(), pe.cpu())
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    assert builder.calls == 1 and len(mkp.OP.default.replays) == 1
    timings = {}
    for backend in ("auto", "specialized"):
        concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(500):
            concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
        timings[backend] = (time.perf_counter() - start) / 500
        torch.cuda.synchronize()
    assert builder.calls == 1
    assert timings["auto"] < 2 * timings["specialized"] + 10e-6, timings
    assert torch.equal(key.cpu().view(torch.uint8), want_key.view(torch.uint8))
    assert torch.equal(value.cpu().view(torch.uint8), want_value.view(torch.uint8))


# -- item 13: ints are ints; outputs overlap nothing --------------------------------------------
@pytest.mark.parametrize("nope_dim", [True, 128.0, "128"])
def test_mla_nope_dim_must_be_an_int(nope_dim):
    kv, pe = mla_inputs(4, 2)
    with pytest.raises(TypeError, match="nope_dim must be an int"):
        concat_mla_kv_quant_fp8(kv, pe, nope_dim=nope_dim)


def test_mla_outputs_must_not_overlap():
    tokens, heads = 4, 2
    kv, pe = mla_inputs(tokens, heads)
    buf = torch.empty(tokens * heads * 320, dtype=torch.float8_e4m3fn)
    key = buf[: tokens * heads * 192].view(tokens, heads, 192)
    value = buf[tokens * heads * 100 :][: tokens * heads * 128].view(tokens, heads, 128)
    with pytest.raises(ValueError, match="key overlaps value"):
        concat_mla_kv_quant_fp8(kv, pe, key, value)
    over_input = kv.view(torch.float8_e4m3fn)[..., :192]  # key in kv_nope's own bytes
    with pytest.raises(ValueError, match="key overlaps kv_nope"):
        concat_mla_kv_quant_fp8(kv, pe, over_input, torch.empty_like(value))
    # Side by side in one buffer (a fused KV row) is not an overlap.
    row = torch.empty(tokens, heads, 320, dtype=torch.float8_e4m3fn)
    key, value = concat_mla_kv_quant_fp8(kv, pe, row[..., :192], row[..., 192:])
    want_key, want_value = concat_mla_kv_quant_fp8(kv, pe)
    assert torch.equal(row[..., :192].view(torch.uint8), want_key.view(torch.uint8))
    assert torch.equal(row[..., 192:].view(torch.uint8), want_value.view(torch.uint8))


@pytest.mark.parametrize("bad", [True, 70.0])
def test_mqa_sizes_must_be_ints(bad):
    a = mqa_args()
    with pytest.raises(TypeError, match="max_seq_len must be an int"):
        mqa_call(dict(a, max_seq_len=bad))
    with pytest.raises(TypeError, match="max_seq_len must be an int"):
        padded_seq_len(bad)
    with pytest.raises(TypeError, match="block_size must be an int"):
        min_block_table_width(100, bad)


def test_mqa_out_must_not_overlap_an_input():
    a = mqa_args()
    rows, cols = a["q"].shape[0] * a["q"].shape[1], padded_seq_len(a["max_seq_len"])
    out = torch.empty(rows, cols, dtype=torch.float32)
    weights = out.view(-1)[: a["weights"].numel()].view_as(a["weights"])
    weights.copy_(a["weights"])
    with pytest.raises(ValueError, match="out overlaps weights"):
        mqa_call(dict(a, weights=weights), out=out)


def test_qsa_sizes_must_be_ints_and_out_must_not_overlap():
    with pytest.raises(TypeError, match="base_programs must be an int"):
        qsa.use_fp8_decode_kernel(True, torch.uint8)
    case = make_case()
    kv = torch.zeros(4, 2, 16, 128, dtype=torch.uint8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="selection_width must be an int"):
        qsa.warmup_qsa_fp8_decode(kv, table, num_query_heads=8, selection_width=64.0)
    with pytest.raises(TypeError, match="num_query_heads must be an int"):
        qsa.warmup_qsa_fp8_decode(kv, table, num_query_heads=True, selection_width=64)
    with pytest.raises(ValueError, match="out overlaps q"):
        qsa.qsa_sparse_paged_attention(*args_of({**case, "out": case["q"]}))
    buf = torch.empty(case["q"].numel() + 8, dtype=case["q"].dtype)
    gate = buf[: case["q"].numel()].view(case["q"].shape).copy_(case["output_gate"])
    shifted = buf[8:].view(case["q"].shape)  # 8 elements past the gate: a partial overlap
    with pytest.raises(ValueError, match="out overlaps output_gate"):
        qsa.qsa_sparse_paged_attention(*args_of({**case, "output_gate": gate, "out": shifted}))
    qsa.qsa_sparse_paged_attention(*args_of({**case, "out": case["output_gate"]}))  # in place


@pytest.mark.gpu
def test_gpu_mla_replay_refuses_overlapping_outputs():
    """A call that repeats a planned call's shapes replays; key overlapping value must not."""
    tokens, heads = 64, 16
    kv, pe = mla_inputs(tokens, heads, device="cuda")
    key = torch.empty(tokens, heads, 192, dtype=torch.float8_e4m3fn, device="cuda")
    value = torch.empty(tokens, heads, 128, dtype=torch.float8_e4m3fn, device="cuda")
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    concat_mla_kv_quant_fp8(kv, pe, key, value)  # replayed
    buf = torch.empty(tokens * heads * 320, dtype=torch.float8_e4m3fn, device="cuda")
    overlapping_key = buf[: tokens * heads * 192].view(tokens, heads, 192)
    overlapping_value = buf[tokens * heads * 128 :][: tokens * heads * 128].view(tokens, heads, 128)
    with pytest.raises(ValueError, match="key overlaps value"):
        concat_mla_kv_quant_fp8(kv, pe, overlapping_key, overlapping_value)


# -- review of session 31: overlaps past a small span, outputs that overlap themselves -------
def test_overlap_is_exact_past_small_spans():
    """Interleaved views of one large buffer (spans of megabytes) are told apart exactly:
    side by side they pass, sharing bytes they are refused (once let through past 1 MiB)."""
    tokens, heads = 4096, 16
    kv, pe = mla_inputs(tokens, heads)
    big = torch.empty(tokens, heads, 2, 192, dtype=torch.float8_e4m3fn)
    key, value = big[:, :, 0], big[:, :, 1, :128]  # disjoint, interleaved
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    want_key, want_value = concat_mla_kv_quant_fp8(kv, pe)
    assert torch.equal(key.view(torch.uint8), want_key.view(torch.uint8))
    assert torch.equal(value.view(torch.uint8), want_value.view(torch.uint8))
    with pytest.raises(ValueError, match="key overlaps value"):
        concat_mla_kv_quant_fp8(kv, pe, big[:, :, 0], big[:, :, 0, 32:160])


def test_outputs_must_not_overlap_themselves():
    kv, pe = mla_inputs(4, 2)
    row = torch.empty(1, 2, 192, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="key overlaps itself"):
        concat_mla_kv_quant_fp8(kv, pe, row.expand(4, 2, 192), None)
    case = make_case()
    out = torch.empty_like(case["out"][:1]).expand_as(case["out"])
    with pytest.raises(ValueError, match="out overlaps itself"):
        qsa.qsa_sparse_paged_attention(*args_of({**case, "out": out}))


def test_qsa_empty_pool_writes_zeros():
    """A pool of no blocks attends nothing: every row is zero (the gather had nothing to
    index)."""
    case = make_case()
    for name in ("k_cache", "v_cache"):
        case[name] = case[name][:0]
    case["out"] = torch.full_like(case["out"], float("nan"))
    got = qsa.qsa_sparse_paged_attention(*args_of(case))
    assert torch.equal(got, torch.zeros_like(got))


def test_refusals_found_in_review():
    kv = torch.zeros(4, 2, 16, 128, dtype=torch.uint8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="num_query_heads \\(7\\) must be a multiple"):
        qsa.warmup_qsa_fp8_decode(kv, table, num_query_heads=7, selection_width=64)
    with pytest.raises(TypeError, match="cache_dtype must be a torch.dtype"):
        qsa.use_fp8_decode_kernel(4096, "float8_e4m3fn")
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        kv_nope, k_pe = (t.to(dtype) for t in mla_inputs(4, 2))
        with pytest.raises(TypeError, match="kv_nope must be a floating tensor of 16 bits"):
            concat_mla_kv_quant_fp8(kv_nope, k_pe)


def test_qsa_topk_within_the_slot_pass_grid():
    """TOPK past 65535 slot-pass CTAs of 256 one-entry threads would fail at launch: the
    kernels refuse it (the torch path serves) instead; so do rows x Hkv past grid.x."""
    from flashinfer_jit.qsa import checks as qsa_checks
    from flashinfer_jit.qsa import kernels as qk

    most = 65535 * qk.SLOT_THREADS
    assert qsa_checks.MAX_TOPK == most
    assert qsa_checks.grid_refusal(4, 8, most) is None
    assert "TOPK too large" in qsa_checks.grid_refusal(4, 8, most + 1)
    assert qsa_checks.grid_refusal(2**28 - 1, 8, 64) is None
    assert "too large" in qsa_checks.grid_refusal(2**28, 8, 64)
