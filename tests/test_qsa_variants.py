"""QSA opt-in decode variants (flashinfer_jit.qsa_variants): host rules on the CPU, every
variant compiled without spills, and on the GPU each variant against the float64 reference
with every masking hazard. The GPU part is what tools/bench_qsa.py --sweep-variants relies
on before it times anything.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit import qsa_variants as qv
from flashinfer_jit.qsa_ref import qsa_decode_torch

from .test_qsa import _cuobjdump, add_hazards, args_of, assert_close, make_case, ref_of

# The target calls as (rows, Hq, Hkv, topk): two single-pass, two cluster calls.
TARGETS = [(64, 64, 4, 2048), (512, 64, 4, 2048), (2048, 32, 4, 1024), (4, 64, 4, 2048)]


def bench_args(rows, hq, hkv, topk, num_blocks=8):
    """Meta-only stand-ins (CPU, tiny cache) with the benchmark's layout: the combined
    [blocks, Hkv, page, 2D] cache transposed and split, so V follows K in memory."""
    kv = torch.zeros(num_blocks, hkv, 64, 256, dtype=torch.uint8)
    k_cache, v_cache = kv.transpose(1, 2).split(128, dim=-1)
    q = torch.zeros(rows, hq, 128, dtype=torch.bfloat16)
    idx = torch.zeros(rows, topk + 1, dtype=torch.int32)
    return (q, k_cache, v_cache, idx, torch.zeros(2, 4, dtype=torch.int32))


# -- CPU: host rules -----------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("config", [(4, 3, 4), (4, 8, 1), (8, 3, 2)])
@pytest.mark.parametrize("cluster, cap", [(0, 0), (4, 0), (2, 1024)])
def test_smem_formula_matches_shipped(head_dim, config, cluster, cap):
    shipped = qsa._decode_smem_bytes(head_dim, *config, cluster, cap)
    assert qv.decode_smem_bytes(head_dim, *config, cluster, cap, bulk=False) == shipped
    if head_dim == 128:  # bulk stages exist for D = 128 only: larger stages plus the barriers
        bulk = qv.decode_smem_bytes(head_dim, *config, cluster, cap, bulk=True)
        assert bulk >= shipped + config[0] * config[1] * 8


def test_variant_tables_apply_to_their_targets():
    """Every variant applies to an issue call of its path; the only refusals there are
    one-wave variants on bigger grids and variants that would lose occupancy."""
    used = set()
    for rows, hq, hkv, topk in TARGETS:
        args = bench_args(rows, hq, hkv, topk)
        single = qsa.use_fp8_decode_kernel(rows * hkv, torch.uint8)
        table = qv.SINGLE_VARIANTS if single else qv.CLUSTER_VARIANTS
        for name, variant in table.items():
            reason = qv.refusal(variant, args, device_sms=132)
            if reason is None:
                used.add((single, name))
            else:
                assert "one-wave" in reason or "CTAs per SM" in reason, f"{name}: {reason}"
                assert variant.one_wave or "tma" in variant.features, f"{name}: {reason}"
    assert used == {(True, n) for n in qv.SINGLE_VARIANTS} | {
        (False, n) for n in qv.CLUSTER_VARIANTS
    }
    assert "CTAs per SM" in qv.refusal(
        qv.CLUSTER_VARIANTS["ig+tma256"], bench_args(*TARGETS[0]), device_sms=132
    )


def test_refusals_name_the_rule():
    args = bench_args(512, 64, 4, 2048)  # a single-pass call
    assert "cluster-only" in qv.refusal(qv.Variant(("ilv",)), args)
    assert "cluster-only" in qv.refusal(qv.Variant(cluster=16), args)
    assert "unknown" in qv.refusal(qv.Variant(("nope",)), args)
    assert "kv256 needs tma" in qv.refusal(qv.Variant(("kv256",)), args)
    assert "config" in qv.refusal(qv.Variant(config=(6, 3, 1)), args)
    assert "shared memory" in qv.refusal(qv.Variant(config=(16, 8, 1)), args)
    small = bench_args(4, 64, 4, 2048)  # a cluster call (8 splits)
    assert "single-pass-only" in qv.refusal(qv.Variant(("order",)), small)
    assert "cluster size" in qv.refusal(qv.Variant(cluster=32), small)
    assert "one-wave" in qv.refusal(
        qv.Variant(one_wave=True), bench_args(64, 64, 4, 2048), device_sms=132
    )
    assert qv.refusal(qv.Variant(("order",)), small, splits=1) is None  # forced single pass
    # a plain (not combined) cache: V does not follow K, but the strides are linear
    plain = make_case(rows=2, hq=8, hkv=2, d=128, page=64, topk=64, width=2, num_blocks=8)
    plain_args = args_of(plain)
    assert "V right after K" in qv.refusal(qv.Variant(("tma", "kv256")), plain_args, splits=1)
    assert qv.refusal(qv.Variant(("tma", "lin")), plain_args, splits=1) is None
    d64 = args_of(make_case(rows=2, d=64))
    assert "head_dim 128" in qv.refusal(qv.Variant(("tma",)), d64, splits=1)
    # a block stride that is no multiple of the token stride
    kv = torch.zeros(8, 64 * 2 * 128 + 16, dtype=torch.uint8)
    odd = kv[:, : 64 * 2 * 128].view(8, 64, 2, 128)
    odd_args = (plain_args[0], odd, odd, *plain_args[3:])
    assert "whole multiples" in qv.refusal(qv.Variant(("lin",)), odd_args, splits=1)


def test_splits_for_follows_the_dispatcher():
    assert qv.splits_for(qv.Variant(), bench_args(512, 64, 4, 2048)) == 1
    assert qv.splits_for(qv.Variant(), bench_args(4, 64, 4, 2048)) == 8
    assert qv.splits_for(qv.Variant(cluster=16), bench_args(4, 64, 4, 2048)) == 16
    assert qv.splits_for(qv.Variant(cluster=16), bench_args(4, 64, 4, 2048), splits=1) == 1
    assert qv.splits_for(qv.Variant(), bench_args(64, 64, 4, 2048), splits=3) == 3


def test_bulk_row_layout_is_conflict_free():
    """A mirror of bulk_row (templates/qsa_bulk.cuh): rows do not overlap, fit the 4224-byte
    stage, and every 8-lane phase of the K and V fragment reads hits 32 distinct banks."""

    def bulk_row(r):
        b = r & 1
        return (((r >> 1) & 3) + 2 * b & 3) * 1056 + (2 * (r >> 3) + b) * 256

    spans = sorted((bulk_row(r), bulk_row(r) + 256) for r in range(16))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= qv.BULK_STAGE_BYTES

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


# -- CPU: every variant compiles without spills ------------------------------------------------
def _compiled_specs() -> list:
    specs = qv.variant_specs(16, 128, 1, 2048) + qv.variant_specs(8, 128, 1, 1024)
    specs += qv.variant_specs(16, 128, 8, 2048) + qv.variant_specs(16, 128, 2, 2048)
    specs += qv.variant_specs(5, 64, 4, 300)  # another group and head dim (no bulk)
    specs.append(qv._cluster_x.spec((16, 128, 4, 3, 4, 2, 0, qv.FEATURES["ilv"])))  # slot pass
    specs.append(qv._slots_order.spec((64,)))
    return list(dict.fromkeys(specs))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_variants_compile_without_spills(arch, tmp_path):
    """Every variant for sm_90a (where they are measured) without spills; the richest ones
    also compile for Blackwell (not shipped there: register use is not checked)."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import TEMPLATE_ROOT
    from jit_kernels import compile_cubin, render

    specs = _compiled_specs()
    if arch != "sm_90a":
        specs = [s for s in specs if s.param_dict.get("feat", 0) in (0, 95, 100, 60)]
    tool = _cuobjdump() if arch == "sm_90a" else None
    for spec in specs:
        kernel = compile_cubin(render(spec, TEMPLATE_ROOT), arch)
        assert kernel.cubin and kernel.entry
        if tool is None:
            continue
        path = tmp_path / "k.cubin"
        path.write_bytes(kernel.cubin)
        usage = subprocess.run(
            [tool, "-res-usage", str(path)], capture_output=True, text=True
        ).stdout
        assert "LOCAL:0" in usage and "STACK:0" in usage, f"{spec.label} spills on {arch}: {usage}"


