"""QSA kernel selection (flashinfer_jit.qsa_kernels): the dispatcher's choice for the issue's
calls, warm-up covering exactly what the dispatcher launches, the shipped configs' occupancy,
the bulk-copy row layout, the replay of a bulk launch (CPU, kernels stubbed), and the
loop forms of the single pass (TMMA, LEAN_LOOP: which kernel, compiled without spills). On
the GPU: the slot pass's row order over many rows, a bulk launch's replay with V elsewhere,
the launch choices flipped (programmatic dependent launch, slot-pass entries, loop forms) through the
public functions, and the loop forms over group sizes and head dims.
"""

from __future__ import annotations

import itertools
import math
import subprocess

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa import warmup as qsa_warmup
from flashinfer_jit.qsa.op import with_options
from flashinfer_jit.qsa.plan import QsaOptions, Variant, decode_launch, launch_choice
from flashinfer_jit.qsa.short import decode_short_family

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of
from .test_qsa_short_dispatch import planned  # noqa: F401 (fixture)
from .test_replay import FakeKernel, qsa_args, qsa_stub, stub  # noqa: F401 (fixtures)

SMS = 132  # H200
H200 = qk.H200_WAVE_CLUSTERS.__getitem__  # its clusters (max_active_clusters)
SINGLE = qk.Split(1)  # launch_split's answer at the crossover: the single pass


def _launched(rows: int, hq: int, hkv: int, topk: int, combined: bool) -> tuple:
    """(splits, bulk, config, pair) of the dispatcher on an issue-shaped call (pure rules, the
    H200's SMs and clusters)."""
    splits, config, pair = 1, None, None
    if not qsa.use_fp8_decode_kernel(rows * hkv, torch.uint8):
        splits, config, pair, _ = qk.launch_split(rows, hkv, topk, 128, SMS, H200)
    cluster = splits if splits > 1 else 0
    grid = rows * hkv * splits
    return splits, *qk.gather_choice(128, cluster, grid, SMS, combined, None, config, pair)


def test_issue_calls_take_the_measured_kernels():
    """The H200 sweeps' winners (qsa_kernels docstring) on the issue's calls and the row
    counts of the one-wave sweep."""
    # the bulk single pass: 2 stages a warp (session 27), the cp.async one 3 (V apart)
    assert _launched(512, 64, 4, 2048, True) == (1, True, (4, 2, 4), False)
    assert _launched(2048, 32, 4, 1024, True) == (1, True, (4, 2, 4), False)
    assert _launched(64, 64, 4, 2048, True) == (2, True, (4, 2, 4), False)  # 512 CTAs
    assert _launched(32, 64, 4, 2048, True) == (2, False, (4, 2, 4), False)  # 256 CTAs
    assert _launched(512, 64, 4, 2048, False)[1:] == (False, (4, 3, 4), False)  # V apart
    assert _launched(64, 64, 4, 2048, False)[1:] == (False, (4, 2, 4), False)
    # one wave, one CTA per SM: 16 clusters of 6 (17 fit, 16 of 7 or 8 would not)
    wave, half_wave = (False, qk.WAVE_CONFIG, True), (False, qk.CLUSTER_PAIR_CONFIG, True)
    assert _launched(4, 64, 4, 2048, True) == (6, *wave)
    assert _launched(4, 32, 4, 2048, False) == (6, *wave)
    assert [_launched(r, 64, 4, 2048, True)[0] for r in (3, 6, 8, 12, 16)] == [8, 4, 3, 2, 2]
    assert _launched(1, 64, 4, 2048, True) == (8, *half_wave)  # 32 CTAs: half a wave
    assert _launched(2, 64, 4, 2048, True) == (8, *half_wave)
    assert _launched(17, 64, 4, 2048, True) == (2, False, (4, 2, 4), False)  # 68 > 66 pairs
    # slots past the in-kernel list: the wave split after the slot pass up to 3 splits,
    # else the table
    assert _launched(16, 64, 4, 4096, True) == (2, *wave) and not qk.fused_fits(4096, 2)
    assert _launched(8, 16, 4, 4096, True) == (3, *wave) and not qk.fused_fits(4096, 3)
    assert _launched(4, 64, 4, 8192, True) == (8, False, (4, 2, 4), False)
    assert _launched(4, 64, 4, 300, True)[0] == 2  # 19 chunks: two splits of 8 at most


