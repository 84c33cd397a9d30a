"""The ops' eager replay of a cached launch (CPU, kernels stubbed): a repeat call replays,
any change of tensor metadata or scalar arguments takes the full path, and so does every
call while an environment switch says so."""

# size: the replay rules of all three ops side by side, over one set of stubs

from __future__ import annotations

import math

import pytest
import torch

import flashinfer_jit.deep_gemm as dg
import flashinfer_jit.mla_kv_pack as mkp
import flashinfer_jit.mla_kv_pack.cake as mkp_cake
import flashinfer_jit.mla_kv_pack.op as mkp_op
import flashinfer_jit.mla_kv_pack.specialized as mkp_specialized
import flashinfer_jit.mqa_logits as mq
import flashinfer_jit.mqa_logits.launch as mq_launch
import flashinfer_jit.mqa_logits.op as mq_op
import flashinfer_jit.mqa_logits.plan as mq_plan
import flashinfer_jit.qsa as qsa
import flashinfer_jit.qsa.checks as qsa_checks
import flashinfer_jit.qsa.kernels as qk
import flashinfer_jit.qsa.launch as qsa_launch
import flashinfer_jit.qsa.op as qsa_op
import flashinfer_jit.qsa.plan as qsa_plan
from flashinfer_jit.mqa_logits.launch import KernelPlan
from jit_kernels import KernelFamily, LaunchError, plan_cache, validate_inputs
from jit_kernels.alloc import RawAllocator
from jit_kernels.launch import merge

