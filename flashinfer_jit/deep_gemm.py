"""DeepGEMM's paged MQA logits API (the sparse-attention indexer), served by this package.

A serving engine that calls ``deep_gemm.fp8_paged_mqa_logits`` switches with one line,
``import flashinfer_jit.deep_gemm as deep_gemm``: the names, argument order, defaults and
semantics below are DeepGEMM's, and every other name (its GEMMs, ``fp8_mqa_logits``,
``get_num_sms`` / ``set_num_sms``) is the installed deep_gemm's (``__getattr__``).
Everything lands on ``mqa_logits.paged_logits`` (the kernels of ``fp8_paged_mqa_logits``)
with float32 epilogue and accumulator.

``schedule_meta`` is accepted and not read: a caller's schedule may be DeepGEMM's own, whose
rows mean other things in the same [num_sms + 1, 2] int32 shape (an engine that swapped the
import in one file and builds its metadata with deep_gemm in another), and the kernels split
the work themselves (how issue 17 times them; with a given split they measured level at
every row of MQA run 22, BENCHMARKS.md's "schedule given" column).

Lengths: ``context_lens`` [B] (row b*next_n + t sees positions <= context_lens[b] - next_n + t)
or [B, next_n] (row b*next_n + t sees positions < context_lens[b, t]). Both reach the kernels
as one length per request, the one of the newest slot: context_lens[b] itself, or the column
context_lens[:, next_n - 1] as a strided view (no copy). The kernels compute every row of a
request up to that length, which covers each row's visible positions when the newest slot's
length is the largest (DeepGEMM's scheduler assumes the same); past a row's own length the
values are unspecified, as in DeepGEMM, unless ``clean_logits`` writes -inf there.
"""

from __future__ import annotations

import functools
import re
import sys
import types

import torch

from jit_kernels import sm_count, validate_values

from .contract import Op, ScalarArg, TensorArg
from .mqa_logits import OP as MQA
from .mqa_logits import MqaLogitsOptions, compute_paged_mqa_logits_schedule
from .mqa_logits.checks import BLOCK_SIZES, min_block_table_width, validate_preconditions
from .mqa_logits.clean import clean_logits as write_clean
from .mqa_logits.launch import Launch
from .mqa_logits.plan import launch_for

__all__ = [  # what this module serves (README: replacing them in an imported deep_gemm)
    "fp8_fp4_paged_mqa_logits",
    "fp8_paged_mqa_logits",
    "get_paged_mqa_logits_metadata",
]
LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_NO_FP4 = (
    "an FP4 q (a (q_fp4, q_sf) tuple with scale factors) is not served: this module serves "
    "(q_fp8, None) only, there is no FP4 kernel"
)
_NO_VARLEN = (
    "indices (DeepGEMM's varlen batches of sm100) is not served: pass one row per request "
    "(q [B, next_n, H, D]) and 2-D context_lens [B, next_n] instead"
)


# The native entry's argument names in its messages -> this API's.
_NAMES = {
    "kv_fused": "kv_cache",
    "block_tables": "block_table",
    "seq_lens": "context_lens",
    "max_seq_len": "max_context_len",
    "output_dtype": "logits_dtype",
}
_RENAMES = re.compile(r"\b(" + "|".join(_NAMES) + r")\b")


def _device_sms() -> int:
    """The current CUDA device's SM count (a schedule's size), 1 without CUDA."""
    if not torch.cuda.is_available():
        return 1
    return sm_count(torch.cuda.current_device())


