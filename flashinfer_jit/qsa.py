"""QSA fp8 sparse paged decode: a slot pass, a single-pass kernel and cluster split-K.

    out[r, h] = output_scale * softmax(q[r, h] . K_sel * softmax_scale) V_sel * sigmoid(gate[r, h])

over the cache tokens row r selects (see ``qsa_ref.resolve_entries`` for what is
attended). Read top to bottom: the kernel families and the split rule, the launches (slot
pass -> decode; small batches split the selection over a thread block cluster that merges
through distributed shared memory and resolves its own slots), the dispatch gate, the
torch custom op and public functions, warm-up and prebuild. Argument checks and the
kernels' applicability live in ``qsa_checks``; the torch path (``qsa_ref``) defines the
semantics and serves CPU tensors and every call the kernels cannot take.
"""

from __future__ import annotations

import torch

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    capability,
    current_stream,
    fall_back,
    kernels_disabled,
    sm_count,
)
from jit_kernels.plan_cache import PlanCache

from ._jit import cuda_device_index, kernel_family
from .qsa_checks import (
    FP8_CACHE_DTYPES,
    HEAD_DIMS,
    MAX_GROUP,
    check_args,
    kernel_refusal,
    offset_bits,
)
from .qsa_launch import LOG2E as _LOG2E  # noqa: F401 (qsa_variants reads qsa._LOG2E)
from .qsa_launch import DecodeLaunch, SlotPass
from .qsa_ref import qsa_decode_torch

OP = "qsa"
WORKLOADS = "qsa_workloads.json"
CHUNK = 16  # tokens per warp step (kChunk in templates/qsa_util.cuh)
_SLOT_THREADS = 256  # kSlotThreads in templates/qsa_slots.cuh
_RED_PAD = 4  # kRedPad in templates/qsa_util.cuh

# (num_warps, num_stages, min_ctas) of the decode kernel per head dim. A warp stage holds
# one 16-token chunk of K and V (D * 32 bytes); min_ctas is the launch bound (4 CTAs of 4
# warps moves Q to shared memory to fit 128 registers). D=128: 4 x 52 KB of shared memory,
# 16 warps per SM. (Round 3: several kv heads per CTA were slower at every shape.)
DECODE_CONFIG = {64: (4, 8, 1), 128: (4, 3, 4), 256: (4, 2, 1)}
# The D=128 single pass's (warps, stages, min CTAs, slot lookahead = SLOT_AHEAD in
# templates/qsa_decode.cuh); other head dims run DECODE_CONFIG with lookahead 1. Round 5's
# opt-ins (tools/bench_qsa.py --lean compares them): lookahead 2/3, (4, 4, 3) stages.
SINGLE_PASS_128 = (4, 3, 4, 1)
# Clusters whose whole grid fits one CTA per SM (tiny batches, rows=4) can afford deeper or
# wider CTAs: D=128 (warps, stages, min CTAs) for them, None = DECODE_CONFIG (ships).
# Round-5 opt-in (bench --lean: w8 (8, 3, 1), s6 (4, 6, 1), w8s5 (8, 5, 1)).
ONE_WAVE_CLUSTER_128: tuple[int, int, int] | None = None
# Split-K: the CLUSTER_SIZES splits of a (row, kv head) are one thread block cluster
# merging through distributed shared memory; a split whose share fits CLUSTER_SLOT_CAP
# entries resolves its own slots (no slot pass: one launch a call). Round 3 (H200, G=16
# Hkv=4): cluster split-K beat the workspace split-K (now removed) everywhere, and with 2
# splits it beat the single pass at rows * Hkv = 512 and 1024 too (topk 2048: 101 vs 113
# and 174 vs 194 µs; topk 8192: 331 vs 384 and 583 vs 714). The split count fills about
# _SPLIT_TARGET_CTAS CTAs per 2048 of topk (more work per split amortizes the merge:
# 8192 wanted 4x the CTAs), at least 2, at most 8, each split keeping
# _MIN_CHUNKS_PER_SPLIT chunks. DECODE_MIN_PROGRAMS: rows * Hkv from which one pass runs
# (the measured crossover; see use_fp8_decode_kernel).
CLUSTER_SIZES = (2, 4, 8)
CLUSTER_SLOT_CAP = 1024
DECODE_MIN_PROGRAMS = 2048
_SPLIT_TARGET_CTAS = 256
_MIN_CHUNKS_PER_SPLIT = 8