SWITCHES = ("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "FLASHINFER_VALIDATE_INPUTS")
E4M3 = torch.float8_e4m3fn


class FakeKernel:
    """Records launches instead of making them."""

    name = "fake"

    def __init__(self, launches: list):
        self.launches = launches

    def launch(self, grid, block, stream, args, smem=0):
        self.launches.append((grid, block, args, smem))

    launch_programmatic = launch  # programmatic (PDL) launches, recorded alike

    def bind(self, grid, block, smem=0, programmatic=False, template=None):
        def launch(stream, values):  # records the whole argument list, as launch does
            args = values if template is None else merge(template, values)
            self.launch(grid, block, stream, args, smem)

        return launch

    def blocks_per_sm(self, threads, smem=0):
        return 1


def fake_cuda(t: torch.Tensor) -> torch.Tensor:
    """A tensor with ``t``'s metadata on cuda:0, no GPU needed (a FakeTensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


class Stub:
    """Counts the op's full-path runs (``full``) and every launch (``launches``)."""

    def __init__(self):
        self.full: list = []
        self.launches: list = []

    def runs(self, call) -> int:
        """Full-path runs of ``call()``: 0 when it replayed."""
        before = len(self.full)
        call()
        return len(self.full) - before


@pytest.fixture
def stub(monkeypatch, fresh_replays):
    for name in (*SWITCHES, "FLASHINFER_JIT_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    return Stub()


def fake_device(monkeypatch, *modules) -> None:
    """The modules see an H200 as cuda:0 (CPU tensors stand in for its tensors)."""
    fakes = {
        "cuda_device_index": lambda t: 0,
        "current_stream": lambda device: 0,
        "capability": lambda device: (9, 0),
        "sm_count": lambda device: 132,
    }
    for module in modules:
        for name, fake in fakes.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, fake)


def count_full_path(monkeypatch, op, stub: Stub) -> None:
    """``op``'s kernels serve CPU tensors (no CUDA-device test, no refusal), each full-path
    run (its checks) recorded in ``stub.full`` (the ``stub`` fixture empties the replays)."""
    prepare = op.prepare
    monkeypatch.setattr(op, "kernel_call", lambda args: True)
    monkeypatch.setattr(op, "refusal", lambda args: None)
    monkeypatch.setattr(op, "prepare", lambda args: stub.full.append(args) or prepare(args))


# The replay tests run twice: recalling through the tensor guard (jit_kernels.plan_cache),
# and through the key alone (a torch without a usable guard).
by_guard_and_key = pytest.mark.parametrize("by", ["guard", "key"])


def replay_by(monkeypatch, by: str) -> None:
    if by == "key":
        monkeypatch.setattr(plan_cache, "_make_guard", None)


# -- MQA ----------------------------------------------------------------------------------------
def mqa_args(batch=3, next_n=2, heads=32, dim=64, block=32, blocks=40, width=8):
    return dict(
        q=torch.zeros(batch, next_n, heads, dim, dtype=E4M3),
        kv_fused=torch.zeros(blocks, block, 1, dim + 4, dtype=torch.uint8),
        weights=torch.zeros(batch * next_n, heads),
        block_tables=torch.zeros(batch, width, dtype=torch.int32),
        seq_lens=torch.zeros(batch, dtype=torch.int32),
        max_seq_len=200,
    )


@pytest.fixture
def mqa_stub(stub, monkeypatch):
    kernel = FakeKernel(stub.launches)
    plan = KernelPlan(kernel, (7, 1, 1), (288, 1, 1), 99)
    monkeypatch.setattr(mq_plan, "kernel_plan", lambda *a: plan)
    fake_device(monkeypatch, mq_plan, mq_launch)
    # The stub's CPU tensors stand for a GPU's, whose values are checked only on request.
    monkeypatch.setattr(mq_op, "validate_values", lambda device: validate_inputs())
    count_full_path(monkeypatch, mq.OP, stub)
    return stub


def _strided(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t``'s values in a tensor whose ``dim`` has twice the stride (same shape)."""
    shape = list(t.shape)
    shape[dim] *= 2
    view = torch.zeros(shape, dtype=t.dtype)[(slice(None),) * dim + (slice(None, None, 2),)]
    return view.copy_(t)


def _mqa_variants(a: dict) -> dict:
    """A change of one metadata element each, every one a valid call."""
    f16 = torch.float16
    wide_out = torch.empty(6, mq.padded_seq_len(200) + 8)
    return {
        "max_seq_len": dict(a, max_seq_len=201),
        "output_dtype": dict(a, output_dtype=f16),
        "epi_dtype": dict(a, epi_dtype=f16),
        "acc_dtype": dict(a, acc_dtype=f16),
        "q strides": dict(a, q=a["q"].view(torch.uint8).transpose(0, 1).contiguous()
                          .transpose(0, 1).view(E4M3)),
        "weights strides": dict(a, weights=_strided(a["weights"], 0)),
        "block_tables strides": dict(a, block_tables=_strided(a["block_tables"], 0)),
        "block_tables shape": dict(a, block_tables=torch.zeros(3, 9, dtype=torch.int32)),
        "seq_lens strides": dict(a, seq_lens=_strided(a["seq_lens"], 0)),
        "kv_fused shape": dict(a, kv_fused=torch.zeros(41, 32, 1, 68, dtype=torch.uint8)),
        "out given": dict(a, out=torch.empty(6, mq.padded_seq_len(200))),
        "out strides": dict(a, out=wide_out[:, 8:]),
        "schedule_meta": dict(a, schedule_meta=torch.zeros(5, 2, dtype=torch.int32)),
    }  # fmt: skip


@by_guard_and_key
def test_mqa_repeat_replays_and_each_change_misses(mqa_stub, by, monkeypatch):
    replay_by(monkeypatch, by)
    stub, base = mqa_stub, mqa_args()
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 1
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**mqa_args())) == 0  # new tensors
    assert len(stub.launches) == 2
    for name, args in _mqa_variants(base).items():
        assert stub.runs(lambda args=args: mq.fp8_paged_mqa_logits(**args)) == 1, name
        assert stub.runs(lambda args=args: mq.fp8_paged_mqa_logits(**args)) == 0, name
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 0
    # A non-contiguous q: the replay launches on a dense copy, as the full path does.
    q = _mqa_variants(base)["q strides"]["q"]
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**dict(base, q=q))) == 0
    assert not q.is_contiguous() and stub.launches[-1][2][0] != q.data_ptr()


