"""The sm_90a TMA kernel of fp8_paged_mqa_logits: its launch configurations and cubins
(CPU), and on an sm_90 GPU its results against the float64 reference of test_mqa_logits,
including runs where one CTA walks every tile (the ring wraps, Q buffers switch and
prefetch across many requests), and its opt-in pipelined consumer loop (pipeline=1)
against both the reference and the bits of pipeline=0."""

from __future__ import annotations

import re

import pytest
import torch

import flashinfer_jit.mqa_logits as mq
from flashinfer_jit._jit import BUILDER
from flashinfer_jit.mqa_logits_checks import SMEM_LIMIT, STATIC_SMEM, reg_cap
from flashinfer_jit.mqa_logits_schedule import schedule_torch
from flashinfer_jit.mqa_logits_tma import (
    check_pipeline,
    tma_config,
    tma_family,
    tma_regs,
    tma_smem_bytes,
    tma_threads,
)
from jit_kernels import KernelUnavailable, compile_cubin, render

from .test_mqa_logits import EDGE_LENS, assert_close, make_inputs, reference, run_and_check
from .test_mqa_logits_build import _sass

SHIPPED_N = sorted({nn * h for nn in (1, 2, 3, 4) for h in (32, 64)})


@pytest.mark.parametrize("n", [8, *SHIPPED_N, 256])
def test_configs_fit(n):
    warpgroups, stages, producers, qbuf = tma_config(n)
    assert stages % warpgroups == 0 and stages % producers == 0 and stages >= 2 * warpgroups
    assert tma_smem_bytes(n, warpgroups, stages, qbuf) + STATIC_SMEM <= SMEM_LIMIT
    assert tma_regs(n) <= reg_cap(128 * warpgroups + 32 * producers)