_slots_family = kernel_family(
    "qsa_slots",
    "qsa_slots.cuh",
    "fij_qsa::qsa_slots",
    ("page_size",),
    ("P", "q", "q", "P", "q", "q", "P", "q", "P", "i", "i", "i", "i", "i", "i"),
)
_DECODE_SIGNATURE = (
    *("P", "q", "q"),  # q
    *("P", "I", "I", "I", "P", "I", "I", "I"),  # k, v caches and their byte strides (32-bit)
    *("P", "i", "P", "q", "i", "i", "i"),  # slots, counts, topk, offset bits, Hkv
    *("P", "q", "q", "P", "q", "q"),  # out, gate
    *("f", "f"),  # scales
    *("P", "q", "P", "q", "q", "i", "i", "P", "q", "i", "i"),  # fused slot resolution's inputs
)
_DECODE_PARAMS = ("group_size", "head_dim", "num_warps", "num_stages", "min_ctas")
_decode_family = kernel_family(
    "qsa_decode",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode",
    (*_DECODE_PARAMS, "slot_ahead"),
    _DECODE_SIGNATURE,
)
_decode_cluster_family = kernel_family(
    "qsa_decode_cluster",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_cluster",
    (*_DECODE_PARAMS, "cluster", "slot_cap"),
    _DECODE_SIGNATURE,
)