def test_wave_split_rule():
    """wave_split: the most splits whose clusters all fit, within the chunk and slot bounds;
    none off D=128 or without clusters (before sm_90)."""
    assert [qk.wave_split(p, 128, 2048, H200) for p in (8, 15, 16, 17, 30, 66, 67)] == [
        8, 8, 6, 6, 4, 2, 0]  # fmt: skip
    assert qk.wave_split(4, 64, 2048, H200) == 0 and qk.wave_split(4, 256, 2048, H200) == 0
    assert qk.wave_split(4, 128, 2048, lambda k: 0) == 0
    assert qk.wave_split(4, 128, 640, H200) == 5  # 40 chunks: 5 splits of 8
    assert qk.wave_split(4, 128, 0, H200) == 0
    assert qk.launch_split(qk.DECODE_MIN_PROGRAMS, 1, 2048, 128, SMS, H200) == SINGLE
    assert qk.wave_smem_bytes(2) > 114 * 1024  # one CTA per SM, the rule's premise
    # topk 256 (16 chunks): 4 splits of 4 chunks for at most 16 pairs, else 2 of 8.
    assert [qk.wave_split(p, 128, 256, H200) for p in (1, 16, 17, 32, 66)] == [4, 4, 2, 2, 2]
    assert qk.wave_split(4, 128, 272, H200) == 2  # 17 chunks: the 8-chunk minimum again
    assert qk.wave_split(64, 128, 4096, H200) == 2  # 2048 slots a split: the slot pass's


def test_single_pass_crossover_per_arch():
    """sm_90 (measured on the H200) takes the single pass from rows * Hkv = 512; other archs
    keep the seed's 2048; launch_split and split_count follow the crossover they are given."""
    sm90 = qk.decode_min_programs((9, 0))
    assert sm90 == qk.DECODE_MIN_PROGRAMS_SM90 == 512
    assert qk.decode_min_programs((10, 0)) == qk.decode_min_programs((10, 3)) == 2048
    assert qk.launch_split(128, 4, 2048, 128, SMS, H200, sm90) == SINGLE
    assert qk.launch_split(127, 4, 2048, 128, SMS, H200, sm90)[0] == 2
    assert qk.launch_split(128, 4, 2048, 128, SMS, H200)[0] == 2  # 2048 elsewhere
    assert qk.split_count(128, 4, 2048, sm90) == 1 and qk.split_count(127, 4, 2048, sm90) == 2


def test_single_pass_crossover_long_selections():
    """From topk 4096 sm_90 splits in two up to 832 pairs (a part-empty second wave of the
    single pass measured slower there); shorter selections and other archs keep theirs."""
    long = qk.decode_min_programs((9, 0), qk.LONG_TOPK_SM90)
    assert long == qk.DECODE_MIN_PROGRAMS_SM90_LONG == 832
    assert qk.decode_min_programs((9, 0), qk.LONG_TOPK_SM90 - 1) == 512
    assert qk.decode_min_programs((9, 0), 8192) == 832
    assert qk.decode_min_programs((10, 0), 4096) == 2048
    assert qk.launch_split(160, 4, 4096, 128, SMS, H200, long) == (2, None, None, False)
    assert qk.launch_split(208, 4, 4096, 128, SMS, H200, long) == SINGLE  # 832
    assert qk.launch_split(160, 4, 2048, 128, SMS, H200, 512) == SINGLE