@pytest.mark.parametrize(
    "next_n,heads,block", [(1, 64, 64), (2, 64, 32), (3, 64, 128), (4, 64, 64)]
)
def test_cubin_uses_tma_and_wgmma_without_spills(next_n, heads, block, tmp_path):
    f32 = torch.float32
    params = (next_n, heads, 128, block, f32, f32, f32, *tma_config(next_n * heads), 0, 0)
    spec = tma_family.spec(params)
    sass, res = _sass(compile_cubin(render(spec, BUILDER.template_root), "sm_90a").cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills: {res}"
    assert "UTMALDG.3D" in sass and "QGMMA" in sass
    assert not spec.supports("sm_100a")


class _FakeKernel:
    name = "fake"

    def blocks_per_sm(self, threads, smem):
        return 1


@pytest.fixture
def picked(monkeypatch):
    """Records which family/params the dispatcher asks for (no CUDA needed)."""
    got = []

    def fake_get(family, fail=False):
        def get(params, device):
            got.append((family.family, params))
            if fail:
                raise KernelUnavailable("not prebuilt")
            return _FakeKernel()

        return get

    monkeypatch.setattr(mq, "sm_count", lambda device: 132)
    monkeypatch.setattr(mq._logits_family, "get", fake_get(mq._logits_family))
    monkeypatch.setattr(mq.tma_family, "get", fake_get(mq.tma_family))
    mq._plans.clear()
    yield got, lambda: monkeypatch.setattr(mq.tma_family, "get", fake_get(mq.tma_family, True))
    mq._plans.clear()


@pytest.mark.parametrize(
    "cap,dim,override,family",
    [
        ((9, 0), 128, None, "mqa_logits_tma"),
        ((10, 0), 128, None, "mqa_logits"),  # sm_100: the portable ring
        ((9, 0), 96, None, "mqa_logits"),  # other head dims: the ring
        ((9, 0), 128, (3, 0, False, True), "mqa_logits"),  # a forced ring config
        ((9, 0), 128, ("tma", 2, 0, 2, 1, 0), "mqa_logits_tma"),
    ],
)
def test_dispatch_picks_the_tma_kernel_where_it_applies(
    picked, monkeypatch, cap, dim, override, family
):
    got, _ = picked
    monkeypatch.setattr(mq, "capability", lambda device: cap)
    monkeypatch.setattr(mq, "_config_override", override)
    f32 = torch.float32
    plan = mq._plan((256, 2, 64, dim, 64), f32, f32, f32, 0)
    assert got[-1][0] == family
    if family == "mqa_logits_tma":
        config = tma_config(128) if override is None else (2, got[-1][1][8], 2, 1)
        assert got[-1][1] == (2, 64, dim, 64, f32, f32, f32, *config, 0, 0)
        assert plan[2] == (tma_threads(config[0], config[2]), 1, 1)
        assert plan[3] == tma_smem_bytes(128, config[0], config[1], config[3])
        assert plan[5] is not None  # the per-pool tensor map argument
    else:
        assert plan[5] is None


def test_dispatch_falls_back_to_the_ring_when_the_tma_kernel_is_missing(picked, monkeypatch):
    got, tma_missing = picked
    tma_missing()
    monkeypatch.setattr(mq, "capability", lambda device: (9, 0))
    f32 = torch.float32
    plan = mq._plan((256, 1, 64, 128, 64), f32, f32, f32, 0)
    assert [f for f, _ in got] == ["mqa_logits_tma", "mqa_logits"]
    assert plan[5] is None


# -- the pipelined consumer loop (pipeline=1), CPU ------------------------------------------
def test_pipeline_refusals():
    check_pipeline(24, 1, 1, 0)  # pipeline=0 applies everywhere
    check_pipeline(128, 4, 8, 1)
    with pytest.raises(KernelUnavailable, match="% 16"):
        check_pipeline(24, 2, 8, 1)  # next_n=3, heads=8: halves of 12 Q rows
    with pytest.raises(KernelUnavailable, match="2 ring stages per warpgroup"):
        check_pipeline(128, 4, 4, 1)
    with pytest.raises(KernelUnavailable, match="0 or 1"):
        check_pipeline(128, 4, 8, 2)


@pytest.mark.parametrize(
    "override,n,pipeline,family",
    [
        (None, 128, 0, "mqa_logits_tma"),  # the dispatcher's default: off
        (("tma", *tma_config(128), 0, 1), 128, 1, "mqa_logits_tma"),
        (("tma", *tma_config(8), 0, 1), 8, None, "mqa_logits"),  # n % 16: the ring serves
    ],
)
def test_dispatch_threads_the_pipeline_parameter(
    picked, monkeypatch, override, n, pipeline, family
):
    got, _ = picked
    monkeypatch.setattr(mq, "capability", lambda device: (9, 0))
    monkeypatch.setattr(mq, "_config_override", override)
    f32 = torch.float32
    mq._plan((256, 2, n // 2, 128, 64), f32, f32, f32, 0)
    assert got[-1][0] == family
    if pipeline is not None:
        assert got[-1][1][-2:] == (0, pipeline)


@pytest.mark.parametrize("next_n,heads", [(1, 64), (2, 64), (3, 64), (4, 64)])
def test_pipelined_cubin_overlaps_mma_and_epilogue(next_n, heads, tmp_path):
    """No spills; both halves are m64n(N/2) wgmma chains; ptxas kept them asynchronous: an
    epilogue (FMNMX: the ReLU) runs between a chain and the next warpgroup wait/arrive, and
    A's wait leaves B's group in flight (DEPBAR.LE gsb0, 0x1). Serialized wgmmas would each
    be followed by DEPBAR.LE gsb0, 0x0."""
    f32, n = torch.float32, next_n * heads
    spec = tma_family.spec((next_n, heads, 128, 64, f32, f32, f32, *tma_config(n), 0, 1))
    sass, res = _sass(compile_cubin(render(spec, BUILDER.template_root), "sm_90a").cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills: {res}"
    ops = [op.strip() for op in re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    assert any(f"QGMMA.64x{n // 2}x32" in op for op in ops)
    assert not any(f"QGMMA.64x{n}x32" in op for op in ops)
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in ops
    overlapped = []  # ReLUs between each chain's last QGMMA and the next WARPGROUP op
    for k, op in enumerate(ops):
        if op.startswith("QGMMA") and op.endswith("gsb0"):
            rest = ops[k + 1 :]
            stop = next((j for j, o in enumerate(rest) if o.startswith("WARPGROUP")), len(rest))
            overlapped.append(sum(o.startswith("FMNMX") for o in rest[:stop]))
    assert max(overlapped) >= n // 4, overlapped  # the held tile's B half (N/4 words)
    k = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x1")  # A landed, B in flight: A's epilogue
    stop = ops.index("WARPGROUP.DEPBAR.LE gsb0, 0x0", k)
    assert sum(o.startswith("FMNMX") for o in ops[k:stop]) >= n // 8


# -- GPU ----------------------------------------------------------------------------------
# ("tma", warpgroups, stages, producer warps, Q buffers, probe)
TMA_VARIANTS = {
    "auto": None,
    "tma_1x3": ("tma", 1, 3, 1, 2, 0),  # a 3-stage ring: wraps every third tile
    "tma_2x4p2q1": ("tma", 2, 4, 2, 1, 0),  # two producer warps, one Q buffer
    "tma_4x16p2": ("tma", 4, 16, 2, 2, 0),  # where next_n*heads fits 4 warpgroups
}


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def tma_variant(request, monkeypatch):
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    monkeypatch.setattr(mq, "_config_override", TMA_VARIANTS[request.param])
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback to torch would hide a kernel bug
    return request.param


def _served_by_tma() -> bool:
    return any("mqa_logits_tma" in p[0].name for p in mq._plans.values())


@pytest.mark.gpu
@pytest.mark.parametrize("tma_variant", list(TMA_VARIANTS), indirect=True)
@pytest.mark.parametrize(
    "next_n,heads,block_size",
    [(1, 64, 64), (2, 32, 32), (3, 64, 128), (4, 64, 64), (2, 4, 64), (1, 32, 128), (4, 32, 32)],
)
def test_gpu_tma_matches_reference(tma_variant, next_n, heads, block_size):
    if tma_variant == "tma_4x16p2" and next_n * heads > 64:
        pytest.skip("4 warpgroups fit next_n*heads <= 64 only")
    mq._plans.clear()
    mq._replays.clear()
    lens = EDGE_LENS + [next_n - 1, 1000, 64 * 7, 3 * block_size]
    run_and_check(
        lens, device="cuda", next_n=next_n, heads=heads, block_size=block_size, seed=17 + next_n
    )
    assert _served_by_tma()


def _one_cta_schedule(batch: int) -> torch.Tensor:
    """CTA 0 owns every tile; the others none (a legal, if slow, caller schedule)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
    sched[1:, 0] = batch
    return sched.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("tma_variant", ["auto", "tma_1x3", "tma_2x4p2q1"], indirect=True)
@pytest.mark.parametrize("next_n,heads,block_size", [(1, 64, 64), (2, 64, 32), (1, 32, 128)])
def test_gpu_tma_one_cta_walks_everything(tma_variant, next_n, heads, block_size):
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 700, (40,), generator=gen).tolist() + [0, 0, 1, 64, 65]
    q, kv, w, table, seq, max_len = make_inputs(
        lens, next_n=next_n, heads=heads, block_size=block_size, device="cuda", seed=9
    )
    mq._plans.clear()
    mq._replays.clear()
    got = mq.fp8_paged_mqa_logits(
        q, kv, w, table, seq, max_len, schedule_meta=_one_cta_schedule(len(lens))
    )
    assert_close(got, reference(q, kv, w, table, seq), 2e-3, name="one CTA")
    assert _served_by_tma()


@pytest.mark.gpu
def test_gpu_tma_probe_streams_without_writing(monkeypatch):
    """The benchmark's streaming probe runs to completion and writes nothing."""
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    monkeypatch.setattr(mq, "_config_override", ("tma", 2, 0, 2, 2, 1))
    q, kv, w, table, seq, max_len = make_inputs([900, 5, 0, 4000], device="cuda")
    out = torch.full((4, mq.padded_seq_len(max_len)), float("nan"), device="cuda")
    mq.fp8_paged_mqa_logits(q, kv, w, table, seq, max_len, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


# The pipelined loop (pipeline=1) against the reference and the bits of pipeline=0: zero-length
# requests, short requests sharing a warpgroup's run, long ones that keep it pipelined.
PIPE_LENS = [0, 700, 1, 65, 0, 129, 64, 3000, 0, 257, 190, 2, 1000, 0]


def _few_cta_schedule(lens: list[int], ctas: int) -> torch.Tensor:
    """The balanced split over `ctas` CTAs (runs start mid-request); the other CTAs idle."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
    sched[:, 0] = len(lens)
    sched[: ctas + 1] = schedule_torch(torch.tensor(lens, dtype=torch.int32), ctas)
    return sched.cuda()


def _pipeline_outputs(inputs, config, dtypes, schedule, monkeypatch) -> dict:
    """{pipeline: out} of the TMA kernel forced to `config`, pipeline 0 and 1, into outs
    filled with NaN (what neither writes must match too)."""
    q, kv, w, table, seq, max_len = inputs
    out_dt, epi_dt, acc_dt = dtypes
    got = {}
    for pipeline in (0, 1):
        monkeypatch.setattr(mq, "_config_override", ("tma", *config, 0, pipeline))
        mq._plans.clear()
        mq._replays.clear()
        out = torch.full(
            (q.shape[0] * q.shape[1], mq.padded_seq_len(max_len)), float("nan"), dtype=out_dt,
            device="cuda",
        )  # fmt: skip
        mq.fp8_paged_mqa_logits(
            q, kv, w, table, seq, max_len, output_dtype=out_dt, epi_dtype=epi_dt,
            acc_dtype=acc_dt, schedule_meta=schedule, out=out,
        )  # fmt: skip
        assert _served_by_tma()
        got[pipeline] = out
    return got


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int16 if a.dtype == torch.float16 else torch.int32
    return torch.equal(a.view(bits), b.view(bits))


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
def test_gpu_tma_pipeline_matches_reference_and_pipeline0_bits(
    monkeypatch, next_n, heads, block_size
):
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    # fp32 and fp16 logits alternate so that every geometry and block size sees both.
    out_dt = torch.float16 if (next_n + heads // 32 + block_size // 32) % 2 else torch.float32
    dtypes = (out_dt, torch.float32, torch.float32)
    inputs = make_inputs(
        PIPE_LENS, next_n=next_n, heads=heads, block_size=block_size, device="cuda", seed=next_n
    )
    ref = reference(*inputs[:5])
    config = tma_config(next_n * heads)
    for schedule in (None, _few_cta_schedule(PIPE_LENS, 3), _one_cta_schedule(len(PIPE_LENS))):
        got = _pipeline_outputs(inputs, config, dtypes, schedule, monkeypatch)
        assert_close(got[1], ref, 2e-3, name=f"pipeline=1 {out_dt}")
        assert _same_bits(got[0], got[1]), "pipeline=1 differs from pipeline=0"


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [(2, 4, 2, 1), (1, 2, 1, 2), (3, 6, 3, 2)],  # 2 stages a warpgroup (the least); 1 Q buffer
)
@pytest.mark.parametrize(
    "next_n,heads,dtypes",
    [
        (2, 64, (torch.float32,) * 3),
        (1, 32, (torch.float16, torch.float32, torch.float32)),
        (4, 32, (torch.float32, torch.float16, torch.float16)),  # f16 epilogue + accumulators
    ],
)
def test_gpu_tma_pipeline_tight_rings(monkeypatch, config, next_n, heads, dtypes):
    """The fewest stages pipeline=1 allows, one Q buffer, f16 epilogue/accumulators: same bits
    as pipeline=0, over one CTA walking every request."""
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    if tma_regs(next_n * heads) > reg_cap(tma_threads(config[0], config[2])):
        pytest.skip("the accumulators do not fit this many warpgroups")
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    inputs = make_inputs(PIPE_LENS, next_n=next_n, heads=heads, device="cuda", seed=3)
    schedule = _one_cta_schedule(len(PIPE_LENS))
    got = _pipeline_outputs(inputs, config, dtypes, schedule, monkeypatch)
    rtol = 2e-3 if dtypes[1] == torch.float32 else 3e-2
    assert_close(got[1], reference(*inputs[:5]), rtol, name="pipeline=1")
    assert _same_bits(got[0], got[1]), "pipeline=1 differs from pipeline=0"
