"""The dispatcher's short single pass (flashinfer_jit/qsa/short.py: takes_short, QsaOptions.short).

CPU: the rule by capability, head dim, topk and rows x Hkv; the kernel each entry point plans
(kernels stubbed) with the option None, False and True, and its refusals; warm-up and prebuild
(sm_90a only) holding what it launches; the dispatched kernels compiled without spills. GPU:
the dispatched path (sm_90) just above and below the threshold, and the forced one on any arch,
against the float64 reference on fresh inputs with poisoned outputs: -1 indices, topk not a
multiple of the chunk, pages 16 and 64, D 64 and 128, both caches.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import op as qsa_op
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa import short as qs
from flashinfer_jit.qsa import warmup as qsa_warmup
from flashinfer_jit.qsa.plan import QsaOptions, Variant, short_variant

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of
from .test_qsa_short import assert_compiles_without_spills, skip_unless_spills_checked
from .test_replay import FakeKernel, qsa_args, qsa_stub, stub  # noqa: F401 (fixtures)

H200 = ((9, 0), 132)  # capability, SMs
W1S2, W2S2, W1S4 = (qs.SHORT_CONFIGS[n] for n in ("w1s2", "w2s2", "w1s4"))


# -- CPU: the rule -------------------------------------------------------------------------------
def test_the_dispatched_configs_and_thresholds():
    assert qs.SHORT_DISPATCH == W1S2 == (1, 2, 16) and qs.SHORT_WIDE == W2S2 == (2, 2, 8)
    # the H200's thresholds: w1s2 from 11.5, 15.5 and 31 pairs an SM (SHORT_MIN_PAIRS_PER_SM);
    # with bulk copies at topk <= 512 from 5.8 and 15.5 (SHORT_WIDE_MIN_PAIRS_PER_SM)
    topks = (1, 256, 257, 512, 513, 2048, 4096)
    assert [qs.short_min_pairs(132, k, False) for k in topks] == [
        1518, 1518, 2046, 2046, 4092, 4092, 4092]  # fmt: skip
    assert [qs.short_min_pairs(132, k, True) for k in topks] == [
        766, 766, 2046, 2046, 4092, 4092, 4092]  # fmt: skip
    # two warps a row with bulk copies at topk <= 512 up to 11.5 / 16 pairs an SM; past it
    # one warp: w1s4 (12 rows an SM) unless w1s2 (16) takes fewer waves
    assert qs.SHORT_DEEP == W1S4 == (1, 4, 12)
    assert qs.short_config(True, 256, 766, 132) == W2S2
    assert qs.short_config(True, 256, 1518, 132) == W2S2
    assert qs.short_config(True, 256, 1519, 132) == W1S4  # one wave either way
    assert qs.short_config(True, 256, 1584, 132) == W1S4
    assert qs.short_config(True, 256, 1585, 132) == W1S2  # one wave of 16, two of 12
    assert qs.short_config(True, 256, 2112, 132) == W1S2
    assert qs.short_config(True, 256, 2113, 132) == W1S4  # two waves either way
    assert qs.short_config(True, 256, 3168, 132) == W1S4
    assert qs.short_config(True, 256, 3169, 132) == W1S2  # two waves of 16, three of 12
    assert qs.short_config(True, 512, 2112, 132) == W2S2
    assert qs.short_config(True, 512, 2113, 132) == W1S4
    assert qs.short_config(True, 512, 4096, 132) == W1S2
    assert qs.short_config(True, 513, 1000, 132) == W1S2
    assert qs.short_config(False, 256, 1518, 132) == W1S2
    # what warm-up and prebuild list: every config short_config can pick there
    assert qs.short_configs(True, 512) == qs.short_configs(True) == (W1S2, W2S2, W1S4)
    assert qs.short_configs(True, 513) == qs.short_configs(False, 256) == (W1S2,)
    call = qs.ShortCall((9, 0), 128, 16, 256, 1000, 132, True)
    assert short_variant(call) == Variant(config=W2S2, short=True, order=True)


def _call_of(cap, head_dim, topk, pairs, sms, group=16, bulk=False) -> qs.ShortCall:
    return qs.ShortCall(cap, head_dim, group, topk, pairs, sms, bulk)


@pytest.mark.parametrize(
    "cap, head_dim, topk, pairs, sms, more, takes",
    [
        ((9, 0), 128, 256, 1518, 132, {}, True),  # at the threshold (cp.async gathers)
        ((9, 0), 128, 256, 1517, 132, {}, False),  # just below
        ((9, 0), 128, 256, 766, 132, dict(bulk=True), True),  # bulk copies: 2 warps a row
        ((9, 0), 128, 256, 765, 132, dict(bulk=True), False),
        ((9, 0), 128, 512, 2046, 132, dict(bulk=True), True),
        ((9, 0), 128, 512, 2045, 132, dict(bulk=True), False),
        ((9, 0), 128, 512, 2046, 132, {}, True),
        ((9, 0), 128, 512, 2045, 132, {}, False),
        ((9, 0), 64, 2048, 4092, 132, {}, True),
        ((9, 0), 64, 2048, 4091, 132, {}, False),
        ((9, 0), 128, 4096, 4092, 132, {}, True),
        ((9, 0), 128, 2048, 1 << 20, 132, dict(group=8, bulk=True), False),  # TMMA past 512
        ((9, 0), 128, 513, 1 << 20, 132, dict(group=4), False),
        ((9, 0), 128, 512, 4092, 132, dict(group=8, bulk=True), True),
        ((9, 0), 128, 1, 1 << 20, 132, {}, True),
        ((9, 0), 128, 4097, 1 << 20, 132, {}, False),  # past the longest measured selection
        ((9, 0), 128, 0, 4096, 132, {}, False),  # nothing to attend: the single pass's zeros
        ((9, 0), 256, 512, 4096, 132, {}, False),  # w1s2 cannot hold D = 256
        ((9, 0), 128, 512, 1767, 114, {}, True),  # per SM (H100 PCIe: 15.5 x 114 = 1767)
        ((9, 0), 128, 512, 1766, 114, {}, False),
        ((10, 0), 128, 512, 1 << 20, 148, {}, False),  # Blackwell keeps the single pass
        ((10, 3), 128, 512, 1 << 20, 148, {}, False),
        ((10, 7), 128, 512, 1 << 20, 148, {}, False),
        ((8, 9), 128, 512, 1 << 20, 128, {}, False),
    ],
)
def test_takes_short(cap, head_dim, topk, pairs, sms, more, takes):
    assert qs.takes_short(_call_of(cap, head_dim, topk, pairs, sms, **more)) is takes


def test_option_none_false_true():
    cap, sms = H200
    assert qs.short_choice(None, _call_of(cap, 128, 512, 4096, sms), True)
    assert not qs.short_choice(None, _call_of(cap, 128, 512, 4096, sms), False)  # a split: kept
    assert not qs.short_choice(False, _call_of(cap, 128, 512, 4096, sms), True)
    for where in [((10, 0), 1, False), ((8, 9), 4096, True), (cap, 4096, True)]:
        assert qs.short_choice(True, _call_of(where[0], 64, 4096, where[1], sms), where[2])
    assert not qs.short_choice(True, _call_of(cap, 128, 0, 4096, sms), True)  # no selection
    with pytest.raises(ValueError, match=r"QsaOptions\(short=True\).*head_dim 256"):
        qs.short_choice(True, _call_of(cap, 256, 512, 4096, sms), True)
    assert not qs.short_choice(False, _call_of(cap, 256, 512, 4096, sms), True)
    for bad in [1, 0, "yes", 1.0]:
        with pytest.raises(TypeError, match="short must be None, True or False"):
            QsaOptions(short=bad)
    assert QsaOptions().short is None and QsaOptions(short=False).short is False


# -- CPU: what the entry points plan -------------------------------------------------------------
def _planned(monkeypatch, cap: tuple[int, int] = (9, 0)) -> list:
    """The (family, params) of every kernel a call gets, on an H200 of capability ``cap``."""
    monkeypatch.setattr(qsa_plan, "capability", lambda device: cap)
    monkeypatch.setattr(qsa_plan, "prepare", lambda wanted, device: None)
    seen = []
    monkeypatch.setattr(
        qk.KernelFamily, "get", lambda f, p, device: seen.append((f.family, p)) or FakeKernel([])
    )
    return seen


def _call(options: QsaOptions, dispatch: bool, **shape) -> None:
    qsa.OP.runner(options).call(**qsa_args(**shape), dispatch=dispatch)


# rows x Hkv at the H200's threshold for the selection and one row below; (hq, hkv, d, page,
# topk, combined)
PLANNED = [
    (256, 16, 8, 128, 64, 300, True, (2, 128, *W2S2, True, True, True)),  # G 2: TMMA, bulk
    (255, 16, 8, 128, 64, 300, True, None),
    (512, 16, 8, 128, 64, 300, True, (2, 128, *W1S2, True, True, True)),  # 31 pairs an SM
    (1519, 16, 1, 128, 64, 256, True, (16, 128, *W1S4, True, False, True)),  # one warp, 4 stages
    (380, 64, 4, 64, 16, 77, False, (16, 64, *W1S2, False, False, True)),  # cp.async
    (379, 64, 4, 64, 16, 77, False, None),
    (4092, 16, 1, 128, 16, 2048, False, (16, 128, *W1S2, False, False, True)),
    (4091, 16, 1, 128, 16, 2048, False, None),
    (4092, 8, 1, 128, 16, 2048, False, None),  # G 8 past topk 512: the single pass
    (4092, 8, 1, 128, 16, 4097, False, None),  # past SHORT_MAX_TOPK
    (4092, 8, 1, 256, 16, 300, False, None),
]


@pytest.mark.usefixtures("qsa_stub")
@pytest.mark.parametrize("dispatch", [True, False])
@pytest.mark.parametrize("rows, hq, hkv, d, page, topk, combined, short", PLANNED)
def test_entry_points_plan_the_rule(monkeypatch, dispatch, rows, hq, hkv, d, page, topk,
                                    combined, short):  # fmt: skip
    seen = _planned(monkeypatch)
    shape = dict(rows=rows, hq=hq, hkv=hkv, d=d, page=page, topk=topk, combined=combined)
    _call(QsaOptions(), dispatch, **shape)
    families = dict(seen)
    if short is None:
        assert "qsa_decode_short" not in families and "qsa_decode_form" in families
    else:
        assert families["qsa_decode_short"] == short
        assert families["qsa_slots"][1] is True  # the slot pass writes the row order
    seen.clear()
    _call(QsaOptions(short=False), dispatch, **shape)
    assert "qsa_decode_short" not in dict(seen)


@pytest.mark.usefixtures("qsa_stub")
def test_the_gpu_tests_recorder_wraps_the_op_as_called(planned):
    """``planned`` (the GPU tests' record of each planned variant) on a stubbed H200: a
    change of decode_launch's call must not break the GPU tests unseen (698ee07 added an
    argument and the recorder, taking three, failed 21 GPU tests the CPU suite ran none of)."""
    _call(QsaOptions(short=False), True, rows=3, hq=8, hkv=2, d=64, page=16, topk=40)
    assert len(planned) == 1 and isinstance(planned[0], Variant)


@pytest.mark.usefixtures("qsa_stub")
@pytest.mark.parametrize("rows, topk, splits", [(207, 4096, 2), (208, 4096, 1), (160, 2048, 2),
                                                (208, 2048, 1), (127, 2048, 2), (95, 2048, 2),
                                                (160, 8192, 2), (160, 1024, 1)])  # fmt: skip
def test_long_selections_split_past_a_wave(monkeypatch, rows, topk, splits):
    """Hkv 4, head_dim 128 at topk >= 2048: the 2-split up to 832 pairs, in the slot pass's
    row order from 384, then the single pass (512 below topk 2048); warm-up lists what the
    call launches and prebuild holds it."""
    seen = _planned(monkeypatch)
    _call(QsaOptions(short=False), True, rows=rows, hq=64, hkv=4, d=128, page=64, topk=topk)
    families = dict(seen)
    if splits == 1:
        assert "qsa_decode_form" in families and "qsa_decode_cluster" not in families
    else:
        cluster = qk.cluster_family.spec(families["qsa_decode_cluster"]).param_dict
        assert cluster["cluster"] == splits and "qsa_decode_form" not in families
        assert cluster["order"] == (rows * 4 >= qk.ORDERED_SPLIT_MIN_PAIRS_SM90)
        assert (
            families.get("qsa_slots", (64, False))[1] == cluster["order"]
        )  # the slot pass's ORDER
    shipped = qsa.OP.default.options
    forms = (shipped.slot_entries, shipped.tmma, shipped.lean)
    plans = qsa_warmup.dispatch_plans(16, 128, 64, 4, topk, False, 132, forms[0],
                                      qk.H200_WAVE_CLUSTERS.get, *forms[1:],
                                      qk.decode_min_programs((9, 0), topk, 128),
                                      cap=(9, 0))  # fmt: skip
    assert set(seen) <= {(f.family, p) for f, p in plans}
    specs = qsa_warmup.all_specs(16, 128, 64, *forms)
    assert {f.spec(p).label for f, p in plans} <= {sp.label for sp in specs}


@pytest.mark.usefixtures("qsa_stub")
@pytest.mark.parametrize("cap", [(10, 0), (10, 3), (10, 7)])
def test_blackwell_keeps_its_kernels_unless_forced(monkeypatch, cap):
    seen = _planned(monkeypatch, cap)
    shape = dict(rows=4096, hq=16, hkv=1, d=128, page=64, topk=256, combined=True)
    _call(QsaOptions(), True, **shape)
    assert "qsa_decode_short" not in dict(seen)
    seen.clear()
    _call(QsaOptions(short=True), True, **shape)
    assert dict(seen)["qsa_decode_short"] == (16, 128, *W1S2, True, False, True)


@pytest.mark.usefixtures("qsa_stub")
def test_forced_short_replaces_the_split_and_refuses_head_dim_256(monkeypatch):
    seen = _planned(monkeypatch)
    _call(QsaOptions(short=True), True, rows=2, hq=8, hkv=2, d=64, page=16, topk=40)
    families = dict(seen)
    assert families["qsa_decode_short"] == (4, 64, *W1S2, False, True, True)
    assert "qsa_decode_cluster" not in families
    with pytest.raises(ValueError, match=r"short=True.*head_dim 256"):
        _call(QsaOptions(short=True), True, rows=2, hq=8, hkv=2, d=256, page=16, topk=40)


# -- CPU: warm-up and prebuild -------------------------------------------------------------------
@pytest.mark.usefixtures("qsa_stub")
@pytest.mark.parametrize("hq, hkv, d, topk, combined", [(16, 8, 128, 300, True),
                                                       (64, 4, 64, 77, False)])  # fmt: skip
def test_warmup_and_prebuild_hold_the_dispatched_kernel(monkeypatch, hq, hkv, d, topk, combined):
    """What a call at the threshold launches is in warm-up's list and prebuild's."""
    seen = _planned(monkeypatch)
    rows = -(-qs.short_min_pairs(132, topk, combined and d == 128) // hkv)
    shape = dict(hq=hq, hkv=hkv, d=d, page=64, topk=topk, combined=combined)
    _call(QsaOptions(), True, rows=rows, **shape)
    assert "qsa_decode_short" in dict(seen)
    shipped = qsa.OP.default.options
    entries, forms = shipped.slot_entries, (shipped.tmma, shipped.lean)
    reach = qs.short_reached(
        shipped.short, qs.ShortCall((9, 0), d, hq // hkv, topk, 0, 0, combined)
    )
    plans = qsa_warmup.dispatch_plans(hq // hkv, d, 64, hkv, topk, combined, 132, entries,
                                      qk.H200_WAVE_CLUSTERS.get, *forms,
                                      qk.DECODE_MIN_PROGRAMS_SM90, reach)  # fmt: skip
    assert set(seen) <= {(f.family, p) for f, p in plans}
    specs = qsa_warmup.all_specs(hq // hkv, d, 64, entries, *forms, True)
    assert {f.spec(p).label for f, p in plans} <= {s.label for s in specs}
    for option, cap, width in [(None, (10, 0), topk), (False, (9, 0), topk), (None, (9, 0), 0)]:
        assert not qs.short_reached(option, qs.ShortCall(cap, d, hq // hkv, width, 0, 0, combined))


def test_prebuild_adds_the_short_kernels_on_sm_90a_only():
    workloads = qsa.OP.load_workloads()
    specs = qsa.OP.prebuild_specs(workloads, qsa.OP.default.options)
    short = [s for s in specs if s.family == "qsa_decode_short"]
    # D 128: groups 1, 2, 4, 8, 16 x (w1s2 with bulk copies or not, w2s2 and w1s4 with them);
    # D 64: groups 8, 16 (cp.async, w1s2)
    assert len(short) == 22
    configs = {(s.param_dict["num_warps"], s.param_dict["num_stages"]) for s in short}
    assert configs == {(1, 2), (2, 2), (1, 4)}
    assert all(s.param_dict["order"] for s in short)
    archs = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    for spec in short:
        assert [a for a in archs if qsa.OP.prebuilt_on(spec, a)] == ["sm_90a"]
    others = [s for s in specs if s.family != "qsa_decode_short"]
    # the ordered 2-split, like the short pass, for sm_90a only (tests/test_qsa_order.py)
    ordered = [s for s in others if s.family == "qsa_decode_cluster" and s.param_dict["order"]]
    assert ordered and not any(qsa.OP.prebuilt_on(s, "sm_100a") for s in ordered)
    assert all(qsa.OP.prebuilt_on(s, "sm_100a") for s in others if s not in ordered)
    never = qsa.OP.prebuild_specs(workloads, QsaOptions(short=False))
    assert sorted(map(str, never)) == sorted(map(str, others))


def test_dispatched_kernels_compile_without_spills(tmp_path):
    """Prebuild's short kernels and those the GPU tests below reach, for sm_90a."""
    pytest.importorskip("cuda.bindings.nvrtc")
    specs = qsa.OP.prebuild_specs(qsa.OP.load_workloads(), qsa.OP.default.options)
    wanted = {s for s in specs if s.family == "qsa_decode_short"}
    for hq, hkv, d, _, _, combined in GPU_SHAPES:
        family, params = qs.short_plan(hq // hkv, d, combined, W1S2, True, True)
        wanted.add(family.spec(params))
    checked = [
        assert_compiles_without_spills(s, "sm_90a", tmp_path) for s in sorted(wanted, key=str)
    ]
    skip_unless_spills_checked(checked)


# -- GPU -----------------------------------------------------------------------------------------
@pytest.fixture
def planned(monkeypatch, fresh_replays):
    """The variant of every call the op plans (replays emptied, so each call plans)."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback to torch is an error
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", raising=False)
    seen, real = [], qsa_op.decode_launch
    monkeypatch.setattr(qsa_op, "decode_launch", lambda *a: seen.append(a[2]) or real(*a))
    return seen


def _gpu_case(rows: int, shape: tuple, seed: int) -> dict:
    """Fresh random inputs with every hazard, scattered -1 entries and a poisoned output."""
    hq, hkv, d, page, topk, combined = shape
    width = -(-topk // page) + 3
    case = make_case(rows=rows, hq=hq, hkv=hkv, d=d, page=page, topk=topk, width=width,
                     num_blocks=3 * width + 8, device="cuda", seed=seed, combined=combined)  # fmt: skip
    case = add_hazards(case)
    idx = case["logical_indices"]
    holes = torch.rand(idx[:, :-1].shape, generator=torch.Generator().manual_seed(seed)) < 0.1
    idx[:, :-1][holes.cuda()] = -1  # -1 inside the valid counts too, not only leading
    case["out"].fill_(math.nan)
    return case


# (hq, hkv, d, page, topk, combined cache): G 2 (TMMA) with bulk copies, G 16 at D 64, G 16
# over a plain cache, G 16 with bulk copies (two warps a row at the threshold); selections
# not a multiple of the chunk (77, 1999, 40), pages 16 and 64
GPU_SHAPES = [(16, 8, 128, 64, 300, True), (64, 4, 64, 16, 77, False),
              (128, 8, 128, 16, 1999, False), (16, 8, 64, 64, 40, False),
              (64, 4, 128, 64, 256, True)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("side", [0, -1])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_dispatched_short_path(planned, side, shape):
    """rows x Hkv at the device's threshold (the short pass) and just below it (the single
    pass), through qsa_sparse_paged_attention."""
    from jit_kernels import capability, sm_count

    if capability(0) != (9, 0):
        pytest.skip("the dispatcher takes the short single pass on sm_90 only")
    hq, hkv, d, _, topk, combined = shape
    call = qs.ShortCall((9, 0), d, hq // hkv, topk, 0, sm_count(0), combined and d == 128)
    rows = -(-qs.short_min_pairs(call.sms, topk, call.bulk) // hkv) + side
    case = _gpu_case(rows, shape, seed=rows + shape[4])
    got = qsa.qsa_sparse_paged_attention(*args_of(case))
    torch.cuda.synchronize()
    expected = short_variant(call._replace(pairs=rows * hkv))
    assert planned[-1] == (expected if side == 0 else Variant())
    assert_close(got, ref_of(case))
    assert (got[1] == 0).all() and (got[3] == 0).all()  # count 0, no request


@pytest.mark.gpu
@pytest.mark.parametrize("per_sm, config", [(11.5, W1S4), (12, W1S2), (16, W1S4)])
@pytest.mark.parametrize("shape", [(16, 1, 128, 64, 256, True), (64, 16, 128, 16, 200, True)])
def test_gpu_dispatched_one_warp_configs(planned, per_sm, config, shape):
    """Past two warps a row: the first pairs of each one-warp zone (w1s4 in one wave, w1s2
    in one wave, w1s4 in two), G 16 and G 4 (TMMA), through the dispatcher."""
    from jit_kernels import capability, sm_count

    if capability(0) != (9, 0):
        pytest.skip("the dispatcher takes the short single pass on sm_90 only")
    hq, hkv, d, _, topk, _ = shape
    sms = sm_count(0)
    rows = -(-(int(per_sm * sms) + 1) // hkv)
    assert qs.short_config(True, topk, rows * hkv, sms) == config
    case = _gpu_case(rows, shape, seed=rows)
    got = qsa.qsa_sparse_paged_attention(*args_of(case))
    torch.cuda.synchronize()
    assert planned[-1] == Variant(config=config, short=True, order=True)
    assert_close(got, ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_forced_short_path(planned, shape):
    """QsaOptions(short=True) on any arch, at a row count the dispatcher would split."""
    case = _gpu_case(9, shape, seed=shape[4] + 1)
    qsa.OP.runner(QsaOptions(short=True)).call(*args_of(case), dispatch=True)
    torch.cuda.synchronize()
    from jit_kernels import capability, sm_count

    hq, hkv, d, _, topk, combined = shape
    call = qs.ShortCall(capability(0), d, hq // hkv, topk, 9 * hkv, sm_count(0), combined)
    assert planned[-1] == short_variant(call._replace(bulk=combined and d == 128))
    assert_close(case["out"], ref_of(case))
