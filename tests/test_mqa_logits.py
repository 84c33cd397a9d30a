"""fp8_paged_mqa_logits: the op against an independent float64 reference of the seed's
semantics, its rejected inputs, its helpers, and (on a GPU) the kernels, the schedule
and CUDA-graph replay."""

from __future__ import annotations

import math

import pytest
import torch

import flashinfer_jit.mqa_logits as mq
from flashinfer_jit.mqa_logits import (
    compute_paged_mqa_logits_schedule,
    fp8_paged_mqa_logits,
    min_block_table_width,
    padded_seq_len,
)

E4M3 = torch.float8_e4m3fn
BAD_BLOCK = 2**30  # table entries a request does not own: reading one would fault


# -- inputs ----------------------------------------------------------------------------
def make_inputs(
    seq_lens,
    next_n=1,
    heads=64,
    dim=128,
    block_size=64,
    device="cpu",
    seed=0,
    max_seq_len=None,
    width=None,
    table_fill=BAD_BLOCK,
    neg_weights=True,
    kscale=1.0,
):
    """Random q/KV/weights; the pool is shuffled, unused table entries hold `table_fill`."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_seq_len = max(seq_lens + [1]) if max_seq_len is None else max_seq_len
    width = width or max(1, min_block_table_width(max_seq_len, block_size))
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((batch, width), table_fill, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    values = (torch.randn(num_blocks, block_size, dim, generator=gen) * kscale).to(E4M3)
    scales = torch.rand(num_blocks, block_size, generator=gen) + 0.25
    kv = torch.cat(
        [values.view(torch.uint8).flatten(1), scales.view(torch.uint8).flatten(1)], dim=1
    )
    kv = kv.view(num_blocks, block_size, 1, dim + 4)
    q = torch.randn(batch, next_n, heads, dim, generator=gen).to(E4M3)
    w = torch.rand(batch * next_n, heads, generator=gen)
    if neg_weights:
        w = w * 2 - 1
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q, kv, w, table, lens)] + [max_seq_len]


def reference(q, kv, w, table, lens):
    """{row: (values float64 [valid], magnitude [valid])} straight from the byte layout."""
    q, kv, w, table, lens = (t.cpu() for t in (q, kv, w, table, lens))
    batch, next_n, heads, dim = q.shape
    bs = kv.shape[1]
    pool = kv.reshape(kv.shape[0], -1)
    result = {}
    for b in range(batch):
        length = int(lens[b])
        if length == 0:
            continue
        pos = torch.arange(length)
        blocks = table[b, pos // bs].long()
        off = pos % bs
        kbytes = pool[blocks[:, None], off[:, None] * dim + torch.arange(dim)]
        k = kbytes.contiguous().view(E4M3).double()
        sbytes = pool[blocks[:, None], bs * dim + off[:, None] * 4 + torch.arange(4)]
        scale = sbytes.contiguous().view(torch.float32)[:, 0].double()
        for t in range(next_n):
            valid = length - next_n + t + 1
            if valid <= 0:
                continue
            qt = q[b, t].double()
            s = qt @ k[:valid].T
            wt = w[b * next_n + t].double()
            vals = (s.clamp_min(0) * wt[:, None]).sum(0) * scale[:valid]
            mag = ((qt.abs() @ k[:valid].abs().T) * wt.abs()[:, None]).sum(0) * scale[:valid].abs()
            result[b * next_n + t] = (vals, mag)
    return result


def assert_close(logits, ref, rtol, name=""):
    for row, (vals, mag) in ref.items():
        got = logits[row, : len(vals)].double().cpu()
        assert torch.isfinite(got).all(), f"{name} row {row}: non-finite values in the valid region"
        err = (got - vals).abs()
        tol = rtol * mag + 1e-6
        bad = (err > tol).nonzero()
        assert len(bad) == 0, (
            f"{name} row {row}: {len(bad)} mismatches, first at {int(bad[0])}: "
            f"got {float(got[bad[0]])} want {float(vals[bad[0]])} (mag {float(mag[bad[0]])})"
        )


def run_and_check(seq_lens, device="cpu", rtol=2e-3, dtypes=(torch.float32,) * 3, **kw):
    q, kv, w, table, lens, max_len = make_inputs(seq_lens, device=device, **kw)
    out_dt, epi_dt, acc_dt = dtypes
    out = torch.full(
        (len(seq_lens) * q.shape[1] + 1, padded_seq_len(max_len) + 8),
        float("nan"),
        dtype=out_dt,
        device=device,
    )
    logits = fp8_paged_mqa_logits(
        q,
        kv,
        w,
        table,
        lens,
        max_len,
        output_dtype=out_dt,
        epi_dtype=epi_dt,
        acc_dtype=acc_dt,
        out=out,
    )
    assert logits.shape == (len(seq_lens) * q.shape[1], max_len)
    assert logits.data_ptr() == out.data_ptr()
    assert_close(logits, reference(q, kv, w, table, lens), rtol)
    # Rows of zero-length requests and everything past the padded width are untouched.
    cols = padded_seq_len(max_len)
    assert torch.isnan(out[:, cols:]).all() and torch.isnan(out[-1]).all()
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.isnan(out[b * q.shape[1] : (b + 1) * q.shape[1]]).all()
    return logits


EDGE_LENS = [0, 1, 2, 63, 64, 65, 128, 200, 257]


# -- helpers of the contract -----------------------------------------------------------
def test_helpers():
    assert min_block_table_width(8000, 32) == 250
    assert min_block_table_width(0, 64) == 0
    assert (
        padded_seq_len(8000) == 8192 and padded_seq_len(8192) == 8192 and padded_seq_len(1) == 256
    )
    with pytest.raises(ValueError, match="block_size"):
        min_block_table_width(10, 0)


def test_schedule_host_rule():
    lens = torch.tensor([0, 100, 64, 0, 1000, 1], dtype=torch.int32)
    sched = compute_paged_mqa_logits_schedule(lens, 64, num_sms=5)
    assert sched.shape == (6, 2) and sched.dtype == torch.int32
    tiles = [0, 2, 1, 0, 16, 1]
    flat = [(b, t) for b, n in enumerate(tiles) for t in range(n)]
    for c in range(5):
        assert tuple(sched[c].tolist()) == flat[c * len(flat) // 5]
    assert tuple(sched[5].tolist()) == (6, 0)


# -- the torch path (CPU tensors) ---------------------------------------------------------
@pytest.mark.parametrize(
    "next_n,heads,block_size", [(1, 64, 64), (2, 32, 32), (3, 64, 128), (4, 32, 64)]
)
def test_cpu_matches_reference(next_n, heads, block_size):
    run_and_check(
        EDGE_LENS + [next_n - 1], next_n=next_n, heads=heads, block_size=block_size, seed=next_n
    )


def test_cpu_strided_tables_and_lens():
    q, kv, w, table, lens, max_len = make_inputs([5, 130, 64, 0], next_n=2, heads=32)
    wide_table = torch.full((8, table.shape[1]), BAD_BLOCK, dtype=torch.int32)
    wide_table[::2] = table
    wide_lens = torch.zeros(8, dtype=torch.int32)
    wide_lens[::2] = lens
    a = fp8_paged_mqa_logits(q, kv, w, wide_table[::2], wide_lens[::2], max_len)
    b = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
    ref = reference(q, kv, w, table, lens)
    assert_close(a, ref, 2e-3)
    for row in ref:
        assert torch.equal(a[row, : len(ref[row][0])], b[row, : len(ref[row][0])])


@pytest.mark.parametrize(
    "dtypes,rtol",
    [
        ((torch.float16, torch.float32, torch.float32), 2e-3),
        ((torch.float32, torch.float16, torch.float32), 2e-2),
        ((torch.float32, torch.float32, torch.float16), 2e-2),
        ((torch.float16, torch.float16, torch.float16), 3e-2),
    ],
)
def test_cpu_half_precision(dtypes, rtol):
    run_and_check([1, 77, 300], next_n=2, heads=32, dtypes=dtypes, rtol=rtol)


def test_cpu_fp16_overflow_is_inf():
    # |logit| far above 65504: float16 epilogue or output saturates to inf, float32 does not.
    q, kv, w, table, lens, max_len = make_inputs([64], heads=64, neg_weights=False)
    q = torch.full_like(q.float(), 448.0).to(E4M3)
    kv_vals = kv.reshape(kv.shape[0], -1)
    kv_vals[:, : 64 * 128] = torch.tensor(448.0).to(E4M3).view(torch.uint8)
    w = torch.ones_like(w)
    ref32 = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
    assert torch.isfinite(ref32[0, :64]).all() and (ref32[0, :64] > 65504).all()
    for out_dt, epi_dt in ((torch.float16, torch.float32), (torch.float32, torch.float16)):
        got = fp8_paged_mqa_logits(
            q, kv, w, table, lens, max_len, output_dtype=out_dt, epi_dtype=epi_dt
        )
        assert torch.isinf(got[0, :64]).all()


def test_cpu_internal_allocation_and_empty():
    q, kv, w, table, lens, max_len = make_inputs([0, 0])
    logits = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
    assert logits.shape == (2, max_len)
    assert logits.stride(0) == padded_seq_len(max_len)


# -- rejected inputs ----------------------------------------------------------------------
NAMES = ("q", "kv_fused", "weights", "block_tables", "seq_lens", "max_seq_len")


def _named(inputs) -> dict:
    return dict(zip(NAMES, inputs, strict=True))


def _args(**kw):
    return _named(make_inputs([10, 70], next_n=2, heads=32, **kw))


def _call(a, **kw):
    return fp8_paged_mqa_logits(
        a["q"],
        a["kv_fused"],
        a["weights"],
        a["block_tables"],
        a["seq_lens"],
        a["max_seq_len"],
        **kw,
    )


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(output_dtype=torch.bfloat16), ValueError, "bfloat16 is not supported"),
        (dict(epi_dtype=torch.bfloat16), ValueError, "epi_dtype"),
        (dict(acc_dtype=torch.float64), ValueError, "acc_dtype"),
    ],
)
def test_rejects_dtypes(change, exc, match):
    with pytest.raises(exc, match=match):
        _call(_args(), **change)


def test_rejects_geometry():
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        _call(_args(dim=48))
    with pytest.raises(ValueError, match="num_heads must be a multiple of 4"):
        _call(_named(make_inputs([4], next_n=4, heads=6)))
    for next_n, heads in ((1, 4), (2, 132), (5, 64)):
        a = _named(make_inputs([4], next_n=next_n, heads=heads))
        with pytest.raises(
            ValueError, match=r"next_n\*num_heads must be a multiple of 8 in \[8, 256\]"
        ):
            _call(a)
    with pytest.raises(ValueError, match="block_size"):
        _call(_args(block_size=16))
    a = _named(make_inputs([4], next_n=4, heads=64, dim=1024))
    with pytest.raises(ValueError, match="shared memory"):
        _call(a)


def test_rejects_tensors():
    a = _args()
    with pytest.raises(TypeError, match="q must be torch.float8_e4m3fn"):
        _call(dict(a, q=a["q"].float()))
    with pytest.raises(ValueError, match="kv_fused must be"):
        _call(dict(a, kv_fused=a["kv_fused"][..., :-4]))
    with pytest.raises(ValueError, match="kv_fused must be contiguous"):
        _call(dict(a, kv_fused=a["kv_fused"][::2]))
    with pytest.raises(ValueError, match="weights must be"):
        _call(dict(a, weights=a["weights"][:1]))
    with pytest.raises(TypeError, match="block_tables must be torch.int32"):
        _call(dict(a, block_tables=a["block_tables"].long()))
    with pytest.raises(ValueError, match=r"stride\(1\) == 1"):
        _call(dict(a, block_tables=torch.cat([a["block_tables"]] * 2, 1)[:, ::2]))
    with pytest.raises(TypeError, match="seq_lens must be torch.int32"):
        _call(dict(a, seq_lens=a["seq_lens"].long()))
    with pytest.raises(ValueError, match="max_seq_len"):
        _call(dict(a, max_seq_len=-1))


def test_rejects_out():
    a = _args()
    rows, cols = 4, padded_seq_len(a["max_seq_len"])
    with pytest.raises(ValueError, match="at least"):
        _call(a, out=torch.empty(rows, a["max_seq_len"]))
    with pytest.raises(TypeError, match="output_dtype"):
        _call(a, out=torch.empty(rows, cols, dtype=torch.float16))
    with pytest.raises(ValueError, match="overlap"):
        _call(a, out=torch.empty(rows * cols).as_strided((rows, cols), (cols // 2, 1)))
    with pytest.raises(ValueError, match="overlap"):
        _call(a, out=torch.empty(1, cols).expand(rows, cols))
    with pytest.raises(ValueError, match=r"stride\(1\) == 1"):
        _call(a, out=torch.empty(rows, 2 * cols)[:, ::2])
    wide = torch.full((8, 3 * cols), float("nan"))
    _call(a, out=wide[2:6, cols : 2 * cols])  # a row slice of a wider buffer is fine
    assert torch.isnan(wide[:2]).all() and torch.isnan(wide[6:]).all()


def test_rejects_output_over_2_31():
    q = torch.empty(1, 1, 64, 128, dtype=E4M3).expand(70000, 1, 64, 128)
    kv = torch.empty(1, 64, 1, 132, dtype=torch.uint8)
    w = torch.empty(1, 64).expand(70000, 64)
    table = torch.zeros(1, 512, dtype=torch.int32).expand(70000, 512)
    lens = torch.zeros(1, dtype=torch.int32).expand(70000)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        fp8_paged_mqa_logits(q, kv, w, table, lens, 32768)


def test_validate_inputs(monkeypatch):
    a = _args()
    monkeypatch.setenv("FLASHINFER_VALIDATE_INPUTS", "1")
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        _call(dict(a, max_seq_len=20))
    with pytest.raises(ValueError, match="min_block_table_width"):
        _call(dict(a, block_tables=a["block_tables"][:, :1].contiguous()))
    _call(a)
    monkeypatch.delenv("FLASHINFER_VALIDATE_INPUTS")
    _call(dict(a, block_tables=a["block_tables"][:, :2].contiguous()))  # unchecked by default


def test_rejects_bad_schedule():
    a = _args()
    with pytest.raises(ValueError, match="schedule_meta"):
        _call(a, schedule_meta=torch.zeros(3, 2, dtype=torch.int64))


# -- registration, workloads, compilation (no GPU needed) ---------------------------------
def test_custom_op_registered():
    op = torch.ops.flashinfer_jit.fp8_paged_mqa_logits
    a = _args()
    out = torch.empty(4, padded_seq_len(a["max_seq_len"]))
    torch.library.opcheck(
        op,
        (
            a["q"],
            a["kv_fused"],
            a["weights"],
            a["block_tables"],
            a["seq_lens"],
            a["max_seq_len"],
            torch.float32,
            torch.float32,
            torch.float32,
            None,
            out,
        ),
        test_utils=("test_faketensor", "test_autograd_registration"),
    )


def test_prebuild_specs_cover_workloads():
    import json

    from flashinfer_jit._jit import WORKLOAD_ROOT

    workloads = json.loads((WORKLOAD_ROOT / mq.WORKLOADS).read_text())
    specs = mq.prebuild_specs(workloads)
    labels = [s.label for s in specs]
    assert any(s.family == "mqa_logits_schedule" for s in specs)
    assert sum(s.family == "mqa_logits_generic" for s in specs) == 8  # every dtype triple
    shapes = math.prod(
        len(workloads[k]) for k in ("next_n", "num_heads", "head_dim", "block_size", "output_dtype")
    )
    # Every workload point has its ring/direct kernel (every arch) and, at head_dim 128, the
    # TMA kernel, which is built for sm_90a only.
    tma = [s for s in specs if s.family == "mqa_logits_tma"]
    assert len(tma) == shapes and all(s.archs == ("sm_90a",) for s in tma)
    assert not any(s.supports("sm_100a") for s in tma)
    assert len(specs) == 1 + 8 + 2 * shapes
    assert all("portable=False" in lbl for lbl in labels if lbl.startswith("mqa_logits["))


def _sass(cubin: bytes, tmp_path) -> tuple[str, str]:
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    tool = shutil.which("cuobjdump") or str(
        Path(sys.prefix) / "lib" / f"python{sys.version_info.major}."
        f"{sys.version_info.minor}" / "site-packages/nvidia/cu13/bin/cuobjdump"
    )
    if not Path(tool).exists():
        pytest.skip("cuobjdump not installed")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [tool, "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    res = subprocess.run(
        [tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return sass, res


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize(
    "params",
    [
        (1, 64, 128, 64, torch.float32, torch.float32, torch.float32),
        (4, 64, 128, 32, torch.float16, torch.float16, torch.float16),
        (2, 4, 96, 128, torch.float32, torch.float16, torch.float32),
    ],
)
def test_kernels_compile(arch, params, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from jit_kernels import compile_cubin, render

    spec = mq._logits_family.spec(mq._params(*params))
    cubin = compile_cubin(render(spec, BUILDER.template_root), arch).cubin
    sass, res = _sass(cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills on {arch}: {res}"
    if arch == "sm_90a":
        assert "QGMMA" in sass, "the sm_90a path must use fp8 wgmma"
    else:
        assert "HMMA" in sass
    assert "UBLKCP" in sass, "the ring kernel streams K with cp.async.bulk"
    sched = mq._schedule_family.spec((256,))
    assert compile_cubin(render(sched, BUILDER.template_root), arch).cubin


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_generic_kernel_compiles(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from flashinfer_jit.mqa_logits_generic import generic_specs
    from jit_kernels import compile_cubin, render

    spec = generic_specs()[0]
    sass, res = _sass(compile_cubin(render(spec, BUILDER.template_root), arch).cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills on {arch}: {res}"
    assert ("QGMMA" if arch == "sm_90a" else "HMMA") in sass


def test_launch_configs_fit_the_register_file():
    """9 warps get 168 registers (4 sub-partitions of 16K, ceil(9/4) = 3 warps each): the
    chosen ring config must leave its consumers room, or the launch fails with error 701."""
    from flashinfer_jit.mqa_logits_checks import direct_config, reg_cap, ring_regs

    assert (reg_cap(288), reg_cap(160), reg_cap(416), reg_cap(256), reg_cap(384)) == (
        168,
        255,
        128,
        255,
        168,
    )
    for dim in range(32, 257, 32):
        for n in range(8, 257, 8):
            cfg = mq.launch_config(n, dim)
            if cfg is None:
                assert direct_config(n, dim) is None
                continue
            warpgroups, stages, ring = cfg
            if ring:
                assert ring_regs(n, dim) <= reg_cap(128 * warpgroups + 32), (n, dim, cfg)
                assert stages >= 4 and stages % warpgroups == 0


def test_fast_path_replays_the_full_path(monkeypatch, request):
    """A repeated call (same metadata, new tensors) launches with the same arguments as the
    full path would, with the new addresses; a changed layout takes the full path."""
    calls = []

    class Kernel:
        name = "fake"

        def launch(self, grid, block, stream, args, smem):
            calls.append((grid, block, args, smem))

    plan = (Kernel(), (7, 1, 1), (288, 1, 1), 1234, (), None)
    monkeypatch.setattr(mq, "_kernel_refusal", lambda q, kv: None)
    monkeypatch.setattr(mq, "_plan", lambda *a: plan)
    import flashinfer_jit.mqa_logits_launch as mql

    monkeypatch.setattr(mq, "cuda_device_index", lambda t: 0)
    monkeypatch.setattr(mql, "current_stream", lambda d: 0)
    mq._replays.clear()
    request.addfinalizer(mq._replays.clear)  # launches of the fake plan must not outlive the test
    a = make_inputs([70, 5, 300], next_n=2, heads=32, seed=1)
    b = make_inputs([70, 5, 300], next_n=2, heads=32, seed=2)
    max_len = a[5]
    wide = torch.empty(6, padded_seq_len(max_len) + 40)
    for out in (None, wide):
        calls.clear()
        for inputs in (a, b, a):
            got = fp8_paged_mqa_logits(*inputs[:5], max_len, out=out)
            assert got.shape == (6, max_len)
            assert out is None or got.data_ptr() == wide.data_ptr()
        assert len(mq._replays) >= 1
        full, fast_b, fast_a = calls
        assert full[2][:3] == fast_a[2][:3] and full[2][4:8] == fast_a[2][4:8]
        assert full[2][9:] == fast_a[2][9:] == fast_b[2][9:]
        assert fast_b[2][0] == b[0].data_ptr() and fast_b[2][5] == b[4].data_ptr()
        assert (full[0], full[1], full[3]) == (fast_b[0], fast_b[1], fast_b[3])
    # A strided block table (a new layout) misses the fast path and still passes its stride.
    table = torch.zeros(3, 2 * a[3].shape[1], dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match="block_tables rows must be contiguous"):
        fp8_paged_mqa_logits(*a[:3], table, a[4], max_len)
    wide_table = torch.zeros(6, a[3].shape[1], dtype=torch.int32)[::2]
    calls.clear()
    fp8_paged_mqa_logits(*a[:3], wide_table, a[4], max_len)
    fp8_paged_mqa_logits(*a[:3], wide_table, a[4], max_len)
    assert calls[0][2][4] == calls[1][2][4] == 2 * a[3].shape[1]


def test_direct_kernel_compiles_for_wide_heads(tmp_path):
    """head_dim 512 with next_n*num_heads 256 leaves room for fewer than 4 ring stages: the
    dispatcher picks the register-fed direct kernel, which must compile without spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from jit_kernels import compile_cubin, render

    assert mq.launch_config(256, 512)[2] is False
    f32 = torch.float32
    spec = mq._logits_family.spec(mq._params(4, 64, 512, 64, f32, f32, f32))
    sass, res = _sass(compile_cubin(render(spec, BUILDER.template_root), "sm_90a").cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills: {res}"
    assert "QGMMA" in sass


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
    "generic": "generic",  # the runtime-geometry kernel (mq._force_generic)
}