def _decode_smem_bytes(
    head_dim: int, num_warps: int, num_stages: int, min_ctas: int, cluster: int, slot_cap: int
) -> int:
    """DecodeSmem<...>::kBytes of templates/qsa_util.cuh."""
    q_in_smem = head_dim > 128 or num_warps * min_ctas >= 16
    q_bytes = (head_dim // 64) * 4 * 32 * 16 if q_in_smem else 0
    stage = num_warps * num_stages * (head_dim // 16) * 32 * 16
    red = num_warps * 16 * (head_dim + _RED_PAD) * 4 + num_warps * 16 * 2 * 4
    part = 16 * (head_dim + 2) * 4 if cluster else 0
    return q_bytes + max(stage + slot_cap * 4, red + part)


def split_count(rows: int, num_kv_heads: int, topk: int) -> int:
    """The dispatcher's splits per (row, kv head): 1 (single pass) or a cluster size."""
    base = max(1, rows * num_kv_heads)
    if base >= DECODE_MIN_PROGRAMS:
        return 1
    target = _SPLIT_TARGET_CTAS * min(4, max(1, topk // 2048))
    want = -(-target // base)
    k = next((c for c in CLUSTER_SIZES if c >= want), CLUSTER_SIZES[-1])
    while k > 1 and -(-topk // CHUNK) < k * _MIN_CHUNKS_PER_SPLIT:
        k //= 2
    return k


def _fused_fits(topk: int, num_splits: int) -> bool:
    """Whether one split's share of the slots fits the in-kernel slot list."""
    chunks = -(-topk // CHUNK)
    per_split = -(-chunks // num_splits) * CHUNK
    return 0 < per_split <= CLUSTER_SLOT_CAP


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
    config: tuple[int, int, int] | None = None,
    slot_ahead: int | None = None,
) -> None:
    """Launch the kernels. ``num_splits`` 1 is the single pass (after the slot pass); 2..8
    run the splits as one thread block cluster. ``fused`` (clusters only): resolve the slots
    in the decode, no slot pass; None takes it when a split's share fits CLUSTER_SLOT_CAP.
    ``config`` (warps, stages, min CTAs) and ``slot_ahead`` (single pass) override the
    shipped DECODE_CONFIG / SINGLE_PASS_SLOT_AHEAD: the benchmark's opt-in variants."""
    tensors = (q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate)
    launch = _decode_launch(*tensors, num_splits, fused, config, slot_ahead)
    if not launch.run(*tensors, softmax_scale, output_scale):
        raise ValueError("q, k_cache, v_cache, out and output_gate must be 16-byte aligned")


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
    slot_ahead: int | None = None,
) -> DecodeLaunch:
    """What ``_run_kernels`` launches (nothing is launched here): a repeat call replays it."""
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
    if fused and not (cluster and _fused_fits(topk, num_splits)):
        raise ValueError(
            f"fused slots need a cluster whose splits hold <= {CLUSTER_SLOT_CAP} entries each"
        )
    if fused is None:
        fused = bool(cluster) and _fused_fits(topk, num_splits)
    slot_cap = CLUSTER_SLOT_CAP if fused else 0
    device = cuda_device_index(q)
    shipped = DECODE_CONFIG[head_dim] if cluster else _single_pass_config(head_dim)[:3]
    one_wave = ONE_WAVE_CLUSTER_128 if head_dim == 128 else None
    if cluster and one_wave and rows * num_kv_heads * num_splits <= sm_count(device):
        shipped = one_wave
    config = shipped if config is None else _checked_config(config, head_dim)
    params = (num_q_heads // num_kv_heads, head_dim, *config)
    ahead = _single_pass_config(head_dim)[3] if slot_ahead is None else slot_ahead
    if not 1 <= ahead <= 4:
        raise ValueError(f"slot_ahead must be in [1, 4], got {slot_ahead}")
    family, params = _decode_family, (*params, ahead)
    if cluster:
        family, params = _decode_cluster_family, (*params[:-1], cluster, slot_cap)
    slot_pass = None if fused else _slot_pass(logical_indices, block_table, token_to_req, k_cache)
    return DecodeLaunch(
        family.get(params, device),
        (rows * num_kv_heads, num_splits, 1),
        (32 * config[0], 1, 1),
        _decode_smem_bytes(head_dim, *config, cluster, slot_cap),
        device,
        slot_pass,
        -(-topk // CHUNK) * CHUNK,
        offset_bits(page_size),
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
    )  # fmt: skip


def _single_pass_config(head_dim: int) -> tuple[int, int, int, int]:
    """The shipped single pass's (warps, stages, min CTAs, slot lookahead)."""
    return SINGLE_PASS_128 if head_dim == 128 else (*DECODE_CONFIG[head_dim], 1)


def _checked_config(config: tuple, head_dim: int) -> tuple[int, int, int]:
    """An opt-in (warps, stages, min CTAs): in the template's ranges and within 227 KB."""
    warps, stages, min_ctas = (int(c) for c in config)
    if warps not in (4, 8) or not 2 <= stages <= 8 or not 1 <= min_ctas <= 8:
        raise ValueError(f"config (warps, stages, min_ctas) out of range: {config}")
    if _decode_smem_bytes(head_dim, warps, stages, min_ctas, 8, CLUSTER_SLOT_CAP) > 227 * 1024:
        raise ValueError(f"config {config} needs more than 227 KB of shared memory")
    return warps, stages, min_ctas


def _slot_pass(logical_indices, block_table, token_to_req, k_cache) -> SlotPass:
    """The slot pass of this metadata: [rows, TOPK rounded up to a chunk] int32 slots."""
    rows, topk = logical_indices.shape[0], logical_indices.shape[1] - 1
    num_blocks, page_size, _, _ = k_cache.shape
    columns = -(-topk // CHUNK) * CHUNK
    device = cuda_device_index(logical_indices)
    kernel = _slots_family.get((page_size,), device) if columns else None
    return SlotPass(
        kernel,
        (rows, -(-columns // _SLOT_THREADS), 1),
        (_SLOT_THREADS, 1, 1),
        columns,
        logical_indices,
        block_table,
        token_to_req,
        num_blocks,
        offset_bits(page_size),
    )


def _resolve_slots(logical_indices, block_table, token_to_req, k_cache) -> torch.Tensor:
    """The slot pass: [rows, TOPK rounded up to a chunk] int32 packed slots, -1 masked."""
    slot_pass = _slot_pass(logical_indices, block_table, token_to_req, k_cache)
    ptrs = (logical_indices.data_ptr(), block_table.data_ptr(), token_to_req.data_ptr())
    return slot_pass.run(*ptrs, current_stream(cuda_device_index(logical_indices)))


def use_fp8_decode_kernel(base_programs: int, cache_dtype: torch.dtype) -> bool:
    """Whether a call with ``base_programs = rows * num_kv_heads`` takes the single pass.

    Below DECODE_MIN_PROGRAMS the dispatcher splits each (row, kv head)'s selection over a
    thread block cluster of 2-8 CTAs (``split_count``). Measured on the H200 (sm_90,
    tools/bench_qsa.py, CUDA-graph µs, D=128, page 64): 2-CTA clusters beat the single pass
    up to rows * Hkv = 1024 (G=16, Hkv=4: 256 rows, topk 2048: 147 vs 150; topk 8192:
    511 vs 537; 64 rows: 48 vs 50), the two tie at 2048 (512 rows, Hq=64, topk 2048: 278 vs
    278; 256 rows, Hq=32, Hkv=8, topk 4096: 499 vs 500), and the single pass wins at 8192
    (2048 rows, topk 1024: 517 vs 595). The crossover is therefore 2048, where the single
    pass needs no cluster. The same rule is used on every arch (sm_100 not measured).
    """
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
            splits = 1
            if dispatch and not use_fp8_decode_kernel(rows * num_kv_heads, k_cache.dtype):
                splits = split_count(rows, num_kv_heads, topk)
            try:
                launch = _decode_launch(*args[:8], splits)
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
# and the opt-in flips the dispatcher reads per call.
_replays: PlanCache[DecodeLaunch] = PlanCache()


# fmt: off
def _call(q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
          softmax_scale, output_scale, dispatch: bool) -> torch.Tensor:
    args = (q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
            softmax_scale, output_scale)
    if torch.compiler.is_compiling():
        check_args(*args)
        _qsa_op(*args, dispatch)
        return out
    try:
        key = (
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
            type(softmax_scale), softmax_scale, type(output_scale), output_scale, dispatch,
            SINGLE_PASS_128, ONE_WAVE_CLUSTER_128,
        )
        launch = _replays.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
        key = launch = None
    if launch is not None and launch.run(*args):
        return out
    check_args(*args)
    launch = _impl(args, dispatch)  # eager calls skip the custom-op dispatcher's host cost
    if launch is not None and key is not None:
        _replays.put(key, launch)
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
    (``split_count``) whose CTAs merge their partials through distributed shared memory.
    """
    return _call(
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate,
        softmax_scale, output_scale, True,
    )  # fmt: skip


# -- warm-up and prebuild -----------------------------------------------------------------------
# TOPK (the issue lists a "TOPK tile count" axis) is not a template parameter: the decode
# loop runs to each row's own valid count. It only decides whether a cluster's splits can
# resolve their own slots (slot_cap), so warm-up (which knows the selection width) compiles
# just the variants that width reaches, and prebuild (which does not) both.
def _family_specs(group: int, head_dim: int, page_size: int, topk: int | None = None) -> list:
    """(family, spec) of every kernel a call with these parameters can launch."""
    config = (group, head_dim, *DECODE_CONFIG[head_dim])
    out = [
        (_slots_family, _slots_family.spec((page_size,))),
        (_decode_family, _decode_family.spec((group, head_dim, *_single_pass_config(head_dim)))),
    ]
    configs = [config]
    if head_dim == 128 and ONE_WAVE_CLUSTER_128:
        configs.append((group, head_dim, *ONE_WAVE_CLUSTER_128))
    for cfg in configs:
        for cluster in CLUSTER_SIZES:
            fits = (_fused_fits(topk, cluster),) if topk is not None else (True, False)
            for fused in fits:
                spec = _decode_cluster_family.spec((*cfg, cluster, CLUSTER_SLOT_CAP * fused))
                out.append((_decode_cluster_family, spec))
    return out


def _specs_for(group: int, head_dim: int, page_size: int) -> list[KernelSpec]:
    return [spec for _, spec in _family_specs(group, head_dim, page_size)]


def warmup_qsa_fp8_decode(
    kv_cache: torch.Tensor, block_table: torch.Tensor, *, num_query_heads: int, selection_width: int
) -> tuple[tuple, ...]:
    """Compile and load every kernel a serving step over ``kv_cache`` needs.

    ``kv_cache`` is the combined [num_blocks, Hkv, page_size, 2 * D] cache (uint8 codes or
    float8_e4m3fn). Returns one (family, parameters) entry per kernel made ready: the slot
    pass, the single pass and the cluster split-K kernels of every cluster size (the batch
    size picks among them), or () where the fp8 kernels do not apply (CPU, dtype, arch,
    shape, or kernels disabled). ``selection_width`` (TOPK) picks the clusters' slot mode.
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
        or capability(cuda_device_index(kv_cache)) < (8, 9)
    ):
        return ()
    device = cuda_device_index(kv_cache)
    group = num_query_heads // num_kv_heads
    ready = []
    for family, spec in _family_specs(group, head_dim, page_size, selection_width):
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
