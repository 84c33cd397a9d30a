"""flashinfer_jit.deep_gemm on CPU (the torch path): DeepGEMM's names, argument order,
defaults and semantics against a float64 reference; every rejected input."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import pytest
import torch

import flashinfer_jit.deep_gemm as dg
from flashinfer_jit.mqa_logits import compute_paged_mqa_logits_schedule, fp8_paged_mqa_logits

from .deep_gemm_cases import check, make_case

LENS = [0, 1, 2, 63, 64, 65, 200, 257]


def call(case, clean_logits=False, logits_dtype=torch.float32, **kw):
    meta = dg.get_paged_mqa_logits_metadata(
        case.context_lens, case.kv_cache.shape[1], dg.get_num_sms()
    )
    return dg.fp8_fp4_paged_mqa_logits(
        (case.q, None), case.kv_cache, case.weights, case.context_lens, case.block_table, meta,
        case.max_context_len, clean_logits, logits_dtype, **kw,
    )  # fmt: skip


def test_signatures_are_deepgemms():
    params = lambda f: [(p.name, p.default) for p in inspect.signature(f).parameters.values()]  # noqa: E731
    e = inspect.Parameter.empty
    head = [(n, e) for n in ("q", "kv_cache", "weights", "context_lens", "block_table")]
    head += [("schedule_meta", e), ("max_context_len", e), ("clean_logits", False)]
    assert params(dg.fp8_paged_mqa_logits) == [*head, ("indices", None)]
    assert params(dg.fp8_fp4_paged_mqa_logits) == [
        *head,
        ("logits_dtype", torch.float32),
        ("indices", None),
    ]
    assert params(dg.get_paged_mqa_logits_metadata) == [
        ("context_lens", e),
        ("block_kv", e),
        ("num_sms", e),
        ("indices", None),
    ]
    assert dg.get_num_sms() >= 1


@pytest.mark.parametrize("two_d", [False, True], ids=["lens1d", "lens2d"])
@pytest.mark.parametrize("clean_logits", [False, True], ids=["raw", "clean"])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("next_n,heads", [(1, 64), (2, 32), (3, 32)])
def test_cpu_matches_reference(two_d, clean_logits, logits_dtype, next_n, heads):
    case = make_case(LENS, next_n=next_n, heads=heads, two_d=two_d, seed=next_n)
    logits = call(case, clean_logits, logits_dtype)
    assert logits.dtype == logits_dtype
    check(logits, case, clean_logits)


def test_fp8_paged_mqa_logits_is_the_fp32_call():
    case = make_case([70, 5, 130], next_n=2, two_d=True)
    meta = dg.get_paged_mqa_logits_metadata(case.context_lens, 64, dg.get_num_sms())
    args = (case.kv_cache, case.weights, case.context_lens, case.block_table, meta)
    got = dg.fp8_paged_mqa_logits(case.q, *args, case.max_context_len, clean_logits=True)
    assert got.dtype == torch.float32
    assert torch.equal(got, call(case, clean_logits=True))
    check(got, case, clean_logits=True)


def test_zero_and_short_lengths():
    """Rows that see nothing: a zero length, or a 1-D length shorter than next_n."""
    case = make_case([0, 1, 2, 0], next_n=3, heads=32)
    logits = call(case, clean_logits=True)
    check(logits, case, clean_logits=True)
    assert (logits[:3] == float("-inf")).all() and (logits[-3:] == float("-inf")).all()
    assert (logits[3:5] == float("-inf")).all() and torch.isfinite(logits[5, :1]).all()
    two_d = make_case([0, 9], next_n=2, two_d=True, seed=3)
    check(call(two_d, clean_logits=True), two_d, clean_logits=True)


@pytest.mark.parametrize("block_kv", [32, 64, 128])
def test_block_sizes_and_strided_pool(block_kv):
    """DeepGEMM's free block stride (a pool inside a wider buffer) serves the same logits."""
    dense = make_case([100, 300, 7], next_n=2, block_kv=block_kv, two_d=True, seed=5)
    padded = make_case([100, 300, 7], next_n=2, block_kv=block_kv, two_d=True, seed=5, block_pad=68)
    assert dense.kv_cache.is_contiguous() and not padded.kv_cache.is_contiguous()
    a, b = call(dense, clean_logits=True), call(padded, clean_logits=True)
    check(b, padded, clean_logits=True)
    assert torch.equal(a, b)


def test_metadata_round_trip():
    case = make_case([100, 300, 7, 0], next_n=2, two_d=True)
    meta = dg.get_paged_mqa_logits_metadata(case.context_lens, 64, 8)
    want = compute_paged_mqa_logits_schedule(case.context_lens[:, -1].contiguous(), 64, 8)
    assert meta.shape == (9, 2) and meta.dtype == torch.int32 and torch.equal(meta, want)
    one_d = dg.get_paged_mqa_logits_metadata(case.context_lens[:, -1].contiguous(), 64, 8)
    assert torch.equal(one_d, want)
    # The schedule is a hint: a caller's other SM count or None serve the same logits.
    args = (case.kv_cache, case.weights, case.context_lens, case.block_table)
    for sched in (meta, None):
        got = dg.fp8_paged_mqa_logits(case.q, *args, sched, case.max_context_len, True)
        check(got, case, clean_logits=True)