@pytest.fixture
def variant(request, monkeypatch):
    if VARIANTS[request.param] == "generic":
        monkeypatch.setattr(mq, "_force_generic", True)
    else:
        monkeypatch.setattr(mq, "_config_override", VARIANTS[request.param])
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback to torch would hide a kernel bug
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS), indirect=True)
@pytest.mark.parametrize(
    "next_n,heads,block_size",
    [(1, 64, 64), (2, 32, 32), (3, 64, 128), (4, 64, 64), (2, 4, 64), (1, 32, 128)],
)
def test_gpu_matches_reference(variant, next_n, heads, block_size):
    lens = EDGE_LENS + [next_n - 1, 1000, 64 * 7, 3 * block_size]
    run_and_check(
        lens, device="cuda", next_n=next_n, heads=heads, block_size=block_size, seed=7 + next_n
    )


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "portable", "generic"], indirect=True)
@pytest.mark.parametrize(
    "dtypes,rtol",
    [
        ((torch.float16, torch.float32, torch.float32), 2e-3),
        ((torch.float32, torch.float16, torch.float32), 2e-2),
        ((torch.float32, torch.float32, torch.float16), 2e-2),
        ((torch.float16, torch.float16, torch.float16), 3e-2),
    ],
)
def test_gpu_half_precision(variant, dtypes, rtol):
    run_and_check([1, 77, 300, 64, 0], device="cuda", next_n=2, heads=32, dtypes=dtypes, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "portable", "direct_2x2", "generic"], indirect=True)
