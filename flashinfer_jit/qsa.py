"""QSA fp8 sparse paged decode: a slot pass, a single-pass kernel and a split-K kernel.

    out[r, h] = output_scale * softmax(q[r, h] . K_sel * softmax_scale) V_sel * sigmoid(gate[r, h])

over the cache tokens row r selects (see ``qsa_ref.resolve_entries`` for what is
attended). Read top to bottom: argument checks, the kernels' applicability, the launches
(slot pass -> decode; split-K merges inside the decode, through a workspace or, as a thread
block cluster, through distributed shared memory), the dispatch gate, warm-up and prebuild.
The torch path (``qsa_ref``) defines the semantics and serves CPU tensors and every call
the kernels cannot take.
"""

from __future__ import annotations

import functools
import math

import torch

from jit_kernels import KernelSpec, KernelUnavailable, current_stream, fall_back, kernels_disabled

from ._jit import cuda_device_index, kernel_family
from .qsa_ref import qsa_decode_torch

OP = "qsa"
WORKLOADS = "qsa_workloads.json"
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
CHUNK = 16  # tokens per warp step (kChunk in templates/qsa_decode.cuh)
_SLOT_THREADS = 256  # kSlotThreads in templates/qsa_slots.cuh
MAX_SPLITS = 64  # kMaxSplits in templates/qsa_decode.cuh
_RED_PAD = 4  # kRedPad in templates/qsa_decode.cuh
_LOG2E = 1.4426950408889634

# (num_warps, num_stages, min_ctas, heads_per_cta) of the decode kernel per head dim. A warp
# stage holds one 16-token chunk of K and V (D * 32 bytes); min_ctas is the launch bound
# (CTAs per SM the registers must allow; 4 CTAs of 4 warps moves Q to shared memory to fit
# 128 registers); heads_per_cta kv heads share a CTA, num_warps / heads_per_cta warps each
# (it must divide num_kv_heads; the benchmark times 1, 2 and 4). D=128: 4 x 52 KB of shared
# memory, 16 warps per SM.
DECODE_CONFIG = {64: (4, 8, 1, 1), 128: (4, 3, 4, 1), 256: (4, 2, 1, 1)}
# Single pass when rows * num_kv_heads reaches this; below it the selection is split across
# CTAs. See use_fp8_decode_kernel for the measured crossover.
DECODE_MIN_PROGRAMS = 512
# Split-K aims for this many CTAs per SM, each split keeping at least this many chunks.
_SPLIT_CTAS_PER_SM = 4
_MIN_CHUNKS_PER_SPLIT = 8
# Split-K as thread block clusters of CLUSTER_SIZES CTAs merging through distributed shared
# memory (no workspace, no completion counters), resolving their own slots when a split's
# share fits CLUSTER_SLOT_CAP entries (no slot pass: one launch a call). Taken for 2..16
# wanted splits (capped at 8) when SPLIT_K_CLUSTER is on; off until the H200 measurement (tools/bench_qsa.py,
# the rows=4 table and the sweep's cluster column) shows it wins.
SPLIT_K_CLUSTER = False
CLUSTER_SIZES = (2, 4, 8)
CLUSTER_SLOT_CAP = 1024

_slots_family = kernel_family(
    "qsa_slots",
    "qsa_slots.cuh",
    "fij_qsa::qsa_slots",
    ("page_size",),
    ("P", "q", "q", "P", "q", "q", "P", "q", "P", "i", "i", "i", "i", "i", "i", "P", "i"),
)
_DECODE_SIGNATURE = (
    *("P", "q", "q"),  # q
    *("P", "I", "I", "I", "P", "I", "I", "I"),  # k, v caches and their byte strides (32-bit)
    *("P", "i", "P", "q", "i", "i", "i"),  # slots, counts, topk, offset bits, Hkv
    *("P", "q", "q", "P", "q", "q"),  # out, gate
    *("f", "f", "P", "P", "P", "i"),  # scales, split-K workspace and counters, splits
    *("P", "q", "P", "q", "q", "i", "i", "P", "q", "i", "i"),  # fused slot resolution's inputs
)
_DECODE_PARAMS = ("group_size", "head_dim", "num_warps", "num_stages", "min_ctas", "heads_per_cta")
_decode_family = kernel_family(
    "qsa_decode", "qsa_decode.cuh", "fij_qsa::qsa_decode", _DECODE_PARAMS, _DECODE_SIGNATURE
)
# Small batches: the splits of a (row, head group) as one thread block cluster merging
# through distributed shared memory, optionally resolving its own slots (one launch a call).
_decode_cluster_family = kernel_family(
    "qsa_decode_cluster",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_cluster",
    (*_DECODE_PARAMS, "cluster", "slot_cap"),
    _DECODE_SIGNATURE,
)


