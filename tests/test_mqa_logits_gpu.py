"""fp8_paged_mqa_logits on a GPU: the kernels against the float64 reference (variants,
precisions, head dims, many requests), the generic fallback, the schedule and CUDA-graph
replay.

Strict mode (FLASHINFER_JIT_STRICT=1) is on in every test: a fallback to torch would hide a
kernel bug (test_gpu_torch_path_matches takes the torch path by the env switch, no fallback).
"""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit import mqa_logits as mq
from flashinfer_jit.mqa_logits import (
    MqaLogitsOptions,
    compute_paged_mqa_logits_schedule,
    fp8_paged_mqa_logits,
    padded_seq_len,
)
from flashinfer_jit.mqa_logits import plan as mq_plan

from .test_mqa_logits import (
    BAD_BLOCK,
    DTYPE_TOLERANCES,
    E4M3,
    EDGE_LENS,
    assert_close,
    make_inputs,
    reference,
    run_and_check,
)

# -- GPU ----------------------------------------------------------------------------------
# (warpgroups, stages, portable, ring); ring stages 0 = as many as fit. ring_3x6 wraps its
# 6-stage ring many times per CTA (mbarrier phases); direct_* are the register-fed kernel.
VARIANTS = {
    "auto": None,
    "portable": (2, 0, True, True),
    "ring_1wg": (1, 0, False, True),
    "ring_3x6": (3, 6, False, True),
    "ring_4wg": (4, 0, False, True),  # opt-in (bench); generic where n > 64 cannot fit
    "direct_2x2": (2, 2, False, False),
    "direct_portable": (1, 3, True, False),
    "generic": "generic",  # the runtime-geometry kernel (MqaLogitsOptions.force_generic)
}


def variant_options(name: str) -> MqaLogitsOptions:
    """The options of the variant ``name`` (a key of VARIANTS)."""
    if VARIANTS[name] == "generic":
        return MqaLogitsOptions(force_generic=True)
    return MqaLogitsOptions(config=VARIANTS[name])


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback to torch would hide a kernel bug
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", raising=False)


@pytest.fixture
def variant(request) -> MqaLogitsOptions:
    """The options of the variant ``request.param``."""
    return variant_options(request.param)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
@pytest.mark.parametrize(
    "next_n,heads,block_size",
    [(1, 64, 64), (2, 32, 32), (3, 64, 128), (4, 64, 64), (2, 4, 64), (1, 32, 128)],
)
def test_gpu_matches_reference(variant, next_n, heads, block_size):
    lens = EDGE_LENS + [next_n - 1, 1000, 64 * 7, 3 * block_size]
    run_and_check(
        lens, device="cuda", next_n=next_n, heads=heads, block_size=block_size, seed=7 + next_n,
        options=variant,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "portable", "generic"], indirect=True)
@pytest.mark.parametrize("dtypes,rtol", DTYPE_TOLERANCES)
# heads=12: a thread's 8-column groups straddle two slots t (the epilogue picks per pair)
@pytest.mark.parametrize("heads", [32, 12])
def test_gpu_half_precision(variant, dtypes, rtol, heads):
    run_and_check(
        [1, 77, 300, 64, 0], device="cuda", next_n=2, heads=heads, dtypes=dtypes, rtol=rtol,
        options=variant,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "portable", "direct_2x2", "generic"], indirect=True)
@pytest.mark.parametrize("dim", [32, 96, 160, 256])
def test_gpu_other_head_dims(variant, dim):
    run_and_check(
        [5, 64, 333], device="cuda", next_n=1, heads=64, dim=dim, seed=dim, options=variant
    )


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "ring_3x6", "portable", "generic"], indirect=True)
# The in-kernel schedule (util.cuh cta_tiles): 700 requests, more than any kernel's threads,
# take its one pass with 2-3 requests a thread; 4000, more than 8 a thread, its two chunked
# passes. (300, 3000) is a large call (KV copies with the default L2 policy), (700, 300) a
# small one (evict-first; mqa_logits_tma.small_work): each kernel runs both.
@pytest.mark.parametrize("count,longest", [(300, 3000), (700, 300), (4000, 20)])
def test_gpu_many_requests(variant, count, longest):
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(0, longest, (count,), generator=gen).tolist()
    run_and_check(lens, device="cuda", next_n=2, heads=64, seed=11, options=variant)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
# One request takes cta_tiles' own path (no scan): empty, shorter than next_n, a tile's
# edges, fewer tiles than CTAs (most CTAs idle) and more (several tiles a CTA).
@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 1000, 20000])
def test_gpu_one_request(variant, length):
    run_and_check([length], device="cuda", next_n=2, heads=32, seed=length, options=variant)