@by_guard_and_key
def test_mqa_replays_in_inference_mode_and_after_a_declined_replay(mqa_stub, by, monkeypatch):
    replay_by(monkeypatch, by)
    stub, base = mqa_stub, mqa_args()
    mq.fp8_paged_mqa_logits(**base)
    with torch.inference_mode():  # other dispatch keys: the key serves, the guard follows
        assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**mqa_args())) == 0
        assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**mqa_args())) == 0
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 0
    # q 1 byte off 16: the replay declines, the full path decides (its refusal is stubbed,
    # so the plan's own check refuses the address: never a silent skip).
    q = torch.zeros(base["q"].numel() + 1, dtype=torch.uint8)[1:].view(E4M3).view(3, 2, 32, 64)
    before = len(stub.full)
    with pytest.raises(ValueError, match="misaligned"):
        mq.fp8_paged_mqa_logits(**dict(base, q=q))
    assert len(stub.full) == before + 1
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 0
    assert len(mq.OP.default.replays) == 1


@by_guard_and_key
def test_mqa_changes_the_checks_refuse_miss(mqa_stub, monkeypatch, by):
    """Cached metadata never answers for a call the checks refuse (each scalar's type too)."""
    replay_by(monkeypatch, by)
    stub, base = mqa_stub, mqa_args()
    mq.fp8_paged_mqa_logits(**dict(base, max_seq_len=1))
    with pytest.raises(TypeError, match="max_seq_len"):  # 1's plan never answers for True
        mq.fp8_paged_mqa_logits(**dict(base, max_seq_len=True))
    mq.fp8_paged_mqa_logits(**base)
    bad = {
        "seq_lens dtype": (dict(base, seq_lens=base["seq_lens"].long()), TypeError),
        "weights device": (dict(base, weights=fake_cuda(base["weights"])), ValueError),
        "out dtype": (dict(base, out=torch.empty(6, 256, dtype=torch.float16)), TypeError),
        "max_seq_len type": (dict(base, max_seq_len=200.0), TypeError),
    }
    for args, exc in bad.values():
        with pytest.raises(exc):
            mq.fp8_paged_mqa_logits(**args)
    # a benchmark's variant: a runner of its own, with its own replays
    runner = mq.OP.runner(mq.MqaLogitsOptions(config=(2, 0, False, True)))
    assert stub.runs(lambda: runner.call(**base)) == 1
    assert stub.runs(lambda: runner.call(**base)) == 0


@by_guard_and_key
def test_mqa_switches_take_effect_on_the_next_call(mqa_stub, monkeypatch, by):
    replay_by(monkeypatch, by)
    stub, base = mqa_stub, mqa_args()
    mq.fp8_paged_mqa_logits(**base)
    launches = len(stub.launches)
    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    mq.fp8_paged_mqa_logits(**base)  # the torch path: nothing launched
    assert len(stub.launches) == launches
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE")
    checked = []
    monkeypatch.setattr(mq_op, "validate_preconditions", lambda *a: checked.append(a))
    monkeypatch.setenv("FLASHINFER_VALIDATE_INPUTS", "1")
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 1 and len(checked) == 1
    monkeypatch.delenv("FLASHINFER_VALIDATE_INPUTS")
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")  # plans of its own, then replays
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 1
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 0
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE")
    assert stub.runs(lambda: mq.fp8_paged_mqa_logits(**base)) == 0 and not checked[1:]


