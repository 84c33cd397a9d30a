"""fp8_paged_mqa_logits: the op's torch path against an independent float64 reference of
the seed's semantics, its rejected inputs and its helpers; the inputs and reference the
other MQA test files share (test_mqa_logits_build.py: compilation and replay without a
GPU; test_mqa_logits_gpu.py and test_mqa_logits_tma.py: the kernels on a GPU)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit.mqa_logits import (
    OP,
    MqaLogitsOptions,
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


def logits_with(options: MqaLogitsOptions | None):
    """``fp8_paged_mqa_logits``, or the op with ``options`` (a variant)."""
    return fp8_paged_mqa_logits if options is None else OP.runner(options).call


def run_and_check(
    seq_lens, device="cpu", rtol=2e-3, dtypes=(torch.float32,) * 3, options=None, **kw
):
    """One call (``options``: a variant of the op) checked against the reference."""
    q, kv, w, table, lens, max_len = make_inputs(seq_lens, device=device, **kw)
    out_dt, epi_dt, acc_dt = dtypes
    out = torch.full(
        (len(seq_lens) * q.shape[1] + 1, padded_seq_len(max_len) + 8),
        float("nan"),
        dtype=out_dt,
        device=device,
    )
    logits = logits_with(options)(
        q, kv, w, table, lens, max_len, output_dtype=out_dt, epi_dtype=epi_dt,
        acc_dtype=acc_dt, out=out,
    )  # fmt: skip
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


# (output, epilogue, accumulator) dtypes and the relative tolerance each is checked to.
# assert_close bounds |err| by rtol * mag, mag = scale * sum_h |w_h| sum_d |q_hd k_d|: every
# partial sum is at most mag, and a float16 rounding moves a value by at most u = 2^-11 of
# it, so n roundings on the way cost at most n u mag. Output float16: one rounding (u =
# 4.9e-4; 2e-3 also covers the float32 paths). Epilogue float16 (tile.cuh TileSums, the
# generic ring's): s and w to float16, a half2 FMA chain of H/8 steps a lane, its halves
# added, the quad reduction, the scale to float16 and the multiply: about (H/8 + 8) u, 16 u
# = 7.8e-3 at H = 64, under 2e-2 (41 u). Accumulator float16: one rounding a 32-wide k step,
# D/32 = 4 at D = 128, 8 u = 3.9e-3 were the tensor core to truncate (its rounding within a
# step is not specified: the rest of 2e-2 is that room). Both: 24 u = 1.2e-2, under 3e-2.
# The torch path's worst err / mag on these inputs is ~0.1 u; tightening to the bounds wants
# the kernels' own figures from an H200 run.
DTYPE_TOLERANCES = [
    ((torch.float16, torch.float32, torch.float32), 2e-3),
    ((torch.float32, torch.float16, torch.float32), 2e-2),
    ((torch.float32, torch.float32, torch.float16), 2e-2),
    ((torch.float16, torch.float16, torch.float16), 3e-2),
]


@pytest.mark.parametrize("dtypes,rtol", DTYPE_TOLERANCES)
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


def test_value_preconditions_are_checked_on_cpu():
    """On CPU tensors the lengths and the table are checked on every call (no sync to
    spare; the torch path would index with them as given), not only under
    FLASHINFER_VALIDATE_INPUTS=1 as on a GPU."""
    a = _args()  # lengths [10, 70], block 64: request 1 uses table columns 0 and 1
    lens, table = a["seq_lens"], a["block_tables"]
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        _call(dict(a, max_seq_len=20))
    with pytest.raises(ValueError, match="min_block_table_width"):
        _call(dict(a, block_tables=table[:, :1].contiguous()))
    with pytest.raises(ValueError, match="negative entry"):
        _call(dict(a, seq_lens=torch.tensor([-5, 70], dtype=torch.int32)))
    for bad in (-1, a["kv_fused"].shape[0]):
        used = table.clone()
        used[1, 1] = bad
        with pytest.raises(ValueError, match="block index outside"):
            _call(dict(a, block_tables=used))
    unused = table.clone()
    unused[0, 1:] = -1  # past request 0's one block: anything goes
    _call(dict(a, block_tables=unused))
    assert lens.tolist() == [10, 70] and table.shape[1] >= 2


def test_rejects_bad_schedule():
    a = _args()
    with pytest.raises(ValueError, match="schedule_meta"):
        _call(a, schedule_meta=torch.zeros(3, 2, dtype=torch.int64))
    # the lengths' own schedule serves; one computed for longer lengths is stale (on a GPU
    # the direct kernel would run past the batch): refused where values are checked
    current = compute_paged_mqa_logits_schedule(a["seq_lens"], 64, num_sms=3)
    _call(a, schedule_meta=current)
    stale = compute_paged_mqa_logits_schedule(a["seq_lens"] * 9, 64, num_sms=3)
    assert not torch.equal(stale, current)
    with pytest.raises(ValueError, match="reuse a schedule only while"):
        _call(a, schedule_meta=stale)


def test_a_pool_of_no_blocks_takes_the_torch_path(monkeypatch):
    """A pool of no blocks (every length 0) has no tensor map for the TMA kernel to encode:
    the kernels refuse it before planning (it raised from the encode at run time), and the
    torch path writes nothing to attend."""
    import flashinfer_jit.mqa_logits.op as mq_op

    a = _args()
    empty = dict(a, kv_fused=a["kv_fused"][:0], seq_lens=torch.zeros_like(a["seq_lens"]))
    monkeypatch.setattr(mq_op, "capability", lambda device: (9, 0))  # as on an H200
    monkeypatch.setattr(mq_op, "cuda_device_index", lambda t: 0)
    args = tuple(empty[k] for k in ("q", "kv_fused", "weights", "block_tables", "seq_lens"))
    assert mq_op.OP.refusal(args + (empty["max_seq_len"],)) == "kv_fused has no blocks"
    _call(empty)  # CPU: the torch path