# -- argument checks -----------------------------------------------------------------------
def _check_args(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    softmax_scale,
    output_scale,
) -> None:
    """Raise a ValueError/TypeError naming the argument and the rule it breaks."""

    def tensor(name, value, dim, dtypes, what):
        if not isinstance(value, torch.Tensor) or value.dim() != dim:
            raise ValueError(f"{name} must be a {dim}-D tensor {what}")
        if value.dtype not in dtypes:
            allowed = " or ".join(str(d) for d in dtypes)
            raise TypeError(f"{name} must be {allowed}, got {value.dtype}")

    tensor("q", q, 3, (torch.bfloat16,), "[rows, num_query_heads, head_dim]")
    rows, num_q_heads, head_dim = q.shape
    for name, t in (("out", out), ("output_gate", output_gate)):
        tensor(name, t, 3, (torch.bfloat16,), "[rows, num_query_heads, head_dim]")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    tensor(
        "k_cache", k_cache, 4, FP8_CACHE_DTYPES, "[num_blocks, page_size, num_kv_heads, head_dim]"
    )
    tensor(
        "v_cache", v_cache, 4, FP8_CACHE_DTYPES, "[num_blocks, page_size, num_kv_heads, head_dim]"
    )
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache's shape and dtype {tuple(k_cache.shape)}/{k_cache.dtype}, "
            f"got {tuple(v_cache.shape)}/{v_cache.dtype}"
        )
    num_blocks, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_dim} differs from q's {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_query_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if page_size < 1:
        raise ValueError("k_cache page_size (dim 1) must be at least 1")
    tensor(
        "logical_indices",
        logical_indices,
        2,
        (torch.int32,),
        "[rows, TOPK + 1] (last column: valid count)",
    )
    if logical_indices.shape[0] != rows or logical_indices.shape[1] < 1:
        raise ValueError(
            f"logical_indices must be [rows={rows}, TOPK + 1], got {tuple(logical_indices.shape)}"
        )
    tensor("block_table", block_table, 2, (torch.int32,), "[num_requests, width]")
    tensor("token_to_req", token_to_req, 1, (torch.int32,), "[rows]")
    if token_to_req.shape[0] != rows:
        raise ValueError(
            f"token_to_req must have {rows} entries (one per row), got {token_to_req.shape[0]}"
        )
    named = (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("logical_indices", logical_indices),
        ("block_table", block_table),
        ("token_to_req", token_to_req),
        ("out", out),
        ("output_gate", output_gate),
    )
    for name, t in named:
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device}, q on {q.device}: all tensors must share a device"
            )
    for name, value in (("softmax_scale", softmax_scale), ("output_scale", output_scale)):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name} must be a finite real number, got {value!r}")


# -- which calls the kernels can take --------------------------------------------------------
def _offset_bits(page_size: int) -> int:
    return max(1, (page_size - 1).bit_length())