def test_mqa_per_pool_arguments_once_per_address(mqa_stub, monkeypatch):
    """The kv args (the TMA tensor map) are computed once per pool address, also when calls
    alternate between pools (a serving step passes each layer's own)."""
    stub, base, maps = mqa_stub, mqa_args(), []
    kernel = FakeKernel(stub.launches)

    def kv_args(kv_ptr, kv_fused):
        maps.append(kv_ptr)
        return (kv_ptr.to_bytes(8, "little"),)

    plan = KernelPlan(kernel, (7, 1, 1), (288, 1, 1), 99, (), kv_args, True)  # the TMA form
    monkeypatch.setattr(mq_plan, "kernel_plan", lambda *a: plan)
    other = mqa_args()
    for args in (base, base, base, other, other, base, other, base):
        mq.fp8_paged_mqa_logits(**args)
    kv, kv2 = base["kv_fused"].data_ptr(), other["kv_fused"].data_ptr()
    assert maps == [kv, kv2] and len(stub.full) == 1
    mine, theirs = kv.to_bytes(8, "little"), kv2.to_bytes(8, "little")
    assert [launch[2][-1] for launch in stub.launches[-4:]] == [theirs, mine, theirs, mine]


@pytest.mark.parametrize("max_seq_len", [256, 200], ids=["whole", "view"])
def test_mqa_replay_allocates_what_the_full_path_does(mqa_stub, max_seq_len):
    """out=None: a replay's logits (a new allocation, or the view of one) have the full
    path's shape, strides and dtype."""
    stub, base = mqa_stub, dict(mqa_args(), max_seq_len=max_seq_len)
    full = mq.fp8_paged_mqa_logits(**base)
    replays = [mq.fp8_paged_mqa_logits(**dict(mqa_args(), max_seq_len=max_seq_len)) for _ in "ab"]
    assert len(stub.full) == 1
    for got in replays:
        assert (got.shape, got.stride(), got.dtype) == (full.shape, full.stride(), full.dtype)
        assert got.shape == (6, max_seq_len) and got.stride() == (256, 1)
        # the storage covers the padded rows the kernel writes, as the full path's does
        assert got.untyped_storage().nbytes() == 6 * 256 * 4 == full.untyped_storage().nbytes()
    assert len({t.data_ptr() for t in (full, *replays)}) == 3


def test_mqa_replay_views_a_given_out_without_reshaping_it(mqa_stub):
    """A replay returns a view of the caller's ``out`` (its [:rows, :max_seq_len]); the
    caller's tensor keeps its shape (only a replay's own allocation is reshaped in place)."""
    stub = mqa_stub
    outs = [torch.empty(6, 256) for _ in range(3)]
    got = [mq.fp8_paged_mqa_logits(**mqa_args(), out=out) for out in outs]
    assert len(stub.full) == 1
    for out, logits in zip(outs, got, strict=True):
        assert out.shape == (6, 256) and out.stride() == (256, 1)
        assert logits.shape == (6, 200) and logits._base is out


@pytest.fixture
def deep_gemm_stub(mqa_stub, monkeypatch):
    """The DeepGEMM surface over mqa_stub's kernel; its replays (not a registry op's)
    emptied after the test."""
    monkeypatch.setattr(dg.OP, "kernel_call", lambda args: True)
    yield mqa_stub
    dg.OP.default.replays.clear()


def test_deep_gemm_reads_the_newest_slot_of_2d_lens_in_place(deep_gemm_stub):
    """The kernel reads context_lens[:, next_n - 1] where it lies, row-major lengths or
    not (a column-major [B, next_n] was read one int past its own column before)."""
    stub, a = deep_gemm_stub, mqa_args()
    row_major = torch.zeros(3, 2, dtype=torch.int32)
    column_major = torch.zeros(2, 3, dtype=torch.int32).t()
    for lens in (row_major, column_major, row_major, column_major):
        args = (a["q"], a["kv_fused"], a["weights"], lens, a["block_tables"], None, 200)
        dg.fp8_paged_mqa_logits(*args)
        launched = stub.launches[-1][2]  # q, kv, weights, table, its stride, lens, its stride
        assert launched[5:7] == (lens.select(1, 1).data_ptr(), lens.stride(0))
    assert len(stub.full) == 2  # one full path per layout, each replayed once
    with pytest.raises(NotImplementedError, match="indices"):  # never a replay's
        dg.fp8_paged_mqa_logits(*args, indices=torch.zeros(3, dtype=torch.int32))