def _rejects(exc, match, **change):
    case = make_case([70, 5], next_n=2, two_d=True)
    kw = dict(
        q=(case.q, None), kv_cache=case.kv_cache, weights=case.weights,
        context_lens=case.context_lens, block_table=case.block_table,
        schedule_meta=dg.get_paged_mqa_logits_metadata(case.context_lens, 64, 1),
        max_context_len=case.max_context_len,
    )  # fmt: skip
    kw.update({k: v(case) if callable(v) else v for k, v in change.items()})
    with pytest.raises(exc, match=match):
        dg.fp8_fp4_paged_mqa_logits(**kw)


REJECTED = {
    "fp4_q": (NotImplementedError, "FP4", dict(q=lambda c: (c.q, torch.ones(2, 2, 32)))),
    "indices": (NotImplementedError, "indices", dict(indices=lambda c: torch.zeros(2))),
    "bare_q": (TypeError, r"q must be a \(q_fp8, None\)", dict(q=lambda c: c.q)),
    "f16_logits": (ValueError, "logits_dtype", dict(logits_dtype=torch.float16)),
    "lens_dtype": (TypeError, "context_lens", dict(context_lens=lambda c: c.context_lens.long())),
    "lens_3d": (ValueError, "context_lens", dict(context_lens=lambda c: c.context_lens[None])),
    "lens_batch": (ValueError, "context_lens", dict(context_lens=lambda c: c.context_lens[:1])),
    "lens_next_n": (ValueError, "next_n", dict(context_lens=lambda c: c.context_lens[:, :1])),
    "q_not_tensor": (ValueError, "q must be a 4-D tensor", dict(q=([1, 2], None))),
    "q_dtype": (TypeError, "q must be torch.float8", dict(q=lambda c: (c.q.float(), None))),
    "weights": (ValueError, "weights", dict(weights=lambda c: c.weights[:1])),
    "table": (ValueError, "block_table ", dict(block_table=lambda c: c.block_table[0])),
    "kv_layout": (ValueError, "kv_cache", dict(kv_cache=lambda c: c.kv_cache.transpose(0, 1))),
    "kv_dim": (
        ValueError,
        r"kv_cache must be \[num_blocks",
        dict(kv_cache=lambda c: c.kv_cache[..., :-1]),
    ),
    "schedule": (TypeError, "schedule_meta", dict(schedule_meta=[1, 2])),
    "max_len": (ValueError, "max_context_len", dict(max_context_len=-1)),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_rejects(name):
    exc, match, change = REJECTED[name]
    _rejects(exc, match, **change)


def test_metadata_rejects():
    lens = torch.tensor([[3, 5]], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="indices"):
        dg.get_paged_mqa_logits_metadata(lens, 64, 4, indices=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_kv"):
        dg.get_paged_mqa_logits_metadata(lens, 16, 4)
    with pytest.raises(TypeError, match="context_lens"):
        dg.get_paged_mqa_logits_metadata(lens.float(), 64, 4)
    with pytest.raises(ValueError, match="num_sms"):
        dg.get_paged_mqa_logits_metadata(lens, 64, 0)


def test_unordered_lens_and_a_gathered_pools_table_are_checked_on_cpu():
    """On CPU (and on a GPU under FLASHINFER_VALIDATE_INPUTS=1) the newest slot's length
    must be the largest, and a padded pool's table is checked before it is gathered (the
    gather itself clamps entries past a request's blocks, which may hold anything)."""
    case = make_case([70, 5], next_n=2, two_d=True)
    call(case)  # ordered: fine
    case.context_lens[0, 0] = 71
    with pytest.raises(ValueError, match="newest slot"):
        call(case)
    padded = make_case([100, 300], next_n=1, seed=5, block_pad=68)
    assert not padded.kv_cache.is_contiguous()
    padded.block_table[0, 4] = -1  # past request 0's two blocks: unused
    call(padded)
    padded.block_table[1, 0] = -1
    with pytest.raises(ValueError, match="block_table holds a block index outside"):
        call(padded)


def test_native_entry_keeps_refusing_bf16():
    case = make_case([70], next_n=1)
    with pytest.raises(ValueError, match="bfloat16"):
        fp8_paged_mqa_logits(
            case.q, case.kv_cache, case.weights, case.block_table, case.context_lens,
            case.max_context_len, output_dtype=torch.bfloat16,
        )  # fmt: skip


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_bf16_kernels_compile(arch):
    """bfloat16 logits compile in every kernel family the DeepGEMM surface reaches."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from flashinfer_jit.mqa_logits.clean import clean_specs
    from flashinfer_jit.mqa_logits.generic import generic_family
    from flashinfer_jit.mqa_logits.ring import ring_family, ring_params
    from flashinfer_jit.mqa_logits.tma import tma_config, tma_family
    from jit_kernels import compile_cubin, render

    bf16, f32 = torch.bfloat16, torch.float32
    specs = [
        ring_family.spec(ring_params((2, 64, 128, 64), (bf16, f32, f32))),
        generic_family.spec((bf16, f32, f32)),
    ]
    if arch == "sm_90a":
        specs.append(tma_family.spec((2, 64, 128, 64, bf16, f32, f32, *tma_config(128, 0))))
    specs += clean_specs()
    for spec in specs:
        assert compile_cubin(render(spec, BUILDER.template_root), arch).cubin, spec.label


def clean_writes_only_the_tail(device: str) -> None:
    """clean_logits on NaN-filled logits (a row stride wider than the row): the positions a
    row sees stay untouched, every other one up to the width is -inf."""
    from flashinfer_jit.mqa_logits.clean import clean_logits

    from .deep_gemm_cases import visible

    lens_1d = torch.tensor([0, 1, 5, 300], dtype=torch.int32, device=device)
    lens_2d = torch.tensor([[0, 0], [0, 1], [3, 5], [299, 300]], dtype=torch.int32)
    for lens in (lens_1d, lens_2d.to(device), lens_2d.t().contiguous().t().to(device)):
        for dtype in (torch.float32, torch.bfloat16):
            storage = torch.full((8, 512), float("nan"), dtype=dtype, device=device)
            logits = storage[:, :301]
            clean_logits(logits, lens, 2)
            for row, seen in enumerate(visible(lens, 2)):
                assert storage[row, :seen].isnan().all(), (row, seen)
                assert (storage[row, seen:301] == float("-inf")).all(), (row, seen)
                assert storage[row, 301:].isnan().all()


def test_clean_writes_only_the_tail():
    clean_writes_only_the_tail("cpu")


def test_other_names_are_deep_gemms(monkeypatch):
    """Importing this module as deep_gemm is one line: the names it does not serve are the
    installed deep_gemm's (its SM count included, so set_num_sms reservations hold)."""
    monkeypatch.delitem(sys.modules, "deep_gemm", raising=False)
    monkeypatch.setattr(sys, "path", [])  # no deep_gemm to import
    assert dg.get_num_sms() >= 1  # without DeepGEMM: the device's SM count
    with pytest.raises(AttributeError, match="fp8_mqa_logits.*deep_gemm \\(not installed\\)"):
        dg.fp8_mqa_logits  # noqa: B018
    stand_in = types.ModuleType("deep_gemm")
    stand_in.get_num_sms, stand_in.fp8_mqa_logits = (lambda: 66), object()
    monkeypatch.setitem(sys.modules, "deep_gemm", stand_in)
    assert dg.get_num_sms() == 66 and dg.fp8_mqa_logits is stand_in.fp8_mqa_logits
    assert "get_num_sms" not in dg.__all__  # README's replacement keeps DeepGEMM's
    monkeypatch.setitem(sys.modules, "deep_gemm", dg)  # installed under that name: no loop
    with pytest.raises(AttributeError, match="set_num_sms"):
        dg.set_num_sms  # noqa: B018


def test_a_schedule_is_not_read():
    """A schedule_meta of DeepGEMM's shape holding anything (DeepGEMM's own rows mean other
    things) serves the same logits: the kernels split the work themselves."""
    case = make_case([100, 300, 7, 0], next_n=2, two_d=True)
    args = (case.kv_cache, case.weights, case.context_lens, case.block_table)
    junk = torch.randint(-5, 1000, (9, 2), dtype=torch.int32)
    want = dg.fp8_paged_mqa_logits(case.q, *args, None, case.max_context_len, True)
    got = dg.fp8_paged_mqa_logits(case.q, *args, junk, case.max_context_len, True)
    assert torch.equal(got, want)
    check(got, case, clean_logits=True)


def test_a_padded_pool_gathers_the_columns_max_context_len_reaches():
    """A table as wide as an engine's longest context (vLLM: max_model_len / block_kv) is
    gathered only as far as max_context_len reaches, not over its whole width."""
    case = make_case([100, 300], next_n=1, seed=5, block_pad=68)
    wide = torch.full((2, 2560), -1, dtype=torch.int32)  # 163840 tokens of columns, unused
    wide[:, : case.block_table.shape[1]] = case.block_table
    pool, table = dg._dense_pool(case.kv_cache, wide, case.q, case.max_context_len)
    assert table.shape == (2, 5) and pool.shape[0] == 10  # ceil(305 / 64) columns a request
    got = call(dataclasses.replace(case, block_table=wide), clean_logits=True)
    check(got, case, clean_logits=True)