@pytest.mark.gpu
def test_gpu_generic_serves_when_jit_disabled(monkeypatch):
    generic = MqaLogitsOptions(force_generic=True)  # builds (caches) the generic cubin
    run_and_check([70, 0, 5], device="cuda", next_n=1, heads=8, dim=64, options=generic)
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")  # no specialization for this geometry
    run_and_check([300, 1, 129, 0], device="cuda", next_n=2, heads=20, dim=64, block_size=32)
    plans = [p for p in mq_plan._plans.values() if "generic" in p.kernel.name]
    # its runtime geometry (after the KV policy flag: a small call, evict-first)
    assert any(p.extra[:5] == (1, 2, 20, 64, 32) for p in plans)


@pytest.mark.gpu
def test_gpu_fp16_overflow_is_inf():
    q, kv, w, table, lens, max_len = make_inputs([64], heads=64, neg_weights=False, device="cuda")
    q = torch.full(q.shape, 448.0, device="cuda").to(E4M3)
    kv.view(kv.shape[0], -1)[:, : 64 * 128] = torch.tensor(448.0).to(E4M3).view(torch.uint8).item()
    w = torch.ones_like(w)
    for out_dt, epi_dt in ((torch.float16, torch.float32), (torch.float32, torch.float16)):
        got = fp8_paged_mqa_logits(
            q, kv, w, table, lens, max_len, output_dtype=out_dt, epi_dtype=epi_dt
        )
        assert torch.isinf(got[0, :64]).all()


@pytest.mark.gpu
def test_gpu_schedule_and_strides():
    from flashinfer_jit.mqa_logits.schedule import schedule_torch

    q, kv, w, table, lens, max_len = make_inputs(
        [0, 5, 700, 64, 0, 1999, 3], next_n=2, heads=32, device="cuda"
    )
    sched = compute_paged_mqa_logits_schedule(lens, 64)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert torch.equal(sched.cpu(), schedule_torch(lens.cpu(), num_sms))
    wide_table = torch.full((14, table.shape[1]), BAD_BLOCK, dtype=torch.int32, device="cuda")
    wide_table[::2] = table
    wide_lens = torch.zeros(14, dtype=torch.int32, device="cuda")
    wide_lens[::2] = lens
    a = fp8_paged_mqa_logits(
        q, kv, w, wide_table[::2], wide_lens[::2], max_len, schedule_meta=sched
    )
    b = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
    ref = reference(q, kv, w, table, lens)
    assert_close(a, ref, 2e-3)
    for row in ref:
        n = len(ref[row][0])
        assert torch.equal(a[row, :n], b[row, :n])


@pytest.mark.gpu
def test_gpu_graph_replay_follows_seq_lens():
    q, kv, w, table, lens, max_len = make_inputs(
        [300, 4000, 1, 2500], next_n=2, heads=64, device="cuda", table_fill=0, max_seq_len=4096
    )
    out = torch.full((8, padded_seq_len(4096)), float("nan"), device="cuda")
    fp8_paged_mqa_logits(q, kv, w, table, lens, 4096, out=out)  # compile/load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp8_paged_mqa_logits(q, kv, w, table, lens, 4096, out=out)
    for new in ([4000, 300, 0, 2], [64, 64, 4096, 1]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(q, kv, w, table, lens), 2e-3, name=f"replay {new}")


@pytest.mark.gpu
def test_gpu_torch_path_matches(monkeypatch):
    q, kv, w, table, lens, max_len = make_inputs([100, 0, 513], next_n=3, heads=32, device="cuda")
    ref = reference(q, kv, w, table, lens)
    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    assert_close(fp8_paged_mqa_logits(q, kv, w, table, lens, max_len), ref, 2e-3, name="torch path")


@pytest.mark.gpu
def test_gpu_fast_path_new_tensors(monkeypatch, fresh_replays):
    """Repeated calls with the same shapes (the fast path) read each call's own tensors: the
    first call plans, the other two replay (no full-path run: OP.prepare not called)."""
    full, prepare = [], mq.OP.prepare
    monkeypatch.setattr(mq.OP, "prepare", lambda args: full.append(args) or prepare(args))
    outs = []
    for seed in (1, 2, 3):
        q, kv, w, table, lens, max_len = make_inputs(
            [700, 0, 64, 1999], next_n=2, heads=64, device="cuda", seed=seed
        )
        got = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
        assert len(full) == 1, f"seed {seed}: {len(full)} full-path runs (not a replay)"
        assert_close(got, reference(q, kv, w, table, lens), 2e-3, name=f"seed {seed}")
        outs.append(got)
    assert not torch.equal(outs[0][0, :600], outs[1][0, :600])