# -- QSA ----------------------------------------------------------------------------------------
def qsa_args(rows=3, hq=8, hkv=2, d=64, page=16, blocks=24, topk=40, combined=False):
    if combined:
        kv = torch.zeros(blocks, hkv, page, 2 * d, dtype=E4M3)
        k_cache, v_cache = kv.transpose(1, 2).split(d, dim=-1)
    else:
        k_cache = torch.zeros(blocks, page, hkv, d, dtype=E4M3)
        v_cache = torch.zeros(blocks, page, hkv, d, dtype=E4M3)
    q = torch.zeros(rows, hq, d, dtype=torch.bfloat16)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache,
        logical_indices=torch.zeros(rows, topk + 1, dtype=torch.int32),
        block_table=torch.zeros(3, 6, dtype=torch.int32),
        token_to_req=torch.zeros(rows, dtype=torch.int32),
        out=torch.empty_like(q), output_gate=torch.zeros_like(q),
        softmax_scale=1 / math.sqrt(d), output_scale=1.0,
    )  # fmt: skip


@pytest.fixture
def qsa_stub(stub, monkeypatch):
    kernel = FakeKernel(stub.launches)
    monkeypatch.setattr(KernelFamily, "get", lambda self, params, device: kernel)
    fake_device(monkeypatch, qsa_op, qsa_plan, qsa_launch, qsa_checks)
    monkeypatch.setattr(qsa_plan, "wave_clusters", lambda device: qk.H200_WAVE_CLUSTERS.__getitem__)
    count_full_path(monkeypatch, qsa.OP, stub)
    return stub


def _qsa_variants(a: dict) -> dict:
    wide = torch.zeros(3, 2 * 41, dtype=torch.int32)
    return {
        "cache strides": dict(a, **{k: v for k, v in qsa_args(combined=True).items()
                                    if k in ("k_cache", "v_cache")}),
        "cache dtype": dict(a, k_cache=a["k_cache"].view(torch.uint8),
                            v_cache=a["v_cache"].view(torch.uint8)),
        "indices strides": dict(a, logical_indices=wide[:, :41]),
        "indices shape (topk)": dict(a, logical_indices=torch.zeros(3, 57, dtype=torch.int32)),
        "block_table shape": dict(a, block_table=torch.zeros(4, 6, dtype=torch.int32)),
        "token_to_req strides": dict(a, token_to_req=_strided(a["token_to_req"], 0)),
        "out strides": dict(a, out=_strided(a["out"], 1)),
        "softmax_scale": dict(a, softmax_scale=1.0),
        "softmax_scale type": dict(a, softmax_scale=1),  # == 1.0, cached just before
        "output_scale": dict(a, output_scale=2.0),
        "output_scale type": dict(a, output_scale=1),  # == the base's 1.0
    }  # fmt: skip


# Where the QSA launches take addresses (launch.SlotPass, launch.DecodeLaunch): argument
# position -> tensor, "slots" (the slot pass's buffer) or "counts" (the indices' last column).
QSA_ADDRESSES = (
    {0: "logical_indices", 3: "block_table", 6: "token_to_req", 8: "slots"},
    {0: "q", 3: "k_cache", 7: "v_cache", 11: "slots", 13: "counts", 18: "out", 21: "output_gate",
     26: "logical_indices", 28: "block_table", 33: "token_to_req"},
)  # fmt: skip