def _decode_smem_bytes(
    head_dim: int,
    num_warps: int,
    num_stages: int,
    min_ctas: int,
    heads: int,
    cluster: int = 0,
    slot_cap: int = 0,
) -> int:
    """DecodeSmem<...>::kBytes of templates/qsa_decode.cuh."""
    q_in_smem = head_dim > 128 or num_warps * min_ctas >= 16
    q_bytes = heads * (head_dim // 64) * 4 * 32 * 16 if q_in_smem else 0
    stage = num_warps * num_stages * (head_dim // 16) * 32 * 16
    red = num_warps * 16 * (head_dim + _RED_PAD) * 4 + num_warps * 16 * 2 * 4
    merge = (2 * MAX_SPLITS * 16 + 16) * heads * 4
    part = heads * 16 * (head_dim + 2) * 4 if cluster else 0
    return q_bytes + max(stage + slot_cap * 4, red + part, merge)


def _rows_aligned(t: torch.Tensor, row_dims: tuple[int, ...], nbytes: int = 16) -> bool:
    """Unit last stride, 16-byte aligned base, and every listed stride a 16-byte multiple."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % nbytes == 0
        and all(t.stride(d) * size % nbytes == 0 or t.shape[d] == 1 for d in row_dims)
    )


def _kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate) -> str | None:
    """Why the kernels cannot serve this call (None when they can)."""
    if q.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if torch.cuda.get_device_capability(q.device) < (8, 9):
        return "compute capability below 8.9 (no e4m3 conversion instructions)"
    rows, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernels: {HEAD_DIMS})"
    if num_q_heads // num_kv_heads > MAX_GROUP:
        return f"group size {num_q_heads // num_kv_heads} > {MAX_GROUP}"
    if not all(_rows_aligned(t, (0, 1, 2)) for t in (k_cache, v_cache)):
        return "k_cache/v_cache token rows are not 16-byte aligned with a unit last stride"
    if not all(_rows_aligned(t, (0, 1)) for t in (q, out, output_gate)):
        return "q/out/output_gate head rows are not 16-byte aligned with a unit last stride"
    if max(*k_cache.stride()[:3], *v_cache.stride()[:3]) >= 2**32:
        return "a k_cache/v_cache stride of 2**32 bytes or more (the kernel keeps 32-bit strides)"
    if num_blocks << _offset_bits(page_size) >= 2**31:
        return f"{num_blocks} blocks x page {page_size} overflow the int32 slot encoding"
    if rows * num_kv_heads >= 2**31 or logical_indices.shape[1] - 1 >= 2**26:
        return "rows * num_kv_heads or TOPK too large for the launch grid"
    return None


def _decode_config(head_dim: int) -> tuple[int, int, int, int]:
    return DECODE_CONFIG[head_dim]


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pick_splits(rows: int, num_kv_heads: int, topk: int, device: int) -> int:
    """CTAs per (row, kv head) for split-K: fill the GPU, but keep each split worthwhile."""
    base = max(1, rows * num_kv_heads)
    chunks = -(-topk // CHUNK)
    want = -(-_SPLIT_CTAS_PER_SM * _sm_count(device) // base)
    return max(1, min(want, chunks // _MIN_CHUNKS_PER_SPLIT, MAX_SPLITS))


def _split_plan(
    rows: int, num_kv_heads: int, topk: int, head_dim: int, device: int
) -> tuple[int, tuple[int, ...] | None]:
    """(num_splits, decode config or None for the default) of a split-K call."""
    splits = _pick_splits(rows, num_kv_heads, topk, device)
    # Up to twice the largest cluster, the cluster's cheaper merge makes up for fewer splits
    # (round 2, rows=4: 8 workspace splits beat 16); far past it the workspace path keeps
    # the parallelism.
    if not SPLIT_K_CLUSTER or not CLUSTER_SIZES[0] <= splits <= 2 * CLUSTER_SIZES[-1]:
        return splits, None
    cluster = max(c for c in CLUSTER_SIZES if c <= splits)
    chunks = -(-topk // CHUNK)
    per_split = -(-chunks // cluster) * CHUNK
    cap = CLUSTER_SLOT_CAP if per_split <= CLUSTER_SLOT_CAP else 0
    return cluster, (*_decode_config(head_dim), cluster, cap)


# -- the launches ----------------------------------------------------------------------------
def _run_kernels(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    softmax_scale,
    output_scale,
    num_splits: int,
    config: tuple[int, ...] | None = None,
) -> None:
    """Launch the kernels. ``config``: (warps, stages, min CTAs/SM, kv heads per CTA), plus
    optionally (cluster, slot_cap): cluster = num_splits runs the splits as one thread block
    cluster; slot_cap > 0 (with a cluster) resolves the slots in the decode, no slot pass."""
    rows, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    topk = logical_indices.shape[1] - 1
    offset_bits = _offset_bits(page_size)
    device = cuda_device_index(q)
    stream = current_stream(device)
    slot_columns = -(-topk // CHUNK) * CHUNK
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    config = tuple(config or _decode_config(head_dim))
    config, (cluster, slot_cap) = config[:4], (*config[4:], 0, 0)[:2]
    heads = config[3]
    if heads < 1 or num_kv_heads % heads or config[0] % heads:
        raise ValueError(
            f"heads_per_cta {heads} must divide num_kv_heads ({num_kv_heads}) and num_warps"
        )
    if cluster and (cluster != num_splits or slot_columns == 0):
        raise ValueError(f"a cluster of {cluster} runs num_splits={cluster}, got {num_splits}")
    per_split = -(-(slot_columns // CHUNK) // max(num_splits, 1)) * CHUNK  # entries a split
    if slot_cap and (not cluster or per_split > slot_cap):
        raise ValueError(f"slot_cap {slot_cap} needs a cluster and >= {per_split} entries a split")
    if slot_columns == 0:
        num_splits = 1  # nothing to split; the slot pass (which zeroes the counters) is skipped
    workspace = None
    acc_ptr = ml_ptr = counters_ptr = 0
    if num_splits > 1 and not cluster:
        # One allocation: partial accumulators, (max, sum) pairs, completion counters.
        parts = rows * num_q_heads * num_splits
        workspace = torch.empty(
            parts * (head_dim + 2) + rows * num_kv_heads, dtype=torch.float32, device=q.device
        )
        acc_ptr = workspace.data_ptr()
        ml_ptr = acc_ptr + parts * head_dim * 4
        counters_ptr = ml_ptr + parts * 2 * 4
    if slot_cap:
        slots_ptr = 0
    else:
        slots = _resolve_slots(logical_indices, block_table, token_to_req, k_cache, counters_ptr)
        slots_ptr = slots.data_ptr()
    # Cache strides in bytes (an e4m3 element is one byte).
    k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    counts = logical_indices.data_ptr() + topk * logical_indices.stride(1) * 4
    family, params = _decode_family, (group, head_dim, *config)
    if cluster:
        family, params = _decode_cluster_family, (*params, cluster, slot_cap)
    family.get(params, device).launch(
        (rows * num_kv_heads // heads, num_splits, 1),
        (32 * config[0], 1, 1),
        stream,
        (
            q.data_ptr(),
            q.stride(0),
            q.stride(1),
            k_cache.data_ptr(),
            k_strides[0],
            k_strides[1],
            k_strides[2],
            v_cache.data_ptr(),
            v_strides[0],
            v_strides[1],
            v_strides[2],
            slots_ptr,
            slot_columns,
            counts,
            logical_indices.stride(0),
            topk,
            offset_bits,
            num_kv_heads,
            out.data_ptr(),
            out.stride(0),
            out.stride(1),
            output_gate.data_ptr(),
            output_gate.stride(0),
            output_gate.stride(1),
            softmax_scale * _LOG2E,
            output_scale,
            acc_ptr,
            ml_ptr,
            counters_ptr,
            num_splits,
            logical_indices.data_ptr(),
            logical_indices.stride(1),
            block_table.data_ptr(),
            block_table.stride(0),
            block_table.stride(1),
            block_table.shape[1],
            block_table.shape[0],
            token_to_req.data_ptr(),
            token_to_req.stride(0),
            num_blocks,
            page_size,
        ),
        smem=_decode_smem_bytes(head_dim, *config, cluster, slot_cap),
    )
    del workspace  # the caching allocator keeps it stream-ordered until the kernels ran


def _resolve_slots(
    logical_indices, block_table, token_to_req, k_cache, counters_ptr: int = 0
) -> torch.Tensor:
    """The slot pass: [rows, TOPK rounded up to a chunk] int32 packed slots, -1 masked.

    With ``counters_ptr`` it also zeroes rows * num_kv_heads split-K completion counters.
    """
    rows = logical_indices.shape[0]
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    device = cuda_device_index(logical_indices)
    stream = current_stream(device)
    slot_columns = -(-topk // CHUNK) * CHUNK
    slots = torch.empty((rows, slot_columns), dtype=torch.int32, device=logical_indices.device)
    if slot_columns:
        _slots_family.get((page_size,), device).launch(
            (rows, -(-slot_columns // _SLOT_THREADS), 1),
            (_SLOT_THREADS, 1, 1),
            stream,
            (
                logical_indices.data_ptr(),
                logical_indices.stride(0),
                logical_indices.stride(1),
                block_table.data_ptr(),
                block_table.stride(0),
                block_table.stride(1),
                token_to_req.data_ptr(),
                token_to_req.stride(0),
                slots.data_ptr(),
                topk,
                slot_columns,
                block_table.shape[1],
                block_table.shape[0],
                num_blocks,
                _offset_bits(page_size),
                counters_ptr,
                num_kv_heads,
            ),
        )
    return slots


def use_fp8_decode_kernel(base_programs: int, cache_dtype: torch.dtype) -> bool:
    """Whether a call with ``base_programs = rows * num_kv_heads`` takes the single-pass kernel.

    Below the crossover the single-pass grid leaves SMs idle and the split-K kernel wins.
    Measured on the H200 (sm_90; tools/bench_qsa.py crossover sweep, Hkv=4, G 8 and 16,
    workspace split-K, CUDA-graph µs), the single pass is at least as fast as the best
    split-K from rows * Hkv = 64-128 at topk 512, from 256 at topk 2048 (e.g. 60 vs 65 µs
    at 256), while at topk 8192 split-K stays 2-5% ahead up to 1024 (681 vs 698 µs). The
    gate sees rows * Hkv only, so it switches at 512: there the single pass wins by 6-17%
    at topk <= 2048 and loses by 3-5% at topk 8192 (round 2 figures). The same rule is
    used on every arch (sm_100 not measured).
    """
    return cache_dtype in FP8_CACHE_DTYPES and base_programs >= DECODE_MIN_PROGRAMS


def _impl(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    softmax_scale: float,
    output_scale: float,
    dispatch: bool,
) -> None:
    if q.shape[0] == 0:
        return
    if not kernels_disabled() and q.device.type == "cuda":
        reason = _kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate)
        if reason is None:
            rows, num_kv_heads = q.shape[0], k_cache.shape[2]
            splits, config = 1, None
            if dispatch and not use_fp8_decode_kernel(rows * num_kv_heads, k_cache.dtype):
                topk, head_dim = logical_indices.shape[1] - 1, q.shape[2]
                device = cuda_device_index(q)
                splits, config = _split_plan(rows, num_kv_heads, topk, head_dim, device)
            try:
                _run_kernels(
                    q,
                    k_cache,
                    v_cache,
                    logical_indices,
                    block_table,
                    token_to_req,
                    out,
                    output_gate,
                    float(softmax_scale),
                    float(output_scale),
                    splits,
                    config,
                )
                return
            except KernelUnavailable as exc:
                reason = str(exc)
        fall_back(OP, reason)
    qsa_decode_torch(
        q,
        k_cache,
        v_cache,
        logical_indices,
        block_table,
        token_to_req,
        out,
        output_gate,
        softmax_scale,
        output_scale,
    )


@torch.library.custom_op("flashinfer_jit::qsa_sparse_paged_decode", mutates_args=("out",))
def _qsa_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    logical_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    out: torch.Tensor,
    output_gate: torch.Tensor,
    softmax_scale: float,
    output_scale: float,
    dispatch: bool,
) -> None:
    _impl(
        q,
        k_cache,
        v_cache,
        logical_indices,
        block_table,
        token_to_req,
        out,
        output_gate,
        softmax_scale,
        output_scale,
        dispatch,
    )


@_qsa_op.register_fake
def _(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    softmax_scale,
    output_scale,
    dispatch,
) -> None:
    return None


def _call(args: tuple, dispatch: bool) -> torch.Tensor:
    _check_args(*args)
    if torch.compiler.is_compiling():
        _qsa_op(*args, dispatch)
    else:  # eager calls skip the custom-op dispatcher's host cost
        _impl(*args, dispatch)
    return args[6]


def qsa_sparse_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    logical_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    out: torch.Tensor,
    output_gate: torch.Tensor,
    softmax_scale: float,
    output_scale: float,
) -> torch.Tensor:
    """Sparse GQA over an e4m3 paged cache, single pass: one CTA per (row, kv head).

    ``q``/``out``/``output_gate`` are [rows, Hq, D] bf16; ``k_cache``/``v_cache`` are
    [num_blocks, page_size, Hkv, D] e4m3 (float8_e4m3fn or uint8 codes) with any strides
    whose last is 1; ``logical_indices`` is [rows, TOPK + 1] int32 whose last column is the
    valid count; ``block_table`` is [num_requests, width] int32; ``token_to_req`` [rows].
    Writes ``out`` and returns it.
    """
    args = (
        q,
        k_cache,
        v_cache,
        logical_indices,
        block_table,
        token_to_req,
        out,
        output_gate,
        softmax_scale,
        output_scale,
    )
    return _call(args, dispatch=False)


def qsa_sparse_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    logical_indices: torch.Tensor,
    block_table: torch.Tensor,
    token_to_req: torch.Tensor,
    out: torch.Tensor,
    output_gate: torch.Tensor,
    softmax_scale: float,
    output_scale: float,
) -> torch.Tensor:
    """``qsa_sparse_paged_decode``'s contract; small batches split the selection across CTAs.

    ``use_fp8_decode_kernel(rows * Hkv, cache dtype)`` picks the single-pass kernel; below
    the crossover the selection is split across CTAs and the last one of each (row, kv
    head) merges the partials.
    """
    args = (
        q,
        k_cache,
        v_cache,
        logical_indices,
        block_table,
        token_to_req,
        out,
        output_gate,
        softmax_scale,
        output_scale,
    )
    return _call(args, dispatch=True)


# -- warm-up and prebuild -----------------------------------------------------------------------
# TOPK (the issue lists a "TOPK tile count" axis) is deliberately not a template parameter:
# the decode loop runs to each row's own valid count and TOPK only sizes the slot buffer,
# so specializing on it would multiply cubins (and warm-up work per selection width)
# without changing a single instruction of the loop.
def _family_specs(group: int, head_dim: int, page_size: int) -> list[tuple]:
    """(family, spec) of every kernel a call with these parameters can launch."""
    config = (group, head_dim, *_decode_config(head_dim))
    out = [
        (_slots_family, _slots_family.spec((page_size,))),
        (_decode_family, _decode_family.spec(config)),
    ]
    if SPLIT_K_CLUSTER:
        for cluster in CLUSTER_SIZES:
            for cap in (CLUSTER_SLOT_CAP, 0):
                spec = _decode_cluster_family.spec((*config, cluster, cap))
                out.append((_decode_cluster_family, spec))
    return out


def _specs_for(group: int, head_dim: int, page_size: int) -> list[KernelSpec]:
    return [spec for _, spec in _family_specs(group, head_dim, page_size)]


def warmup_qsa_fp8_decode(
    kv_cache: torch.Tensor, block_table: torch.Tensor, *, num_query_heads: int, selection_width: int
) -> tuple[tuple, ...]:
    """Compile and load every kernel a serving step over ``kv_cache`` needs.

    ``kv_cache`` is the combined [num_blocks, Hkv, page_size, 2 * D] cache (uint8 codes or
    float8_e4m3fn). Returns one (family, parameters) entry per kernel made ready, or ()
    where the fp8 kernels do not apply (CPU, dtype, arch, shape, or kernels disabled).
    ``selection_width`` (TOPK) needs no specialization of its own: the decode loop bound
    comes from each row's valid count.
    """
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
        raise ValueError(
            "kv_cache must be a 4-D tensor [num_blocks, num_kv_heads, page_size, 2 * head_dim]"
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be a 2-D tensor [num_requests, width]")
    if selection_width < 0:
        raise ValueError(f"selection_width must be >= 0, got {selection_width}")
    _, num_kv_heads, page_size, width = kv_cache.shape
    head_dim = width // 2
    if (
        kernels_disabled()
        or kv_cache.device.type != "cuda"
        or kv_cache.dtype not in FP8_CACHE_DTYPES
        or width % 2
        or head_dim not in HEAD_DIMS
        or num_kv_heads < 1
        or num_query_heads % num_kv_heads
        or not 1 <= num_query_heads // num_kv_heads <= MAX_GROUP
        or torch.cuda.get_device_capability(kv_cache.device) < (8, 9)
    ):
        return ()
    device = cuda_device_index(kv_cache)
    group = num_query_heads // num_kv_heads
    ready = []
    for family, spec in _family_specs(group, head_dim, page_size):
        params = tuple(v for _, v in spec.params)
        family.get(params, device)
        ready.append((spec.family, params))
    return tuple(ready)


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads can reach."""
    specs: set[KernelSpec] = set()
    for entry in workloads["configs"]:
        for head_dim in entry["head_dims"]:
            for group in entry["group_sizes"]:
                for page_size in entry["page_sizes"]:
                    specs.update(_specs_for(int(group), int(head_dim), int(page_size)))
    return sorted(specs, key=str)