@functools.cache
def _import_deep_gemm() -> types.ModuleType | None:
    """The installed deep_gemm, imported once (a failed import searches every path entry)."""
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def __getattr__(name: str) -> object:
    """DeepGEMM's other names, from the installed deep_gemm (so that importing this module
    in its place is one line); without it, ``get_num_sms`` is the device's SM count."""
    if name.startswith("__"):
        raise AttributeError(name)
    deep_gemm = sys.modules.get("deep_gemm") or _import_deep_gemm()
    if deep_gemm is sys.modules[__name__]:  # this module installed under that name
        deep_gemm = None
    if deep_gemm is not None and hasattr(deep_gemm, name):
        return getattr(deep_gemm, name)
    if name == "get_num_sms":
        return _device_sms
    where = "not installed" if deep_gemm is None else "has no such name either"
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r}: it serves DeepGEMM's paged MQA "
        f"logits ({', '.join(__all__)}), other names come from deep_gemm ({where})"
    )


def _request_lens(context_lens: torch.Tensor, batch: int | None) -> tuple[torch.Tensor, int]:
    """(one length per request, the newest slot's, as a view; next_n of 2-D lens or 0)."""
    if not isinstance(context_lens, torch.Tensor) or context_lens.dim() not in (1, 2):
        raise ValueError("context_lens must be a 1-D [B] or 2-D [B, next_n] int32 tensor")
    if context_lens.dtype != torch.int32:
        raise TypeError(f"context_lens must be torch.int32, got {context_lens.dtype}")
    if batch is not None and context_lens.shape[0] != batch:
        raise ValueError(f"context_lens has {context_lens.shape[0]} rows, q has batch {batch}")
    if context_lens.dim() == 1:
        return context_lens, 0
    if context_lens.shape[1] == 0:
        raise ValueError("2-D context_lens [B, next_n] needs next_n >= 1")
    return context_lens.select(1, context_lens.shape[1] - 1), context_lens.shape[1]


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor,
    block_kv: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """A ``schedule_meta`` of DeepGEMM's shape, [num_sms + 1, 2] int32: this package's split
    of the requests' 64-token tiles (what ``mqa_logits.fp8_paged_mqa_logits`` can be given;
    this module's logits functions accept it and split the work themselves)."""
    if indices is not None:
        raise NotImplementedError(_NO_VARLEN)
    if block_kv not in BLOCK_SIZES:
        raise ValueError(f"block_kv must be one of {BLOCK_SIZES}, got {block_kv}")
    lens, _ = _request_lens(context_lens, None)
    return compute_paged_mqa_logits_schedule(lens, block_kv, num_sms)


def _split_q(q) -> torch.Tensor:
    if not isinstance(q, (tuple, list)) or len(q) != 2:
        raise TypeError("q must be a (q_fp8, None) tuple, q_fp8 [B, next_n, H, D] float8_e4m3fn")
    if q[1] is not None:
        raise NotImplementedError(_NO_FP4)
    return q[0]