@pytest.mark.parametrize(
    "fn", [qsa.qsa_sparse_paged_decode, qsa.qsa_sparse_paged_attention], ids=["decode", "attn"]
)
@by_guard_and_key
def test_qsa_repeat_replays_and_each_change_misses(qsa_stub, fn, by, monkeypatch):
    replay_by(monkeypatch, by)
    stub, base, new = qsa_stub, qsa_args(), qsa_args()
    assert stub.runs(lambda: fn(**base)) == 1
    first = stub.launches[:]
    assert stub.runs(lambda: fn(**new)) == 0
    # The replay's launches are the full path's with the new call's addresses, its decode
    # reading the slots its own slot pass wrote.
    replayed = stub.launches[len(first) :]
    where = {name: t.data_ptr() for name, t in new.items() if isinstance(t, torch.Tensor)}
    counts = 4 * (new["logical_indices"].shape[1] - 1)  # the indices' last column, in bytes
    where.update(slots=replayed[0][2][8], counts=where["logical_indices"] + counts)
    want = [
        (grid, block, tuple(where[at[i]] if i in at else a for i, a in enumerate(args)), smem)
        for (grid, block, args, smem), at in zip(first, QSA_ADDRESSES, strict=True)
    ]
    assert [(grid, block, tuple(args), smem) for grid, block, args, smem in replayed] == want
    for name, args in _qsa_variants(base).items():
        assert stub.runs(lambda args=args: fn(**args)) == 1, name
        assert stub.runs(lambda args=args: fn(**args)) == 0, name
    other = qsa.qsa_sparse_paged_attention if fn is qsa.qsa_sparse_paged_decode else fn
    if other is not fn:  # the dispatch flag is part of the key
        assert stub.runs(lambda: other(**base)) == 1


@by_guard_and_key
def test_qsa_changes_the_checks_refuse_miss(qsa_stub, monkeypatch, by):
    replay_by(monkeypatch, by)
    stub, base = qsa_stub, qsa_args()
    qsa.qsa_sparse_paged_decode(**dict(base, output_scale=1))
    bad = {
        "output_scale bool": (dict(base, output_scale=True), ValueError),
        "softmax_scale nan": (dict(base, softmax_scale=math.nan), ValueError),
        "gate dtype": (dict(base, output_gate=base["output_gate"].float()), TypeError),
        "out device": (dict(base, out=fake_cuda(base["out"])), ValueError),
    }
    qsa.qsa_sparse_paged_decode(**base)
    for args, exc in bad.values():
        with pytest.raises(exc):
            qsa.qsa_sparse_paged_decode(**args)
    # other launch choices: a runner of their own, with its own replays
    runner = qsa.OP.runner(qsa_op.with_options(slot_entries=1))
    assert stub.runs(lambda: runner.call(**base, dispatch=False)) == 1
    assert stub.runs(lambda: runner.call(**base, dispatch=False)) == 0
    for name in SWITCHES:
        monkeypatch.setenv(name, "1")
        assert stub.runs(lambda: qsa.qsa_sparse_paged_decode(**base)) == 1, name
        monkeypatch.delenv(name)
    assert stub.runs(lambda: qsa.qsa_sparse_paged_decode(**base)) == 0


def test_qsa_misaligned_replay_takes_the_full_path(qsa_stub):
    stub, base = qsa_stub, qsa_args()
    qsa.qsa_sparse_paged_decode(**base)
    out = torch.zeros(3 * 8 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 8, 64)  # 2 bytes off
    with pytest.raises(ValueError, match="misaligned"):  # the stubbed refusal lets it through
        qsa.qsa_sparse_paged_decode(**dict(base, out=out))
    assert len(stub.full) == 2


class RecordingRaw:
    """A raw allocator (jit_kernels.alloc) on cuda:0 that records what it hands out."""

    def __init__(self):
        self.taken, self.given = [], []

    def allocator(self) -> RawAllocator:
        def new(nbytes: int, stream: int) -> int:
            self.taken.append(1 << 20 * (len(self.taken) + 1))
            return self.taken[-1]

        return RawAllocator(new, self.given.append, lambda: 0)


