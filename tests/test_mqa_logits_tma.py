"""The sm_90a TMA kernel of fp8_paged_mqa_logits: its launch configurations and cubins
(CPU), and on an sm_90 GPU its results against the float64 reference of test_mqa_logits,
including runs where one CTA walks every tile (the ring wraps, Q buffers switch and
prefetch across many requests)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit.mqa_logits import OP, MqaLogitsOptions
from flashinfer_jit.mqa_logits import plan as mq_plan
from flashinfer_jit.mqa_logits.checks import SMEM_LIMIT, STATIC_SMEM, reg_cap
from flashinfer_jit.mqa_logits.ring import ring_family
from flashinfer_jit.mqa_logits.tma import (
    EVICT_MIN_DIM,
    LEAN_REGS,
    NARROW_CONFIG,
    PAIRED_WIDE_CONFIG,
    RING_STAGES,
    SMALL_CONFIG,
    TMA_DIMS,
    WIDE_REGS_CONFIGS,
    TmaConfig,
    kv_evict_first,
    small_work,
    stage_unit,
    tma_config,
    tma_family,
    tma_regs,
    tma_smem_bytes,
    tma_threads,
)
from jit_kernels import KernelUnavailable

from .test_mqa_logits import (
    EDGE_LENS,
    assert_close,
    logits_with,
    make_inputs,
    reference,
    run_and_check,
)

SHIPPED_N = sorted({nn * h for nn in (1, 2, 3, 4) for h in (32, 64)})


@pytest.mark.parametrize("dim", TMA_DIMS)
@pytest.mark.parametrize("n", [8, *SHIPPED_N, 256])
def test_configs_fit(n, dim):
    config = tma_config(n, 0, dim)
    warpgroups, stages, producers, qbuf = config[:4]
    # where it measured faster: below head_dim 128, at n <= 64, and with setmaxnreg
    assert config.lean == (dim < 128 or (n <= 64 and dim == 128) or config.regs > 0)
    assert stages % warpgroups == 0 and stages % producers == 0 and stages >= 2 * warpgroups
    assert tma_smem_bytes(n, dim, warpgroups, stages, qbuf) + STATIC_SMEM <= SMEM_LIMIT
    assert tma_regs(n) <= (config.regs or reg_cap(128 * warpgroups + 32 * producers))


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

    monkeypatch.setattr(mq_plan, "sm_count", lambda device: 132)
    monkeypatch.setattr(ring_family, "get", fake_get(ring_family))
    monkeypatch.setattr(tma_family, "get", fake_get(tma_family))
    mq_plan._plans.clear()
    yield got, lambda: monkeypatch.setattr(tma_family, "get", fake_get(tma_family, True))
    mq_plan._plans.clear()


def plan_of(batch: int, geometry: tuple, max_seq_len: int, options=None):
    """The kernel plan of a float32 call of ``batch`` requests (the H200's 132 SMs)."""
    small = small_work(batch, max_seq_len, 132)
    options = MqaLogitsOptions() if options is None else options
    evict = kv_evict_first(small, geometry)
    return mq_plan.kernel_plan(geometry, (torch.float32,) * 3, 0, small, options, evict)


@pytest.mark.parametrize(
    "cap,dim,override,family",
    [
        ((9, 0), 128, None, "mqa_logits_tma"),
        ((10, 0), 128, None, "mqa_logits"),  # sm_100: the portable ring
        ((9, 0), 64, None, "mqa_logits_tma"),  # SW64 panels
        ((9, 0), 256, None, "mqa_logits_tma"),  # two SW128 panels
        ((9, 0), 96, None, "mqa_logits_tma"),  # three SW32 panels
        ((9, 0), 160, None, "mqa_logits"),  # other head dims: the ring
        ((9, 0), 128, (3, 0, False, True), "mqa_logits"),  # a forced ring config
        ((9, 0), 128, TmaConfig(2, 0, 2, 1), "mqa_logits_tma"),
    ],
)
def test_dispatch_picks_the_tma_kernel_where_it_applies(
    picked, monkeypatch, cap, dim, override, family
):
    got, _ = picked
    monkeypatch.setattr(mq_plan, "capability", lambda device: cap)
    options = MqaLogitsOptions(config=override)
    f32 = torch.float32
    plan = plan_of(256, (2, 64, dim, 64), 8192, options)
    assert got[-1][0] == family
    if family == "mqa_logits_tma":
        forced = override._replace(stages=got[-1][1][8]) if override else None
        config = forced or tma_config(128, 0, dim, 2)
        assert config.stages > 0
        assert got[-1][1] == (2, 64, dim, 64, f32, f32, f32, *config)
        assert plan.block == (tma_threads(config.warpgroups, config.producers), 1, 1)
        assert plan.smem == tma_smem_bytes(128, dim, config.warpgroups, config.stages, config.qbuf)
        assert plan.kv_args is not None  # the per-pool tensor map argument
        assert plan.programmatic is options.pdl  # a programmatic launch: the kernel waits itself
    else:
        assert plan.kv_args is None
        assert plan.programmatic is False  # these kernels do not wait for the preceding grid


def test_small_calls_take_two_shallow_warpgroups():
    assert small_work(32, 8192, 132) == 1 and small_work(16, 8192, 132) == 2
    assert small_work(1, 65536, 132) == 2 and small_work(64, 8192, 132) == 0
    assert small_work(33, 8192, 132) == 1 and small_work(34, 8192, 132) == 0  # 32 per SM
    assert small_work(16, 8320, 132) == 2 and small_work(17, 8192, 132) == 1  # 16 per SM
    for n in (8, 32, 64):  # (the lean loop at n <= 64)
        assert tma_config(n, 1) == tma_config(n, 2) == SMALL_CONFIG._replace(lean=1)
        assert tma_config(n) == NARROW_CONFIG._replace(lean=1)
    assert SMALL_CONFIG == TmaConfig(2, 6, 2, 2) and NARROW_CONFIG == TmaConfig(3, 9, 3, 2)
    assert tma_config(128, 1) == TmaConfig(4, 8, 4, 2)
    assert tma_config(128) == TmaConfig(4, 8, 4, 2, 1, 0, LEAN_REGS)  # setmaxnreg, below
    assert tma_config(128, 2) == SMALL_CONFIG
    assert tma_config(256, 1) == tma_config(256, 2) == tma_config(256)  # measured no better
    assert tma_config(192, 1) == tma_config(192, 2) == TmaConfig(3, 9, 3, 2)
    # setmaxnreg: n = 192 at head_dim 128, and the lean loop at n = 128 below it
    assert tma_config(192, 0, 128, 3) == WIDE_REGS_CONFIGS[192] == TmaConfig(3, 12, 4, 1, 1, 0, 160)
    assert tma_config(128, 0, 128, 4) == WIDE_REGS_CONFIGS[128] == TmaConfig(3, 12, 4, 2, 1, 0, 160)
    assert tma_config(192, 0, 64, 3) == TmaConfig(3, 18, 3, 2)  # (measured at head_dim 128 only)
    assert tma_config(128, 0, 64, 2) == TmaConfig(4, 20, 4, 2, 1, 0, LEAN_REGS)
    assert tma_config(128, 0, 128, 2) == PAIRED_WIDE_CONFIG == TmaConfig(2, 16, 4, 2, 1, 1, 232)
    assert tma_config(128, 0, 96, 2) == TmaConfig(4, 12, 4, 2, 1, 0, LEAN_REGS)
    assert tma_config(128, 0, 64, 4) == TmaConfig(4, 20, 4, 2)  # the lean loop: next_n <= 2
    # Other head dims keep the bytes in flight: twice the stages at 64, half at 256; below
    # 128 the other calls at n <= 64 take four warpgroups, and the lean loop.
    assert tma_config(64, 1, 64) == TmaConfig(2, 12, 2, 2, 1)
    assert tma_config(64, 0, 64) == TmaConfig(3, 18, 3, 2, 1, 1)  # paired tiles
    assert tma_config(64, 0, 32) == TmaConfig(4, 32, 4, 2, 1)
    assert tma_config(64, 0, 256) == TmaConfig(3, 6, 3, 2)


@pytest.mark.parametrize("n", [8, *SHIPPED_N, 256])
def test_rings_stay_shallow(n):
    """No config queues more than RING_STAGES tiles per SM (deeper rings streamed slower)."""
    for dim in TMA_DIMS:  # the same bytes in flight at other head dims
        depth = max(RING_STAGES * 128 // dim, 8)
        for small in range(3):
            config = tma_config(n, small, dim)
            # (a setmaxnreg config's stages come in rounds of 3 warpgroups x 4 producers)
            assert config.stages <= max(depth, stage_unit(config.warpgroups, config.producers))


@pytest.mark.parametrize("max_seq_len,warpgroups", [(8192, 2), (16384, 3)])
def test_dispatch_plans_small_calls_apart(picked, monkeypatch, max_seq_len, warpgroups):
    """The config follows max_seq_len (its class is part of the plan key), not only the shapes."""
    got, _ = picked
    monkeypatch.setattr(mq_plan, "capability", lambda device: (9, 0))
    plan = plan_of(32, (1, 64, 128, 64), max_seq_len)
    assert got[-1][1][7] == warpgroups
    assert plan.extra == (1,)  # next_n=1 calls stream KV evict-first, small or not
    plan = plan_of(32, (1, 64, 128, 64), 24576 - max_seq_len)  # the other
    assert len(got) == 2 and got[-1][1][7] == 5 - warpgroups
    assert plan.extra == (1,)


@pytest.mark.parametrize("max_seq_len", [8192, 65536])
@pytest.mark.parametrize("evict", [True, False])
def test_options_set_the_kv_policy(picked, monkeypatch, max_seq_len, evict):
    """``kv_evict_first`` overrides the dispatcher's KV policy, small call or not; the config
    stays the dispatcher's."""
    got, _ = picked
    monkeypatch.setattr(mq_plan, "capability", lambda device: (9, 0))
    default = plan_of(32, (1, 64, 128, 64), max_seq_len)
    config = got[-1][1]
    plan = plan_of(32, (1, 64, 128, 64), max_seq_len, MqaLogitsOptions(kv_evict_first=evict))
    assert plan.extra == (int(evict),) and got[-1][1] == config
    assert default.extra == (1,)  # next_n=1: evict-first, small call or not


@pytest.mark.parametrize(
    "batch,geometry,max_seq_len,evict",
    [(32, (1, 64, 128), 8192, True), (256, (1, 64, 128), 8192, True),
     (1024, (1, 64, 128), 2048, True), (255, (1, 64, 128), 8192, True),
     (64, (1, 64, 128), 65536, True), (16, (1, 64, 32), 131072, True),
     (32, (2, 64, 128), 8192, True),
     # next_n 2-3 at head_dim >= 96 (EVICT_MIN_DIM), any batch and heads
     (256, (2, 64, 128), 8192, True), (128, (2, 64, 128), 8192, True),
     (127, (2, 64, 128), 8192, True), (64, (2, 64, 128), 65536, True),
     (128, (3, 64, 128), 16384, True), (64, (3, 64, 128), 16384, True),
     (256, (2, 32, 128), 8192, True), (64, (2, 32, 256), 8192, True),
     (256, (2, 64, 96), 8192, True),
     # next_n=2 at head dims below 96, or next_n=4: evict-normal
     (256, (2, 64, 64), 8192, False), (64, (2, 64, 32), 8192, False),
     (128, (4, 32, 128), 16384, False)],
)  # fmt: skip
def test_dispatcher_kv_policy(picked, monkeypatch, batch, geometry, max_seq_len, evict):
    """Evict-first KV for small calls, every next_n=1 call and next_n=2-3 calls at head_dim
    EVICT_MIN_DIM or more (sessions 26-27); the policy is part of the plan's key."""
    monkeypatch.setattr(mq_plan, "capability", lambda device: (9, 0))
    plan = plan_of(batch, (*geometry, 64), max_seq_len)
    assert plan.extra == (int(evict),)
    assert EVICT_MIN_DIM == 96


def test_dispatch_falls_back_to_the_ring_when_the_tma_kernel_is_missing(picked, monkeypatch):
    got, tma_missing = picked
    tma_missing()
    monkeypatch.setattr(mq_plan, "capability", lambda device: (9, 0))
    plan = plan_of(256, (1, 64, 128, 64), 8192)
    assert [f for f, _ in got] == ["mqa_logits_tma", "mqa_logits"]
    assert plan.kv_args is None


# -- GPU ----------------------------------------------------------------------------------
# TmaConfig(warpgroups, stages, producer warps, Q buffers); "no_pdl": the dispatcher's
# config launched without PDL; "large": the dispatcher's config for calls that are not
# small (the tests' inputs are: auto takes the small-call configs, mqa_logits_tma.tma_config).
TMA_VARIANTS = {
    "auto": None,
    "no_pdl": None,
    "large": None,
    "tma_1x3": TmaConfig(1, 3, 1, 2),  # a 3-stage ring: wraps every third tile
    "tma_2x4p2q1": TmaConfig(2, 4, 2, 1),  # two producer warps, one Q buffer
    "tma_3x6p3q1": TmaConfig(3, 6, 3, 1),  # three warpgroups, one Q buffer
    "tma_4x16p2": TmaConfig(4, 16, 2, 2),  # where next_n*heads fits 4 warpgroups
    # lean: the MMA on the current Q right after the wait, the request checked after (a
    # switch redoes the tile and re-points the store rows)
    "tma_1x3q1l": TmaConfig(1, 3, 1, 1, 1),  # one Q buffer: every switch redoes a tile
    "tma_2x4l": TmaConfig(2, 4, 2, 2, 1),
    "tma_4x16p4l": TmaConfig(4, 16, 4, 2, 1),  # 4 warpgroups: next_n*heads <= 64 only
    # paired tiles: a pair straddling two requests, padding or a run's odd last tile takes
    # the drain-and-redo path
    "tma_1x2q1lp": TmaConfig(1, 2, 1, 1, 1, 1),  # one pair in the ring, one Q buffer
    "tma_2x4lp": TmaConfig(2, 4, 2, 2, 1, 1),
    "tma_3x0lp": TmaConfig(3, 0, 3, 2, 1, 1),  # as many stages as fit (6 at head_dim 256)
    # setmaxnreg: 112 registers a consumer thread at 4 warpgroups, 160 at 3 (4 producer warps)
    "tma_4x8p4r": TmaConfig(4, 8, 4, 2, 0, 0, 112),
    "tma_4x8p4lr": TmaConfig(4, 8, 4, 2, 1, 0, 112),
    "tma_3x12p4lr": TmaConfig(3, 0, 4, 1, 1, 0, 160),  # as many stages as fit
    "tma_2x8p4lpr": TmaConfig(2, 8, 4, 2, 1, 1, 232),  # paired at 232 (shipped: 2 x 16)
}


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def tma_variant(request, monkeypatch) -> MqaLogitsOptions:
    """The options of the variant ``request.param``, with fresh plans and replays."""
    if not _sm90():
        pytest.skip("the TMA kernel runs on sm_90 only")
    options = MqaLogitsOptions(config=TMA_VARIANTS[request.param], pdl=request.param != "no_pdl")
    if request.param == "large":
        monkeypatch.setattr(mq_plan, "small_work", lambda batch, max_seq_len, num_sms: 0)
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback to torch would hide a kernel bug
    mq_plan._plans.clear()
    OP.runner(options).replays.clear()
    return options


def _skip_unfit_pair(config: TmaConfig | None, n: int) -> None:
    """Paired tiles hold two accumulator sets (n/2 f32 each): run them where both fit the
    block's register cap with ~32 to spare."""
    if config is not None and config.pair:
        if n + 32 > reg_cap(tma_threads(config.warpgroups, config.producers)):
            pytest.skip(f"two accumulator sets of next_n*heads={n} do not fit {config}")


def _skip_unfit_regs(config: TmaConfig | None, n: int, dim: int = 128) -> None:
    """setmaxnreg configs: 4 warpgroups at 112 registers fit n <= 128, 3 at 160 n <= 192;
    at head_dim 256 their rounds of stages (4 x 8, 3 x 4 producers) do not fit."""
    if config is not None and config.regs and n > (128 if config.warpgroups == 4 else 192):
        pytest.skip(f"next_n*heads={n} does not fit {config}")
    if config is not None and config.regs and dim > 128:
        pytest.skip(f"{config} does not fit head_dim {dim}")


def _served_by_tma() -> bool:
    return any("mqa_logits_tma" in p.kernel.name for p in mq_plan._plans.values())


@pytest.mark.gpu
@pytest.mark.parametrize("tma_variant", list(TMA_VARIANTS), indirect=True)
@pytest.mark.parametrize(
    "next_n,heads,block_size",
    [(1, 64, 64), (2, 32, 32), (3, 64, 128), (4, 64, 64), (2, 4, 64), (1, 32, 128), (4, 32, 32),
     (2, 64, 64), (2, 64, 128)],
)  # fmt: skip
def test_gpu_tma_matches_reference(tma_variant, next_n, heads, block_size):
    four = (TMA_VARIANTS["tma_4x16p2"], TMA_VARIANTS["tma_4x16p4l"])
    if tma_variant.config in four and next_n * heads > 64:
        pytest.skip("4 warpgroups fit next_n*heads <= 64 only")
    if tma_variant.config == TMA_VARIANTS["tma_3x6p3q1"] and next_n * heads > 192:
        pytest.skip("3 warpgroups fit next_n*heads <= 192 only")
    _skip_unfit_pair(tma_variant.config, next_n * heads)
    _skip_unfit_regs(tma_variant.config, next_n * heads)
    lens = EDGE_LENS + [next_n - 1, 1000, 64 * 7, 3 * block_size]
    run_and_check(
        lens, device="cuda", next_n=next_n, heads=heads, block_size=block_size, seed=17 + next_n,
        options=tma_variant,
    )  # fmt: skip
    assert _served_by_tma()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tma_variant",
    ["auto", "large", "tma_1x3", "tma_2x4p2q1", "tma_4x16p2", "tma_1x3q1l", "tma_2x4l", "tma_4x16p4l",
     "tma_2x4lp", "tma_3x0lp", "tma_4x8p4lr", "tma_3x12p4lr", "tma_2x8p4lpr"],
    indirect=True,
)  # fmt: skip
@pytest.mark.parametrize(
    "dim,next_n,heads,block_size",
    [(64, 1, 64, 64), (64, 2, 32, 32), (32, 2, 64, 64), (32, 1, 32, 128), (256, 1, 64, 64),
     (256, 2, 32, 32), (96, 1, 64, 64), (96, 2, 64, 32), (96, 2, 4, 128)],
)  # fmt: skip
def test_gpu_tma_other_head_dims(tma_variant, dim, next_n, heads, block_size):
    """Column panels in the 32/64-byte swizzles, two 128-byte panels at head_dim 256, three
    32-byte panels at head_dim 96 (and its Q load's row-group order)."""
    four = tma_variant.config in (
        TMA_VARIANTS["tma_4x16p2"],
        TMA_VARIANTS["tma_4x16p4l"],
    )
    if four and (next_n * heads > 64 or dim > 64):
        pytest.skip("4 warpgroups x 16 stages fit next_n*heads <= 64 at head_dim <= 64 only")
    _skip_unfit_pair(tma_variant.config, next_n * heads)
    _skip_unfit_regs(tma_variant.config, next_n * heads, dim)
    lens = EDGE_LENS + [next_n - 1, 1000, 64 * 7, 3 * block_size]
    run_and_check(
        lens, device="cuda", next_n=next_n, heads=heads, dim=dim, block_size=block_size, seed=dim,
        options=tma_variant,
    )  # fmt: skip
    assert _served_by_tma()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tma_variant",
    ["auto", "large", "tma_1x3", "tma_2x4lp", "tma_4x8p4lr", "tma_3x12p4lr", "tma_2x8p4lpr"],
    indirect=True,
)
@pytest.mark.parametrize("length", [0, 1, 65, 1000, 20000])
def test_gpu_tma_one_request(tma_variant, length):
    """One request: cta_tiles' own path (no scan, no search) in the TMA configs."""
    _skip_unfit_pair(tma_variant.config, 2 * 64)
    _skip_unfit_regs(tma_variant.config, 2 * 64)
    run_and_check([length], device="cuda", next_n=2, heads=64, seed=length, options=tma_variant)
    assert length == 0 or _served_by_tma()


def _one_cta_schedule(batch: int) -> torch.Tensor:
    """CTA 0 owns every tile; the others none (a legal, if slow, caller schedule)."""
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    sched = torch.zeros(num_sms + 1, 2, dtype=torch.int32)
    sched[1:, 0] = batch
    return sched.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tma_variant",
    ["auto", "large", "tma_1x3", "tma_2x4p2q1", "tma_3x6p3q1", "tma_1x3q1l", "tma_2x4l"],
    indirect=True,
)
@pytest.mark.parametrize("next_n,heads,block_size", [(1, 64, 64), (2, 64, 32), (1, 32, 128)])
def test_gpu_tma_one_cta_walks_everything(tma_variant, next_n, heads, block_size):
    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 700, (40,), generator=gen).tolist() + [0, 0, 1, 64, 65]
    q, kv, w, table, seq, max_len = make_inputs(
        lens, next_n=next_n, heads=heads, block_size=block_size, device="cuda", seed=9
    )
    got = logits_with(tma_variant)(
        q, kv, w, table, seq, max_len, schedule_meta=_one_cta_schedule(len(lens))
    )
    assert_close(got, reference(q, kv, w, table, seq), 2e-3, name="one CTA")
    assert _served_by_tma()
