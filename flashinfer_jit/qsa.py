"""QSA fp8 sparse paged decode: a slot pass, a single-pass kernel and cluster split-K.

    out[r, h] = output_scale * softmax(q[r, h] . K_sel * softmax_scale) V_sel * sigmoid(gate[r, h])

over the cache tokens row r selects (see ``qsa_ref.resolve_entries`` for what is
attended). Read top to bottom: the launches (slot pass -> decode; small batches split the
selection over a thread block cluster that merges through distributed shared memory and
resolves its own slots), the dispatch gate, the torch custom op and public functions.
The kernel families, their configs and the split rule live in ``qsa_kernels``, argument
checks and the kernels' applicability in ``qsa_checks``, the launch arguments in
``qsa_launch``, warm-up and prebuild in ``qsa_warmup``; the torch path (``qsa_ref``)
defines the semantics and serves CPU tensors and every call the kernels cannot take.
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling as _is_compiling  # one global, not two lookups

from jit_kernels import (
    KernelUnavailable,
    capability,
    current_stream,
    fall_back,
    kernels_disabled,
    max_active_clusters,
    sm_count,
)
from jit_kernels.args import require_int
from jit_kernels.plan_cache import PlanCache

from ._jit import cuda_device_index
from .qsa_checks import (
    FP8_CACHE_DTYPES,
    check_args,
    kernel_refusal,
    offset_bits,
)
from .qsa_kernels import (
    CHUNK,
    CLUSTER_SIZES,
    CLUSTER_SLOT_CAP,
    DECODE_MIN_PROGRAMS,
    SLOT_ENTRIES,
    SLOT_THREADS,
    WAVE_CONFIG,
    Clusters,
    decode_plan,
    decode_smem_bytes,
    fused_fits,
    gather_choice,
    launch_split,
    slot_plan,
    wave_smem_bytes,
)
from .qsa_launch import DecodeLaunch, SlotPass
from .qsa_ref import qsa_decode_torch

OP = "qsa"
WORKLOADS = "qsa_workloads.json"
# Launch choices, read per call (and part of the replay key); tools/bench_qsa.py --lean
# times each against the others. PDL: launch every kernel as a programmatic dependent
# launch (a kernel's launch and shared-memory setup overlap the previous kernel's tail;
# the engine keeps the launch config, so a call only sets its stream).
# SLOT_ENTRIES_PER_THREAD: slot-pass entries per thread (1, 2, 4 or 8; a thread's loads
# are all in flight at once, so more entries mean fewer threads waiting out the same two
# round trips). Single-pass loop forms: TMMA, groups of <= 8 query heads take the chunk's
# tokens as the MMAs' rows (half the MMAs, exponentials and accumulators: no padding
# heads); LEAN_LOOP, the loop's per-thread invariants stay in registers and the stages
# advance by counters. sm_90a SASS per 16-token chunk (G=8, D=128, bulk): 332 instructions
# before, 260 with both.
# H200, graph µs per call (BENCHMARKS.md, 512 / 2048 / 256 rows): shipped 241.3 / 450.2 /
# 410.7; all four off 248.1 / 484.0 / 422.9; each one off: no PDL 243.3 / 451.8 / 416.0,
# 1 slot entry 245.8 / 454.2 / 416.4, no TMMA - / 473.0 / 416.3, no LEAN 243.1 / 458.1 /
# 414.0. The other forms stay reachable for that comparison and are GPU-tested.
PDL = True
SLOT_ENTRIES_PER_THREAD = 4
TMMA = True
LEAN_LOOP = True


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
    softmax_scale: float,
    output_scale: float,
    num_splits: int = 1,
    fused: bool | None = None,
    **overrides,
) -> None:
    """Launch the kernels. ``num_splits`` 1 is the single pass (after the slot pass); 2..8
    run the splits as one thread block cluster. ``fused`` (clusters only): resolve the slots
    in the decode, no slot pass; None takes it when a split's share fits CLUSTER_SLOT_CAP.
    ``overrides`` (``_decode_launch``'s config, bulk, pdl, slot_entries) replace the shipped
    choices: the benchmark's alternatives."""
    tensors = (q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate)
    launch = _decode_launch(*tensors, num_splits, fused, **overrides)
    if not launch.run(*tensors, softmax_scale, output_scale):
        raise ValueError("q, k_cache, v_cache, out and output_gate must be 16-byte aligned")


def _bulk_ok(k_cache, v_cache, device: int) -> bool:
    """Whether one 256-byte bulk copy can fetch a token's K and V rows: D = 128 and V right
    after K with K's strides (the combined cache split, as the seed's warm-up does), sm_90+."""
    return (
        k_cache.shape[3] == 128
        and v_cache.stride() == k_cache.stride()
        and v_cache.data_ptr() == k_cache.data_ptr() + 128
        and capability(device) >= (9, 0)
    )


def _decode_launch(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    num_splits: int = 1,
    fused: bool | None = None,
    config: tuple[int, int, int] | None = None,
    bulk: bool | None = None,
    pdl: bool | None = None,
    slot_entries: int | None = None,
    tmma: bool | None = None,
    lean: bool | None = None,
    pair: bool | None = None,
) -> DecodeLaunch:
    """What ``_run_kernels`` launches (nothing is launched here): a repeat call replays it.
    ``config`` (warps, stages, min CTAs), ``bulk`` (the gather), ``pair`` (a cluster's two
    chunks a step), ``pdl``, ``slot_entries``
    and the single pass's ``tmma`` and ``lean`` loops override the shipped choices (None:
    the shipped ones, PDL, SLOT_ENTRIES_PER_THREAD, TMMA and LEAN_LOOP as flipped)."""
    rows, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    if not 1 <= num_splits <= CLUSTER_SIZES[-1]:
        raise ValueError(
            f"num_splits must be in [1, {CLUSTER_SIZES[-1]}] (cluster), got {num_splits}"
        )
    if topk == 0:
        num_splits = 1  # nothing to split: the single pass writes the zeros
    cluster = num_splits if num_splits > 1 else 0
    if fused and not (cluster and fused_fits(topk, num_splits)):
        raise ValueError(
            f"fused slots need a cluster whose splits hold <= {CLUSTER_SLOT_CAP} entries each"
        )
    if fused is None:
        fused = bool(cluster) and fused_fits(topk, num_splits)
    entries = SLOT_ENTRIES_PER_THREAD if slot_entries is None else slot_entries
    if entries not in SLOT_ENTRIES:
        raise ValueError(f"slot_entries must be one of {SLOT_ENTRIES}, got {slot_entries}")
    pdl = PDL if pdl is None else bool(pdl)
    device = cuda_device_index(q)
    grid_ctas, bulk_ok = rows * num_kv_heads * num_splits, _bulk_ok(k_cache, v_cache, device)
    bulk, config, pair = gather_choice(
        head_dim, cluster, grid_ctas, sm_count(device), bulk_ok, bulk, config, pair
    )
    tmma = TMMA if tmma is None else bool(tmma)
    lean = LEAN_LOOP if lean is None else bool(lean)
    family, params = decode_plan(
        num_q_heads // num_kv_heads, head_dim, cluster, fused, bulk, config, tmma, lean, pair
    )
    slot_pass = None
    if not fused:
        slot_pass = _slot_pass(
            logical_indices, block_table, token_to_req, k_cache, not cluster, entries, pdl
        )
    return DecodeLaunch(
        family.get(params, device),
        (rows * num_kv_heads, num_splits, 1),
        (32 * config[0], 1, 1),
        decode_smem_bytes(head_dim, config, cluster, CLUSTER_SLOT_CAP * fused, bulk),
        device,
        slot_pass,
        -(-topk // CHUNK) * CHUNK,
        offset_bits(page_size),
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
        head_dim if bulk else 0,
        pdl,
    )  # fmt: skip


def _slot_pass(
    logical_indices, block_table, token_to_req, k_cache, order: bool, entries: int, pdl: bool
) -> SlotPass:
    """The slot pass of this metadata: [rows, TOPK rounded up to a chunk] int32 slots, then
    (``order``) the rows longest first, which the single pass reads."""
    rows, topk = logical_indices.shape[0], logical_indices.shape[1] - 1
    num_blocks, page_size, _, _ = k_cache.shape
    columns = -(-topk // CHUNK) * CHUNK
    device = cuda_device_index(logical_indices)
    kernel = None
    if columns or order:
        family, params = slot_plan(page_size, order, entries)
        kernel = family.get(params, device)
    return SlotPass(
        kernel,
        (rows + order, max(1, -(-columns // (SLOT_THREADS * entries))), 1),
        (SLOT_THREADS, 1, 1),
        columns,
        logical_indices,
        block_table,
        token_to_req,
        num_blocks,
        offset_bits(page_size),
        order,
        pdl,
    )


def _resolve_slots(logical_indices, block_table, token_to_req, k_cache) -> torch.Tensor:
    """The slot pass: [rows, TOPK rounded up to a chunk] int32 packed slots, -1 masked."""
    slot_pass = _slot_pass(
        logical_indices, block_table, token_to_req, k_cache, False, SLOT_ENTRIES_PER_THREAD, False
    )
    ptrs = (logical_indices.data_ptr(), block_table.data_ptr(), token_to_req.data_ptr())
    slots = slot_pass.run(*ptrs, current_stream(cuda_device_index(logical_indices)))
    return slots.view(logical_indices.shape[0], -(-(logical_indices.shape[1] - 1) // CHUNK) * CHUNK)


def wave_clusters(device: int) -> Clusters:
    """Cluster size -> how many clusters of WAVE_CONFIG CTAs ``device`` runs at once (the
    one-wave split rule, qsa_kernels.launch_split); memoized by the engine."""
    threads = 32 * WAVE_CONFIG[0]
    return lambda k: max_active_clusters(device, k, threads, wave_smem_bytes(k))


def dispatch_split(
    rows: int, num_kv_heads: int, topk: int, head_dim: int, cache_dtype: torch.dtype, device: int
) -> tuple[int, tuple[int, int, int] | None, bool | None]:
    """The dispatcher's (splits, config, pair) for a call: 1 split (the single pass) from
    the crossover on, else qsa_kernels.launch_split on this device's SMs and clusters."""
    if use_fp8_decode_kernel(rows * num_kv_heads, cache_dtype):
        return 1, None, None
    sms, clusters = sm_count(device), wave_clusters(device)
    return launch_split(rows, num_kv_heads, topk, head_dim, sms, clusters)


def use_fp8_decode_kernel(base_programs: int, cache_dtype: torch.dtype) -> bool:
    """Whether a call with ``base_programs = rows * num_kv_heads`` takes the single pass.

    Below DECODE_MIN_PROGRAMS the dispatcher splits each (row, kv head)'s selection over a
    thread block cluster of 2-8 CTAs (``qsa_kernels.launch_split``). Measured on the H200 (sm_90,
    tools/bench_qsa.py, CUDA-graph µs, D=128, page 64): 2-CTA clusters beat the single pass
    up to rows * Hkv = 1024 (G=16, Hkv=4: 256 rows, topk 2048: 147 vs 150; topk 8192:
    511 vs 537; 64 rows: 48 vs 50), the two tie at 2048 (512 rows, Hq=64, topk 2048: 278 vs
    278; 256 rows, Hq=32, Hkv=8, topk 4096: 499 vs 500), and the single pass wins at 8192
    (2048 rows, topk 1024: 517 vs 595). The crossover is therefore 2048, where the single
    pass needs no cluster. The same rule is used on every arch (sm_100 not measured).
    """
    require_int("base_programs", base_programs, 0)
    return cache_dtype in FP8_CACHE_DTYPES and base_programs >= DECODE_MIN_PROGRAMS


def _impl(args: tuple, dispatch: bool) -> DecodeLaunch | None:
    """Run one call (``args`` as the public functions take them) on the kernels or torch;
    return the kernels' launch (None: torch served, or nothing to do)."""
    q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate = args[:8]
    if q.shape[0] == 0:
        return None
    if not kernels_disabled() and q.device.type == "cuda":
        reason = kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate)
        if reason is None:
            rows, num_kv_heads, topk = q.shape[0], k_cache.shape[2], logical_indices.shape[1] - 1
            splits, config, pair = 1, None, None
            if dispatch:
                splits, config, pair = dispatch_split(
                    rows, num_kv_heads, topk, q.shape[2], k_cache.dtype, cuda_device_index(q)
                )
            try:
                launch = _decode_launch(*args[:8], splits, config=config, pair=pair)
            except KernelUnavailable as exc:
                reason = str(exc)
            else:
                launch.run(*args)  # aligned: kernel_refusal says so
                return launch
        fall_back(OP, reason)
    qsa_decode_torch(*args)
    return None


# fmt: off
@torch.library.custom_op("flashinfer_jit::qsa_sparse_paged_decode", mutates_args=("out",))
def _qsa_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            logical_indices: torch.Tensor, block_table: torch.Tensor, token_to_req: torch.Tensor,
            out: torch.Tensor, output_gate: torch.Tensor, softmax_scale: float,
            output_scale: float, dispatch: bool) -> None:
    _impl((q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
           softmax_scale, output_scale), dispatch)


@_qsa_op.register_fake
def _(q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
      softmax_scale, output_scale, dispatch) -> None:
    return None
# fmt: on


# Eager calls that repeat an earlier kernel call's metadata replay its launch (only the
# addresses' alignment is checked again): the checks, the dispatch and the launch shapes
# depend on nothing else. The key (jit_kernels.plan_cache) also holds the dispatch flag
# and the launch choices the dispatcher reads per call.
_replays: PlanCache[DecodeLaunch] = PlanCache()


# fmt: off
def _replay_key(scalars, q, k_cache, v_cache, logical_indices, block_table, token_to_req, out,
                output_gate) -> tuple | None:
    """The replay key of a call (jit_kernels.plan_cache); None: not tensors (the checks say
    what)."""
    try:
        return (
            scalars,
            q.shape, q.stride(), q.dtype, q.get_device(),
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(),
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(),
            logical_indices.shape, logical_indices.stride(), logical_indices.dtype,
            logical_indices.get_device(),
            block_table.shape, block_table.stride(), block_table.dtype, block_table.get_device(),
            token_to_req.shape, token_to_req.stride(), token_to_req.dtype,
            token_to_req.get_device(),
            out.shape, out.stride(), out.dtype, out.get_device(),
            output_gate.shape, output_gate.stride(), output_gate.dtype, output_gate.get_device(),
        )
    except (AttributeError, TypeError):
        return None


def _call(q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
          softmax_scale, output_scale, dispatch: bool) -> torch.Tensor:
    args = (q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
            softmax_scale, output_scale)
    if _is_compiling():
        check_args(*args)
        _qsa_op(*args, dispatch)
        return out
    # The replay (jit_kernels.plan_cache): the guard of the last plan, else the key.
    scalars = (
        type(softmax_scale), softmax_scale, type(output_scale), output_scale, dispatch,
        PDL, SLOT_ENTRIES_PER_THREAD, TMMA, LEAN_LOOP,
    )
    tensors = args[:8]
    launch, key = _replays.recall(scalars, tensors), None
    if launch is None:
        key = _replay_key(scalars, *tensors)
        launch = _replays.get(key, tensors)
    if launch is not None and launch.run(*args):
        return out
    if key is None:  # a recalled launch declined these addresses: the full path's replaces it
        key = _replay_key(scalars, *tensors)
    check_args(*args)
    launch = _impl(args, dispatch)  # eager calls skip the custom-op dispatcher's host cost
    if launch is not None and key is not None:
        _replays.put(key, launch, tensors)
    return out
# fmt: on


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
    return _call(
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
        softmax_scale, output_scale, False,
    )  # fmt: skip


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
    the crossover each (row, kv head)'s selection is split over a thread block cluster
    (``qsa_kernels.launch_split``: as many CTAs as keep every cluster resident at once, one
    per SM, where that holds) whose CTAs merge their partials through distributed shared
    memory.
    """
    return _call(
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
        softmax_scale, output_scale, True,
    )  # fmt: skip


# Warm-up and prebuild (they read the launch choices above at call time).
from .qsa_warmup import prebuild_specs, warmup_qsa_fp8_decode  # noqa: E402

__all__ = [
    "prebuild_specs",
    "qsa_sparse_paged_attention",
    "qsa_sparse_paged_decode",
    "use_fp8_decode_kernel",
    "warmup_qsa_fp8_decode",
]