def _dense_pool(kv_cache, block_table, q, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, table) the kernels can read: a pool with DeepGEMM's block layout and a block
    stride other than block_kv * (head_dim + 4) bytes is gathered, block by block the table
    names up to ``max_len`` tokens, into a dense pool (a copy; the kernels read a dense pool)."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or kv_cache.is_contiguous():
        return kv_cache, block_table  # the checks of paged_logits name what is wrong
    _, block_kv, heads, width = kv_cache.shape
    if heads != 1 or not isinstance(q, torch.Tensor) or q.dim() != 4 or width != q.shape[3] + 4:
        return kv_cache, block_table  # a wrong shape: the checks of paged_logits say so
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) % 4:
        raise ValueError(
            "kv_cache must hold each token's head_dim + 4 bytes contiguously (stride(1) == "
            f"head_dim + 4, stride(3) == 1) with a block stride divisible by 4, got stride "
            f"{kv_cache.stride()}"
        )
    if kv_cache.stride(0) < block_kv * width:
        raise ValueError(f"kv_cache blocks overlap: stride(0) = {kv_cache.stride(0)}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        return kv_cache, block_table
    # A table is as wide as the longest context the engine allows (vLLM: max_model_len /
    # block_kv columns): gather only the columns max_len reaches, as many as the kernels'
    # table must hold. Entries past a request's own blocks may hold anything: clamp them.
    if isinstance(max_len, int) and max_len >= 0:
        block_table = block_table[:, : min_block_table_width(max_len, block_kv)]
    ids = block_table.long().clamp(0, kv_cache.shape[0] - 1).flatten()
    pool = kv_cache.index_select(0, ids)  # DeepGEMM's layout, dense
    pool.fij_gathered = True  # a copy made for this call: its launch is never replayed
    table = torch.arange(ids.numel(), dtype=torch.int32, device=ids.device)
    return pool, table.view(block_table.shape)


def _check_schedule(schedule_meta) -> None:
    """A given ``schedule_meta`` must be a tensor; it is not read (the module docstring)."""
    if schedule_meta is not None and not isinstance(schedule_meta, torch.Tensor):
        raise TypeError("schedule_meta must be the tensor get_paged_mqa_logits_metadata returns")


def _check_lens_order(context_lens: torch.Tensor) -> None:
    """The newest slot's length must be the largest (validate_values; syncs on a GPU)."""
    if context_lens.dim() != 2 or context_lens.numel() == 0:
        return
    if bool((context_lens > context_lens[:, -1:]).any()):
        raise ValueError(
            "context_lens[b, t] exceeds context_lens[b, next_n - 1]: the kernels compute each "
            "request up to its newest slot's length"
        )


class DeepGemmLaunch:
    """A checked call's logits launch (the native op's ``Launch``), reading the lengths in
    place: ``context_lens`` itself, or the newest slot's column of 2-D lengths (the
    ``Launch``'s lens_offset, (next_n - 1) * stride(1) ints on, at the lengths' row stride:
    what a ``select`` view would hold, without making one per call); then ``clean_logits``
    when asked. ``indices`` is always None here (prepare refuses it), ``schedule_meta``
    unread (the kernels split the work)."""

    __slots__ = ("launch", "replay")

    def __init__(self, launch: Launch, dense: bool):
        self.launch, self.replay = launch, dense

    # fmt: off
    def run(self, q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
            clean_logits, logits_dtype, out, indices) -> torch.Tensor | None:
        # fmt: on
        logits = self.launch.run(
            q, kv_cache, weights, block_table, context_lens, max_context_len, logits_dtype,
            None, None, None, out,
        )  # fmt: skip
        if clean_logits and logits is not None:
            write_clean(logits, context_lens, q.shape[1])
        return logits


class DeepGemmLogits(Op[DeepGemmLaunch, MqaLogitsOptions]):
    """DeepGEMM's paged MQA logits call as an op of the contract: its checks and argument
    mapping run once per call shape, and a repeat call replays the launch (a dict lookup
    and the native op's launch), so this surface costs what the native entry does."""

    name = "deep_gemm_paged_mqa_logits"
    log_name = custom_op = "deep_gemm_paged_mqa_logits"
    workloads, workload_fields = MQA.workloads, MQA.workload_fields  # the native op's kernels
    args = (
        TensorArg("q", dense=True),
        TensorArg("kv_cache"),  # its block stride decides whether the pool is gathered
        TensorArg("weights", dense=True),
        TensorArg("context_lens"),
        TensorArg("block_table"),
        TensorArg("schedule_meta", optional=True),
        ScalarArg("max_context_len", "int"),
        ScalarArg("clean_logits", "bool"),
        ScalarArg("logits_dtype", "ScalarType", typed=False),
        TensorArg("out", optional=True, mutated=True),  # always None from the public functions
        TensorArg("indices", optional=True),  # DeepGEMM's varlen batches: refused (prepare)
    )
    options_type = MqaLogitsOptions

    def native(self, args: tuple) -> tuple:
        """The native op's arguments of a call (a gathered pool when its blocks are strided)."""
        q, kv_cache, weights, context_lens, block_table, schedule_meta = args[:6]
        max_context_len, logits_dtype, out = args[6], args[8], args[9]
        if logits_dtype not in LOGITS_DTYPES:
            raise ValueError(
                f"logits_dtype must be torch.float32 or torch.bfloat16, got {logits_dtype}"
            )
        batch = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
        lens, lens_next_n = _request_lens(context_lens, batch)
        if lens_next_n and batch is not None and lens_next_n != q.shape[1]:
            raise ValueError(f"context_lens is [B, {lens_next_n}], q has next_n {q.shape[1]}")
        pool, table = _dense_pool(kv_cache, block_table, q, max_context_len)
        f32 = torch.float32
        _check_schedule(schedule_meta)
        return (q, pool, weights, table, lens, max_context_len, logits_dtype, f32, f32, None,
                out, True)  # fmt: skip

    def prepare(self, args: tuple) -> tuple:
        if args[10] is not None:
            raise NotImplementedError(_NO_VARLEN)
        native = self.native(args)
        try:
            native = MQA.prepare(native)
            if validate_values(args[3].device):
                _check_lens_order(args[3])
                if native[1] is not args[1]:  # gathered: the caller's table, not the copy's
                    lens, block_kv = native[4], args[1].shape[1]
                    validate_preconditions(args[1], args[4], lens, args[6], block_kv)
        except (ValueError, TypeError) as exc:  # name the arguments as this API calls them
            raise type(exc)(_RENAMES.sub(lambda m: _NAMES[m.group(0)], str(exc))) from exc
        # The gathered pool and table (or the caller's) and the allocated logits.
        return (args[0], native[1], args[2], args[3], native[3], *args[5:9], native[10], None)

    def empty(self, args: tuple) -> bool:
        return args[0].shape[0] == 0 or args[6] == 0

    def refusal(self, args: tuple) -> str | None:
        return MQA.refusal(args)  # q and kv_cache come first, as in the native op

    def plan(self, args: tuple, options: MqaLogitsOptions) -> DeepGemmLaunch:
        native = self.native(args)  # prepare's args: a strided pool is already gathered
        gathered = getattr(args[1], "fij_gathered", False)
        lens = args[3]  # 2-D: the kernel reads the newest slot's column in place
        offset = 4 * (lens.shape[1] - 1) * lens.stride(1) if lens.dim() == 2 else 0
        launch = launch_for(native, options, offset)
        return DeepGemmLaunch(launch, not gathered)

    def reference(self, args: tuple) -> None:
        MQA.reference(self.native(args))
        if args[7]:
            write_clean(self.result(args), args[3], args[0].shape[1])

    def result(self, args: tuple) -> torch.Tensor:
        out, rows, max_context_len = args[9], args[0].shape[0] * args[0].shape[1], args[6]
        return out if out.shape == (rows, max_context_len) else out[:rows, :max_context_len]

    def prebuild_specs(self, workloads: dict, options: MqaLogitsOptions) -> list:
        return []  # the native op's (flashinfer-jit prebuild --ops mqa_logits)


OP = DeepGemmLogits()
_run = OP.default.run


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    logits_dtype: torch.dtype = torch.float32,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepGEMM's ``fp8_fp4_paged_mqa_logits`` for FP8 q: [B * next_n, max_context_len] logits
    in ``logits_dtype`` (float32 or bfloat16, rounded once from the float32 epilogue)."""
    if indices is not None:
        raise NotImplementedError(_NO_VARLEN)
    return _run(
        (_split_q(q), kv_cache, weights, context_lens, block_table, schedule_meta,
         max_context_len, clean_logits, logits_dtype, None, None)
    )  # fmt: skip


# The body: the contract's call path, reading the parameters directly (a repeat call
# replays; indices given is refused by prepare, before anything is launched).
@OP.entry(logits_dtype=torch.float32, out=None)
def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepGEMM's ``fp8_paged_mqa_logits``: q is the FP8 tensor itself, float32 logits."""