@pytest.mark.parametrize("config, cluster, cap, bulk", [
    (qk.BULK_SINGLE_PASS, 0, 0, True),
    (qk.BULK_CLUSTER, 8, qk.CLUSTER_SLOT_CAP, True),
    (qk.BULK_CLUSTER, 2, 0, True),
    (qk.CLUSTER_CONFIG[128], 8, qk.CLUSTER_SLOT_CAP, False),
    (qk.CLUSTER_PAIR_CONFIG, 8, qk.CLUSTER_SLOT_CAP, False),
    (qk.DECODE_CONFIG[128], 0, 0, False),
])  # fmt: skip
def test_shipped_configs_keep_their_ctas_per_sm(config, cluster, cap, bulk):
    """Each D=128 config's shared memory lets min_ctas CTAs share one SM (228 KB, 1 KB of it
    reserved per CTA): the occupancy its launch bound was sized for."""
    smem = qk.decode_smem_bytes(128, config, cluster, cap, bulk)
    assert config[2] * (smem + 1024) <= 228 * 1024, smem


def test_bulk_row_layout_is_conflict_free():
    """A mirror of bulk_row (templates/qsa/bulk.cuh): rows do not overlap, fit the 4224-byte
    stage, and every 8-lane phase of the K and V fragment reads hits 32 distinct banks."""

    def bulk_row(r):
        b = r & 1
        return (((r >> 1) & 3) + 2 * b & 3) * 1056 + (2 * (r >> 3) + b) * 256

    spans = sorted((bulk_row(r), bulk_row(r) + 256) for r in range(16))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= qk._BULK_STAGE_BYTES

    def banks(addrs):  # 16-byte reads of 8 lanes
        words = [a // 4 + w for a in addrs for w in range(4)]
        return len({w % 32 for w in words}) == len(words)

    for phase in range(4):
        lanes = range(8 * phase, 8 * phase + 8)
        for j in range(2):
            for G in range(2):
                assert banks(
                    [bulk_row(8 * j + (ln >> 2)) + 16 * (4 * G + (ln & 3)) for ln in lanes]
                )
        for tau in range(4):
            tok = [2 * (ln & 3) + (tau & 1) + 8 * (tau >> 1) for ln in lanes]
            assert banks(
                [bulk_row(r) + 128 + 16 * (ln >> 2) for r, ln in zip(tok, lanes, strict=True)]
            )


@pytest.mark.parametrize("hq, hkv, d, topk", [(64, 4, 128, 2048), (32, 8, 128, 4096),
                                              (16, 2, 64, 300), (8, 1, 128, 0)])  # fmt: skip
@pytest.mark.parametrize("combined", [True, False])
@pytest.mark.parametrize("least", [qk.DECODE_MIN_PROGRAMS_SM90, qk.DECODE_MIN_PROGRAMS])
@pytest.mark.usefixtures("qsa_stub")
def test_warmup_plans_are_what_the_dispatcher_launches(
    monkeypatch, hq, hkv, d, topk, combined, least
):
    """Over every row count below the crossover ``least`` (sm_90's and the other archs')
    and one above: the kernels ``_decode_launch`` picks are exactly dispatch_plans
    (warm-up), all within all_specs (prebuild)."""
    monkeypatch.setattr(qsa_plan, "capability", lambda device: (9, 0))
    seen = set()
    kernel = FakeKernel([])
    monkeypatch.setattr(qk.KernelFamily, "get", lambda f, p, device: seen.add((f, p)) or kernel)
    shipped = qsa.OP.default.options
    entries, forms = shipped.slot_entries, (shipped.tmma, shipped.lean)
    clusters = H200
    plans = qsa_warmup.dispatch_plans(
        hq // hkv, d, 64, hkv, topk, combined and d == 128, SMS, entries, clusters, *forms, least
    )
    for rows in range(1, -(-least // hkv) + 1):
        args = qsa_args(rows=rows, hq=hq, hkv=hkv, d=d, page=64, topk=topk, combined=combined)
        splits, config, pair, _ = qk.launch_split(rows, hkv, topk, d, SMS, clusters, least)
        decode_launch(tuple(args.values()), shipped, Variant(splits, None, config, None, pair))
    assert seen == set(plans)
    prebuilt = {s.label for s in qsa_warmup.all_specs(hq // hkv, d, 64, entries, *forms)}
    assert {f.spec(p).label for f, p in plans} <= prebuilt


# SM counts of sm_90 and sm_10x parts (66-160) and beyond, up to what prebuild plans for
SWEEP_SMS = (66, 78, 114, 132, 148, 160, 264, qk.MAX_SMS)
# TOPK: chunk counts on each side of the splits' 8-chunk (4 when short) minimum, and past
# the in-kernel slots of 2, 4 and 8 splits
SWEEP_TOPK = (*(16 * c for c in (4, 7, 8, 12, 15, 16, 17, 23, 24, 31, 32, 39, 40, 47, 48)),
              *(16 * c for c in (55, 56, 63, 64, 65)), 100, 300, 2049, 4097, 8193, 16384)  # fmt: skip


def _reached(sms: int) -> set[str]:
    """The cluster kernels dispatch_plans reaches on ``sms`` SMs: clusters bound by the GPCs
    (the H200's, scaled) or by the SMs alone, every (row, kv head) pair count below the
    seed's crossover and below sm_90's (which splits a subset, some in row order; Hkv 1:
    the rules see only pairs), TOPK as SWEEP_TOPK, V after K or apart."""
    models = (lambda k: qk.H200_WAVE_CLUSTERS[k] * sms // SMS, lambda k: sms // k)
    seen = set()
    for clusters, topk, bulk, cap in itertools.product(
        models, SWEEP_TOPK, (True, False), (None, (9, 0))
    ):
        least = qk.DECODE_MIN_PROGRAMS if cap is None else qk.decode_min_programs(cap, topk, 128)
        plans = qsa_warmup.dispatch_plans(
            16, 128, 64, 1, topk, bulk, sms, 1, clusters, min_programs=least, cap=cap
        )
        seen |= {f.spec(p).label for f, p in plans if f is qk.cluster_family}
    return seen


def test_prebuild_holds_what_devices_up_to_max_sms_reach():
    """all_specs' clusters are exactly those reached on up to MAX_SMS SMs: it leaves out the
    2- and 4-CTA clusters without in-kernel slots two chunks a step, whose table grids are
    half a wave only past 512 SMs (table_pairs_unfused)."""
    reached = set().union(*(_reached(sms) for sms in SWEEP_SMS))
    specs = qsa_warmup.all_specs(16, 128, 64, 1)
    assert reached == {s.label for s in specs if s.family == "qsa_decode_cluster"}
    assert [k for k in qk.CLUSTER_SIZES if qk.table_pairs_unfused(k, qk.MAX_SMS)] == [8]
    assert qk.table_pairs_unfused(2, 516) and qk.table_pairs_unfused(4, 520)


def test_bulk_launch_replays_only_with_v_after_k(request, monkeypatch):
    """A bulk launch relies on V following K; a call with the same metadata but V elsewhere
    takes the full path and its cp.async launch."""
    stubbed = request.getfixturevalue("qsa_stub")
    monkeypatch.setattr(qsa_plan, "capability", lambda device: (9, 0))
    combined = [qsa_args(d=128, page=64, combined=True) for _ in range(3)]
    assert stubbed.runs(lambda: qsa.qsa_sparse_paged_decode(**combined[0])) == 1
    replays = qsa.OP.default.replays
    assert [launch.kv_gap for launch in replays.values()] == [128]
    assert stubbed.runs(lambda: qsa.qsa_sparse_paged_decode(**combined[1])) == 0
    apart = dict(combined[0], v_cache=combined[2]["v_cache"])  # same strides, V elsewhere
    assert stubbed.runs(lambda: qsa.qsa_sparse_paged_decode(**apart)) == 1
    assert [launch.kv_gap for launch in replays.values()] == [0]


def test_loop_forms_pick_their_kernel():
    """TMMA applies to groups of at most 8 heads (ignored above); either flip takes the
    form family, neither the shipped kernel (its specs and prebuild are unchanged)."""
    config = qk.BULK_SINGLE_PASS
    assert qk.decode_plan(8, 128, 0, False, True, config) == (
        qk.decode_family, (8, 128, *config, True))  # fmt: skip
    assert qk.decode_plan(8, 128, 0, False, True, config, tmma=True) == (
        qk.decode_form_family, (8, 128, *config, True, True, False))  # fmt: skip
    assert qk.decode_plan(16, 128, 0, False, True, config, tmma=True)[0] is qk.decode_family
    assert qk.decode_plan(16, 128, 0, False, True, config, lean=True)[1][-2:] == (False, True)
    plans = qsa_warmup.dispatch_plans(8, 128, 64, 4, 1024, True, SMS, 1, H200, True, True)
    assert qk.decode_plan(8, 128, 0, False, True, config, True, True) in plans
    labels = {s.label for s in qsa_warmup.all_specs(8, 128, 64, 1, True, False)}
    assert qk.decode_form_family.spec((8, 128, *config, True, True, False)).label in labels


# (group, head dim, bulk, tmma, lean) of the loop forms the GPU tests run.
FORMS = [(8, 128, True, True, False), (8, 128, True, True, True), (16, 128, True, False, True),
         (1, 128, False, True, True), (5, 64, False, True, False), (3, 256, False, True, True)]  # fmt: skip


def test_loop_forms_compile_without_spills(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import TEMPLATE_ROOT
    from jit_kernels import compile_cubin, render
    from jit_kernels.params import cuobjdump

    tool = cuobjdump()
    for group, d, bulk, tmma, lean in FORMS:
        config = qk.default_config(d, 0, bulk)
        family, params = qk.decode_plan(group, d, 0, False, bulk, config, tmma, lean)
        kernel = compile_cubin(render(family.spec(params), TEMPLATE_ROOT), "sm_90a")
        assert kernel.messages == "", kernel.messages  # NVRTC and ptxas said nothing
        if tool is None:
            continue
        path = tmp_path / "k.cubin"
        path.write_bytes(kernel.cubin)
        usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True)
        assert "LOCAL:0" in usage.stdout and "STACK:0" in usage.stdout, usage.stdout
    if tool is None:
        pytest.skip("cuobjdump not installed: compiled without a message, spills unchecked")


# -- GPU -----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_row_order_many_rows(request):
    """The slot pass's counting sort over more rows than its CTA has threads (several loop
    trips) and uneven counts, through the single pass (short=False: on sm_90 these 1400
    pairs would take the short pass), against the float64 reference."""
    case = make_case(rows=700, hq=16, hkv=2, d=128, page=64, topk=96, width=4, num_blocks=40,
                     device="cuda", seed=9, combined=True)  # fmt: skip
    counts = torch.randint(0, 97, (700,), generator=torch.Generator().manual_seed(9))
    case["logical_indices"][:, -1] = counts.to("cuda", torch.int32)
    seen = request.getfixturevalue("planned")  # strict; each call's variant
    got = qsa.OP.runner(with_options(short=False)).call(*args_of(case), dispatch=False)
    torch.cuda.synchronize()
    assert seen == [Variant()]  # the single pass, after the ordering slot pass
    assert_close(got, ref_of(case))


@pytest.mark.gpu
def test_gpu_bulk_replay_with_v_elsewhere(monkeypatch):
    """The same metadata with V in another buffer: not the bulk launch's replay."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = add_hazards(make_case(rows=9, hq=16, hkv=2, d=128, page=64, topk=300, width=8,
                                 num_blocks=30, device="cuda", seed=4, combined=True))  # fmt: skip
    assert_close(qsa.qsa_sparse_paged_decode(*args_of(case)), ref_of(case))
    other = make_case(rows=9, hq=16, hkv=2, d=128, page=64, topk=300, width=8, num_blocks=30,
                      device="cuda", seed=5, combined=True)  # fmt: skip
    case["v_cache"] = other["v_cache"]
    case["out"].fill_(math.nan)
    assert_close(qsa.qsa_sparse_paged_decode(*args_of(case)), ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [3, 40, 512])  # one-wave cluster, bulk cluster, single pass
def test_gpu_flips_back_to_back(monkeypatch, rows):
    """PDL and 4 slot entries per thread, flipped: back-to-back calls whose q is rewritten by
    a torch kernel just before each (a kernel reading q before the wait would see the old
    one), each against its reference."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    runner = qsa.OP.runner(with_options(pdl=True, slot_entries=4))
    case = add_hazards(make_case(rows=rows, hq=16, hkv=4, d=128, page=64, topk=600, width=12,
                                 num_blocks=40, device="cuda", seed=rows, combined=True))  # fmt: skip
    splits = qsa_plan.dispatch_split(rows, 4, 600, 128, torch.uint8, 0, group=4, bulk=True)
    splits = splits.num_splits
    assert splits == {3: 4, 40: 2, 512: 1}[rows]
    fresh = [torch.randn_like(case["q"], dtype=torch.float32).to(torch.bfloat16) for _ in range(2)]
    outs = [torch.full_like(case["out"], math.nan) for _ in fresh]
    for q, out in zip(fresh, outs, strict=True):
        case["q"].copy_(q)
        runner((*args_of(dict(case, out=out)), True))  # the attention entry point
    for q, out in zip(fresh, outs, strict=True):
        assert_close(out, ref_of(dict(case, q=q)))


@pytest.mark.gpu
@pytest.mark.parametrize("group, d, bulk, tmma, lean", FORMS)
@pytest.mark.parametrize("topk", [40, 1000])
def test_gpu_loop_forms(monkeypatch, group, d, bulk, tmma, lean, topk):
    """The loop forms, each flipped, through the public single pass: every group size
    class and head dim, short and long selections, with the -1 / valid-count / bad-request /
    bad-page hazards, against the float64 reference."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    runner = qsa.OP.runner(with_options(tmma=tmma, lean=lean))
    case = add_hazards(make_case(rows=9, hq=2 * group, hkv=2, d=d, page=64, topk=topk,
                                 width=-(-topk // 64) + 3, num_blocks=60, device="cuda",
                                 seed=group + d + topk, combined=bulk))  # fmt: skip
    case["out"].fill_(math.nan)
    launch = decode_launch(args_of(case), runner.options, Variant())
    family = "qsa_decode_form" if tmma and group <= 8 or lean else "qsa_decode"
    assert launch.kernel.name.startswith(family + "[")
    got = runner((*args_of(case), False))  # the decode entry point
    torch.cuda.synchronize()
    assert_close(got, ref_of(case))
    assert (got[1] == 0).all() and (got[3] == 0).all()


def test_launch_choice_is_what_a_call_launches():
    """plan.launch_choice, the one planner of decode_launch and the sweep tools: the single
    pass runs after an ordering slot pass and reads its order; a fused cluster launches no
    slot pass; the short pass is qsa_decode_short after an ordering slot pass; a refused
    variant raises before anything is planned."""
    options = QsaOptions()
    single = launch_choice(Variant(), options, 16, 128, 2048, 64, 2048, 132, True)
    assert (single.num_splits, single.cluster, single.fused, single.order) == (1, 0, False, True)
    assert single.kernel[0] is qk.decode_form_family and single.slots is not None
    fused = launch_choice(Variant(num_splits=4), options, 16, 128, 2048, 64, 16, 132, True)
    assert (fused.num_splits, fused.cluster, fused.fused, fused.order) == (4, 4, True, False)
    assert fused.kernel[0] is qk.cluster_family and fused.slots is None
    w1s2 = Variant(config=(1, 2, 16), short=True, order=True)
    short = launch_choice(w1s2, options, 16, 128, 256, 64, 4096, 132, True)
    assert short.kernel[0] is decode_short_family and short.order and short.slots is not None
    with pytest.raises(ValueError, match="order=False"):
        launch_choice(Variant(order=False), options, 16, 128, 256, 64, 4096, 132, True)