# -- GPU -----------------------------------------------------------------------------------------
def _hazard_case(rows, hq, hkv, topk, seed, combined=True):
    width = -(-topk // 64) + 3
    case = make_case(
        rows=rows,
        hq=hq,
        hkv=hkv,
        d=128,
        page=64,
        topk=topk,
        width=width,
        num_blocks=3 * width + 10,
        device="cuda",
        seed=seed,
        combined=combined,
    )
    return add_hazards(case)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(qv.SINGLE_VARIANTS))
@pytest.mark.parametrize("hq, hkv", [(32, 2), (16, 2)])
def test_gpu_single_pass_variants(name, hq, hkv):
    case = _hazard_case(9, hq, hkv, 300, seed=hq + len(name))
    qv.run_variant(args_of(case), qv.SINGLE_VARIANTS[name], splits=1)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(qv.CLUSTER_VARIANTS))
@pytest.mark.parametrize("topk, splits", [(40, 2), (1000, None)])
def test_gpu_cluster_variants(name, topk, splits):
    """Short (3 chunks, 2 splits) and long selections (the dispatcher's 4 splits, a
    one-wave grid; the variants' own cluster sizes), fused slots."""
    variant = qv.CLUSTER_VARIANTS[name]
    if variant.cluster and -(-topk // 16) < variant.cluster:
        pytest.skip("fewer chunks than splits")
    case = _hazard_case(5, 32, 2, topk, seed=topk + len(name))
    qv.run_variant(args_of(case), variant, splits=splits)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("features", [("tma", "lin"), ("lin", "qk2", "gate"), ("tma", "qk2")])
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_plain_cache_variants(features, splits):
    """A plain [blocks, page, Hkv, D] cache (V apart from K): 128-byte bulk copies and
    linear addressing with other strides."""
    case = _hazard_case(5, 16, 2, 700, seed=21 + splits, combined=False)
    qv.run_variant(args_of(case), qv.Variant(features), splits=splits)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("features", [("ilv",), ("ilv", "gate", "tma", "kv256")])
def test_gpu_interleaved_split_with_slot_pass(features):
    """Splits too long for the in-kernel slot list: kFeatIlv over the slot pass's slots."""
    case = _hazard_case(7, 16, 1, 3000, seed=3)
    assert not qsa._fused_fits(3000, 2)
    qv.run_variant(args_of(case), qv.Variant(features), splits=2)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
def test_gpu_row_order_many_rows():
    """The slot pass's counting sort over more rows than its CTA has threads (several
    loop trips), uneven counts, against the torch path."""
    case = make_case(
        rows=700,
        hq=16,
        hkv=2,
        d=128,
        page=64,
        topk=96,
        width=4,
        num_blocks=40,
        device="cuda",
        seed=9,
        combined=True,
    )
    counts = torch.randint(0, 97, (700,), device="cuda", dtype=torch.int32)
    case["logical_indices"][:, -1] = counts
    expect = torch.empty_like(case["out"])
    qsa_decode_torch(*args_of(case)[:6], expect, *args_of(case)[7:])
    qv.run_variant(args_of(case), qv.Variant(("order", "spec", "gate")), splits=1)
    torch.cuda.synchronize()
    torch.testing.assert_close(case["out"].float(), expect.float(), atol=2e-2, rtol=2e-2)