@pytest.mark.parametrize("dim", [32, 96, 160, 256])
def test_gpu_other_head_dims(variant, dim):
    run_and_check([5, 64, 333], device="cuda", next_n=1, heads=64, dim=dim, seed=dim)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["auto", "ring_3x6", "portable", "generic"], indirect=True)
def test_gpu_many_requests(variant):
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(0, 3000, (300,), generator=gen).tolist()
    run_and_check(lens, device="cuda", next_n=2, heads=64, seed=11)


@pytest.mark.gpu
def test_gpu_generic_serves_when_jit_disabled(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a torch fallback would raise
    monkeypatch.setattr(mq, "_force_generic", True)  # builds (caches) the generic cubin
    run_and_check([70, 0, 5], device="cuda", next_n=1, heads=8, dim=64)
    monkeypatch.setattr(mq, "_force_generic", False)
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")  # no specialization for this geometry
    run_and_check([300, 1, 129, 0], device="cuda", next_n=2, heads=20, dim=64, block_size=32)
    assert any(p[4] == (2, 20, 64, 32, p[4][4]) for p in mq._plans.values() if p[4])


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
    from flashinfer_jit.mqa_logits_schedule import schedule_torch

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
def test_gpu_fast_path_new_tensors():
    """Repeated calls with the same shapes (the fast path) read each call's own tensors."""
    outs = []
    for seed in (1, 2, 3):
        q, kv, w, table, lens, max_len = make_inputs(
            [700, 0, 64, 1999], next_n=2, heads=64, device="cuda", seed=seed
        )
        got = fp8_paged_mqa_logits(q, kv, w, table, lens, max_len)
        assert_close(got, reference(q, kv, w, table, lens), 2e-3, name=f"seed {seed}")
        outs.append(got)
    assert not torch.equal(outs[0][0, :600], outs[1][0, :600])
