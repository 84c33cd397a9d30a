"""QSA fp8 sparse paged decode: torch path, kernels, dispatch, edge cases, graphs, warm-up.

Every result is compared against ``reference`` below: float64, one row at a time, written
from the issue's rules and independent of flashinfer_jit.qsa_ref.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from flashinfer_jit import qsa
from flashinfer_jit.qsa import (
    qsa_sparse_paged_attention,
    qsa_sparse_paged_decode,
    use_fp8_decode_kernel,
    warmup_qsa_fp8_decode,
)

TOL = 5e-3


# -- an independent float64 reference ---------------------------------------------------------
def reference(q, k_cache, v_cache, indices, block_table, token_to_req, gate, scale, out_scale):
    q, gate = q.double().cpu(), gate.double().cpu()
    kc = k_cache.cpu()
    vc = v_cache.cpu()
    if kc.dtype == torch.uint8:
        kc, vc = kc.view(torch.float8_e4m3fn), vc.view(torch.float8_e4m3fn)
    indices, block_table, token_to_req = indices.cpu(), block_table.cpu(), token_to_req.cpu()
    rows, hq, d = q.shape
    nb, ps, hkv, _ = kc.shape
    group = hq // hkv
    topk = indices.shape[1] - 1
    nreq, width = block_table.shape
    result = torch.zeros(rows, hq, d, dtype=torch.float64)
    for r in range(rows):
        req = int(token_to_req[r])
        count = min(max(int(indices[r, topk]), 0), topk)
        picks = []
        for j in range(count):
            logical = int(indices[r, j])
            if logical < 0 or not 0 <= req < nreq:
                continue
            page = logical // ps
            if page >= width:
                continue
            phys = int(block_table[req, page])
            if 0 <= phys < nb:
                picks.append((phys, logical % ps))
        if not picks:
            continue
        pages = torch.tensor([p for p, _ in picks])
        offs = torch.tensor([o for _, o in picks])
        keys = kc[pages, offs].double()  # [n, Hkv, D]
        values = vc[pages, offs].double()
        for h in range(hq):
            kvh = h // group
            s = keys[:, kvh] @ q[r, h] * scale
            p = torch.softmax(s, dim=0)
            result[r, h] = (p @ values[:, kvh]) * out_scale * torch.sigmoid(gate[r, h])
    return result


def assert_close(out, ref):
    """The issue's bar, read norm-wise, plus a looser elementwise check.

    The output is bf16, and storing it rounds every element by up to 2^-8 relative (a
    norm-wise ~2.2e-3): an elementwise 5e-3 bar leaves the kernel almost nothing and fails
    on elements that happen to round badly. So, per (row, head):
      * ||out - ref|| / ||ref|| < TOL (5e-3), the issue's "relative error under 5e-3";
      * every element within 2^-8 |ref| (bf16 rounding) + 4e-3 max|ref| of its head row
        (room for fp16 P and fp32 sums on elements near zero; an emulation of the kernel's
        roundings uses about 40% of it), which still catches any single wrong element,
        masked token or swapped dim;
      * a head row whose reference is all zero (nothing attended) is exactly zero.
    """
    out = out.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    if ref.numel() == 0:
        return
    diff = out - ref
    ref_norm = ref.norm(dim=-1)
    empty = ref_norm == 0
    assert (out[empty] == 0).all(), "a head row with nothing attended is not zero"
    rel = diff.norm(dim=-1)[~empty] / ref_norm[~empty]
    if rel.numel():
        worst = rel.max().item()
        assert worst < TOL, f"max norm-wise relative error per (row, head) {worst:.3e} >= {TOL}"
    row_max = ref.abs().amax(dim=-1, keepdim=True)
    bound = 2.0**-8 * ref.abs() + 4e-3 * row_max
    excess = (diff.abs() - bound).max().item()
    assert excess <= 0, f"an element is off by {excess:.3e} past 2^-8|ref| + 4e-3 max|ref|"


# -- inputs --------------------------------------------------------------------------------
def make_case(rows=3, hq=8, hkv=2, d=64, page=16, topk=40, num_blocks=24, num_requests=3,
              width=6, seed=0, device="cpu", combined=False, dtype=torch.float8_e4m3fn):
    """Random inputs; the cache is either plain or the combined [nb, Hkv, page, 2D] split."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, hq, d, generator=gen).to(torch.bfloat16)
    gate = (2 * torch.randn(rows, hq, d, generator=gen)).to(torch.bfloat16)
    if combined:
        kv = (torch.randn(num_blocks, hkv, page, 2 * d, generator=gen) * 2).to(torch.float8_e4m3fn)
        kv = kv.to(device)
        if dtype == torch.uint8:
            kv = kv.view(torch.uint8)
        k_cache, v_cache = kv.transpose(1, 2).split(d, dim=-1)
    else:
        k_cache = (torch.randn(num_blocks, page, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn)
        v_cache = (torch.randn(num_blocks, page, hkv, d, generator=gen) * 2).to(torch.float8_e4m3fn)
        k_cache, v_cache = k_cache.to(device), v_cache.to(device)
        if dtype == torch.uint8:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_table = torch.randperm(num_blocks, generator=gen)[: num_requests * width]
    block_table = block_table.reshape(num_requests, width).to(torch.int32)
    context = width * page
    indices = torch.full((rows, topk + 1), -1, dtype=torch.int32)
    for r in range(rows):
        count = int(torch.randint(topk // 2, topk + 1, (1,), generator=gen))
        picks = torch.randperm(context, generator=gen)[:count]
        indices[r, : picks.numel()] = picks.to(torch.int32)
        indices[r, topk] = picks.numel()
    token_to_req = torch.randint(0, num_requests, (rows,), generator=gen).to(torch.int32)
    return dict(
        q=q.to(device), k_cache=k_cache, v_cache=v_cache, logical_indices=indices.to(device),
        block_table=block_table.to(device), token_to_req=token_to_req.to(device),
        out=torch.full_like(q, float("nan")).to(device), output_gate=gate.to(device),
        softmax_scale=1.0 / math.sqrt(d), output_scale=0.75,
    )


def add_hazards(case):
    """Every masking rule at once: leading -1s, counts 0 and > TOPK, bad requests/pages."""
    idx = case["logical_indices"].clone()
    bt = case["block_table"].clone()
    t2r = case["token_to_req"].clone()
    rows, width = idx.shape
    topk = width - 1
    nb = case["k_cache"].shape[0]
    idx[0, : min(topk, 33)] = -1                      # leading chunk of -1 (the NaN trap)
    if rows > 1:
        idx[1, topk] = 0                              # nothing valid
    if rows > 2:
        idx[2, topk] = topk + 100                     # count past TOPK: clamp
    if rows > 3:
        t2r[3] = -1                                   # no request
    if rows > 4:
        t2r[4] = bt.shape[0] + 2                      # request past the table
    if rows > 5:
        idx[5, : topk // 2] = bt.shape[1] * case["k_cache"].shape[1] + 5  # page past width
    bt[0, 0] = -1                                     # unmapped page
    bt[-1, -1] = nb + 3                               # physical page past the cache
    if rows > 6:                                      # entries past the count hold garbage
        count = int(idx[6, topk].clamp(0, topk))
        idx[6, count:topk] = 0
    case.update(logical_indices=idx, block_table=bt, token_to_req=t2r)
    return case


def ref_of(case):
    return reference(case["q"], case["k_cache"], case["v_cache"], case["logical_indices"],
                     case["block_table"], case["token_to_req"], case["output_gate"],
                     case["softmax_scale"], case["output_scale"])


ARG_ORDER = ("q", "k_cache", "v_cache", "logical_indices", "block_table", "token_to_req", "out",
             "output_gate", "softmax_scale", "output_scale")


def args_of(case):
    return tuple(case[k] for k in ARG_ORDER)


# -- CPU: the torch path against the reference -------------------------------------------------
@pytest.mark.parametrize(
    "shape",
    [
        dict(hq=8, hkv=2, d=64, page=16, topk=40),
        dict(hq=3, hkv=3, d=64, page=48, topk=17, width=2),
        dict(hq=16, hkv=1, d=128, page=64, topk=100, width=3),
        dict(hq=10, hkv=2, d=256, page=32, topk=9),
    ],
)
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("fn", [qsa_sparse_paged_decode, qsa_sparse_paged_attention])
def test_torch_path_matches_reference(shape, combined, fn):
    case = make_case(seed=hash((tuple(shape.items()), combined)) % 1000, combined=combined, **shape)
    got = fn(*args_of(case))
    assert got is case["out"]
    assert_close(got, ref_of(case))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8])
def test_torch_path_hazards(dtype):
    case = add_hazards(make_case(rows=8, topk=48, seed=5, dtype=dtype))
    got = qsa_sparse_paged_attention(*args_of(case))
    ref = ref_of(case)
    assert_close(got, ref)
    assert (got[1] == 0).all() and (got[3] == 0).all() and (got[4] == 0).all()


def test_empty_row_is_zero_even_with_nan_gate():
    case = make_case(rows=2, topk=8)
    case["logical_indices"][0, -1] = 0
    case["output_gate"][0] = float("nan")
    got = qsa_sparse_paged_decode(*args_of(case))
    assert (got[0] == 0).all()


def test_rows_zero_and_topk_zero():
    case = make_case(rows=0, topk=8)
    assert qsa_sparse_paged_attention(*args_of(case)).shape[0] == 0
    case = make_case(rows=2, topk=0)
    assert (qsa_sparse_paged_attention(*args_of(case)) == 0).all()


@pytest.mark.parametrize(
    "mutate, exc, words",
    [
        (lambda c: c.update(q=c["q"].float()), TypeError, "q must be"),
        (lambda c: c.update(out=c["out"][:, :4]), ValueError, "out must have q's shape"),
        (lambda c: c.update(k_cache=c["k_cache"].float()), TypeError, "k_cache must be"),
        (lambda c: c.update(v_cache=c["v_cache"][:, :8]), ValueError, "v_cache must match"),
        (lambda c: c.update(q=c["q"][:, :3], out=c["out"][:, :3], output_gate=c["output_gate"][:, :3]),
         ValueError, "multiple of num_kv_heads"),
        (lambda c: c.update(logical_indices=c["logical_indices"].long()), TypeError, "logical_indices"),
        (lambda c: c.update(logical_indices=c["logical_indices"][:2]), ValueError, "logical_indices must be"),
        (lambda c: c.update(token_to_req=c["token_to_req"][:1]), ValueError, "token_to_req must have"),
        (lambda c: c.update(block_table=c["block_table"][0]), ValueError, "block_table must be"),
        (lambda c: c.update(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ],
)
def test_bad_arguments_raise(mutate, exc, words):
    case = make_case()
    mutate(case)
    with pytest.raises(exc, match=words):
        qsa_sparse_paged_attention(*args_of(case))


def test_custom_op_fake_and_opcheck():
    case = make_case(rows=2, topk=16, dtype=torch.uint8)  # opcheck does arithmetic on inputs
    torch.library.opcheck(qsa._qsa_op, (*args_of(case), True))


def test_gate_and_warmup_on_cpu():
    assert use_fp8_decode_kernel(10**6, torch.float8_e4m3fn)
    assert use_fp8_decode_kernel(10**6, torch.uint8)
    assert not use_fp8_decode_kernel(10**6, torch.bfloat16)
    assert not use_fp8_decode_kernel(1, torch.float8_e4m3fn)
    kv = torch.zeros(4, 2, 16, 256, dtype=torch.uint8)
    assert warmup_qsa_fp8_decode(kv, torch.zeros(2, 4, dtype=torch.int32),
                                 num_query_heads=16, selection_width=64) == ()


def test_split_plan(monkeypatch):
    monkeypatch.setattr(qsa, "_sm_count", lambda device: 132)
    monkeypatch.setattr(qsa, "SPLIT_K_CLUSTER", False)
    assert qsa._split_plan(4, 4, 2048, 128, 0) == (16, None)
    monkeypatch.setattr(qsa, "SPLIT_K_CLUSTER", True)
    config = qsa.DECODE_CONFIG[128]
    assert qsa._split_plan(1, 4, 8192, 128, 0) == (64, None)  # far past the largest cluster
    assert qsa._split_plan(4, 4, 2048, 128, 0) == (8, (*config, 8, 1024))  # 16 wanted
    assert qsa._split_plan(4, 4, 256, 128, 0) == (2, (*config, 2, 1024))
    assert qsa._split_plan(16, 4, 2048, 128, 0) == (8, (*config, 8, 1024))
    assert qsa._split_plan(16, 4, 65536, 128, 0) == (8, (*config, 8, 0))  # slot pass
    assert qsa._split_plan(30, 4, 2048, 128, 0) == (4, (*config, 4, 1024))
    assert qsa._split_plan(200, 4, 2048, 128, 0) == (1, None)
    labels = {s.family for s in qsa._specs_for(16, 128, 64)}
    assert labels == {"qsa_slots", "qsa_decode", "qsa_decode_cluster"}


# -- CPU: the kernels compile for every shipped arch, without spills ------------------------------
def _cuobjdump() -> str | None:
    try:
        import nvidia.cu13

        local = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        if local.exists():
            return str(local)
    except ImportError:
        pass
    return shutil.which("cuobjdump")


# Designs with several kv heads per CTA (warps, stages, min CTAs/SM, heads), per head dim;
# tools/bench_qsa.py times them against the default one-head CTAs.
HEAD_GROUP_CONFIGS = [(128, (4, 3, 4, 4)), (128, (8, 2, 2, 4)), (64, (4, 8, 1, 2)),
                      (256, (4, 2, 1, 2))]


# Cluster split-K (warps, stages, min CTAs/SM, heads, cluster, slot_cap), per head dim.
CLUSTER_CONFIGS = [(128, (4, 3, 4, 1, 8, 1024)), (128, (4, 3, 4, 1, 4, 0)),
                   (128, (8, 2, 2, 2, 2, 1024)), (64, (4, 8, 1, 1, 3, 512)),
                   (256, (4, 2, 1, 2, 2, 256))]


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_kernels_compile_without_spills(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import TEMPLATE_ROOT
    from jit_kernels import compile_cubin, render

    specs = [s for d in qsa.HEAD_DIMS for s in qsa._specs_for(16, d, 64)]
    specs.append(qsa._decode_family.spec((5, 128, *qsa.DECODE_CONFIG[128])))
    specs += [qsa._decode_family.spec((16, d, *cfg)) for d, cfg in HEAD_GROUP_CONFIGS]
    specs += [qsa._decode_cluster_family.spec((16, d, *cfg)) for d, cfg in CLUSTER_CONFIGS]
    tool = _cuobjdump()
    for spec in dict.fromkeys(specs):
        kernel = compile_cubin(render(spec, TEMPLATE_ROOT), arch)
        assert kernel.cubin and kernel.entry
        if tool is None:
            continue
        path = tmp_path / "k.cubin"
        path.write_bytes(kernel.cubin)
        usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True).stdout
        assert "LOCAL:0" in usage and "STACK:0" in usage, f"{spec.label} spills on {arch}: {usage}"


def test_prebuild_specs_cover_workloads():
    from flashinfer_jit._jit import WORKLOAD_ROOT

    workloads = json.loads((WORKLOAD_ROOT / qsa.WORKLOADS).read_text())
    assert workloads["op"] == "qsa"
    specs = qsa.prebuild_specs(workloads)
    labels = {s.label for s in specs}
    assert qsa._decode_family.spec((16, 128, *qsa.DECODE_CONFIG[128])).label in labels
    families = {s.family for s in specs}
    assert {"qsa_slots", "qsa_decode"} <= families <= {"qsa_slots", "qsa_decode", "qsa_decode_cluster"}
    assert ("qsa_decode_cluster" in families) == qsa.SPLIT_K_CLUSTER


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
@pytest.mark.parametrize("shape", GPU_SHAPES[:3])
@pytest.mark.parametrize("splits", [2, 3, 7, 64])
def test_gpu_split_k(shape, splits, strict):
    case = make_case(rows=3, device="cuda", seed=11, **shape)
    qsa._run_kernels(*args_of(case), num_splits=splits)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("d, config", HEAD_GROUP_CONFIGS)
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_heads_per_cta(d, config, splits, strict):
    """Several kv heads per CTA (and their split-K merge) give the one-head result."""
    hkv = config[3] * 2  # two head groups per row
    case = make_case(rows=5, hq=hkv * 3, hkv=hkv, d=d, page=32, topk=150, width=6,
                     num_blocks=30, device="cuda", seed=17, combined=True)
    case = add_hazards(case)
    qsa._run_kernels(*args_of(case), num_splits=splits, config=config)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    with pytest.raises(ValueError, match="heads_per_cta"):
        bad = (config[0], config[1], config[2], hkv + 1)
        qsa._run_kernels(*args_of(case), num_splits=splits, config=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("d, config", CLUSTER_CONFIGS)
@pytest.mark.parametrize("combined", [False, True])
def test_gpu_cluster_split_k(d, config, combined, strict):
    """Splits as one cluster merged through DSMEM, with and without in-kernel slots."""
    hkv = config[3] * 2
    case = make_case(rows=7, hq=hkv * 5, hkv=hkv, d=d, page=16, topk=200, width=14,
                     num_blocks=60, device="cuda", seed=23, combined=combined)
    case = add_hazards(case)
    qsa._run_kernels(*args_of(case), num_splits=config[4], config=config)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
def test_gpu_cluster_graph_and_misuse(strict):
    config = (4, 3, 4, 1, 8, 1024)
    case = make_case(rows=4, hq=64, hkv=4, d=128, page=64, topk=512, width=16, num_blocks=64,
                     num_requests=4, device="cuda", seed=2)
    run = lambda: qsa._run_kernels(*args_of(case), num_splits=8, config=config)  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (5, 6):
        fresh = make_case(rows=4, hq=64, hkv=4, d=128, page=64, topk=512, width=16,
                          num_blocks=64, num_requests=4, device="cuda", seed=seed)
        for key in ("q", "k_cache", "v_cache", "logical_indices", "block_table", "token_to_req",
                    "output_gate"):
            case[key].copy_(fresh[key])
        case["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(case["out"], ref_of(case))
    with pytest.raises(ValueError, match="cluster"):
        qsa._run_kernels(*args_of(case), num_splits=4, config=config)
    with pytest.raises(ValueError, match="slot_cap"):  # 512 entries / 2 splits > 128
        qsa._run_kernels(*args_of(case), num_splits=2, config=(4, 3, 4, 1, 2, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("rows, topk", [(4, 256), (2, 2048), (20, 1000)])
def test_gpu_dispatch_with_cluster_split_k(rows, topk, monkeypatch, strict):
    """The dispatcher's cluster plan (when switched on) and its warm-up."""
    monkeypatch.setattr(qsa, "SPLIT_K_CLUSTER", True)
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
    for fn in (qsa_sparse_paged_decode, qsa_sparse_paged_attention):
        case["out"].fill_(float("nan"))
        got = fn(*args_of(case))
        torch.cuda.synchronize()
        small = dict(case, k_cache=k_cache[top], v_cache=v_cache[top],
                     block_table=torch.arange(6, dtype=torch.int32).view(1, 6))
        assert_close(got, ref_of(small))
    del kv


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [4, 40])
@pytest.mark.parametrize("fn", [qsa_sparse_paged_decode, qsa_sparse_paged_attention])
def test_gpu_cuda_graph(rows, fn, strict):
    case = make_case(rows=rows, hq=64, hkv=4, d=128, page=64, topk=256, width=8, num_blocks=48,
                     num_requests=4, device="cuda", seed=2)
    fn(*args_of(case))  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*args_of(case))
        with torch.cuda.graph(graph, stream=stream):
            fn(*args_of(case))
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (99, 100):  # replays twice: split-K's completion counters must reset
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
    assert {name for name, _ in ready} >= {"qsa_slots", "qsa_decode"}
    # Every kernel a call can reach is now loaded: a later call compiles nothing.
    os.environ["FLASHINFER_JIT_DISABLE"] = "1"
    try:
        k_cache, v_cache = kv.transpose(1, 2).split(128, dim=-1)
        case = make_case(rows=2, hq=16, hkv=2, d=128, page=64, topk=64, width=4, num_blocks=8,
                         num_requests=2, device="cuda")
        case.update(k_cache=k_cache, v_cache=v_cache)
        qsa_sparse_paged_attention(*args_of(case))
        qsa_sparse_paged_decode(*args_of(case))
    finally:
        del os.environ["FLASHINFER_JIT_DISABLE"]