def test_qsa_slots_are_scratch_both_launches_share_then_give_back(qsa_stub, monkeypatch):
    """The slot pass writes and the single pass reads one buffer per call, raw from the
    allocator (a CUDA device's path), handed back once both are enqueued: on the full
    path, on a replay, and when a launch fails."""
    raw = RecordingRaw()
    monkeypatch.setattr(qsa_launch, "raw_allocator", lambda device: raw.allocator())
    stub, base = qsa_stub, qsa_args()
    for calls in (1, 2):  # the full path, then a replay
        qsa.qsa_sparse_paged_decode(**base)
        slot_pass, decode = (launch[2] for launch in stub.launches[-2:])
        assert raw.taken[-1] in slot_pass and raw.taken[-1] in decode
        assert raw.given == raw.taken and len(raw.taken) == calls
    assert len(stub.full) == 1

    def fail(*args, **kwargs):
        raise LaunchError("launching fake failed")

    monkeypatch.setattr(FakeKernel, "launch", fail)
    with pytest.raises(LaunchError):
        qsa.qsa_sparse_paged_decode(**base)
    assert raw.given == raw.taken and len(raw.taken) == 3


# -- concat ---------------------------------------------------------------------------------------
def concat_args(tokens=4, heads=2, pe_stride=64):
    return dict(
        kv_nope=torch.zeros(tokens, heads, 256, dtype=torch.bfloat16),
        k_pe=torch.zeros(tokens, pe_stride, dtype=torch.bfloat16)[:, :64],
        key=torch.empty(tokens, heads, 192, dtype=E4M3),
        value=torch.empty(tokens, heads, 128, dtype=E4M3),
    )


@pytest.fixture
def concat_stub(stub, monkeypatch):
    kernel = FakeKernel(stub.launches)
    monkeypatch.setattr(KernelFamily, "get", lambda self, params, device: kernel)
    fake_device(monkeypatch, mkp_op, mkp_cake, mkp_specialized)
    count_full_path(monkeypatch, mkp.OP, stub)
    return stub


@by_guard_and_key
def test_concat_repeat_replays_and_each_change_misses(concat_stub, by, monkeypatch):
    replay_by(monkeypatch, by)
    stub, base = concat_stub, concat_args()
    op = mkp.concat_mla_kv_quant_fp8
    assert stub.runs(lambda: op(**base)) == 1
    assert stub.runs(lambda: op(**concat_args())) == 0
    assert stub.runs(lambda: op(base["kv_nope"], base["k_pe"])) == 1  # allocating: no replay
    variants = {
        "k_pe strides": dict(base, k_pe=concat_args(pe_stride=576)["k_pe"]),
        "tokens": concat_args(tokens=5),
        "backend": dict(base, backend="specialized"),
    }
    for name, args in variants.items():
        assert stub.runs(lambda args=args: op(**args)) == 1, name
        assert stub.runs(lambda args=args: op(**args)) == 0, name
    with pytest.raises(ValueError, match="value is on"):
        op(**dict(base, value=fake_cuda(base["value"])))
    with pytest.raises(TypeError, match="key must be"):
        op(**dict(base, key=base["key"].view(torch.uint8)))


def test_qsa_one_tensor_in_two_places_replays(qsa_stub):
    """The guard refuses a tensor object passed twice (here out is output_gate): such calls
    replay through the key."""
    stub, base = qsa_stub, qsa_args()
    same = dict(base, output_gate=base["out"])
    assert stub.runs(lambda: qsa.qsa_sparse_paged_decode(**same)) == 1
    assert stub.runs(lambda: qsa.qsa_sparse_paged_decode(**same)) == 0
    assert stub.runs(lambda: qsa.qsa_sparse_paged_decode(**base)) == 0
