"""The QSA decode's launch plan: which kernels a checked call takes (slot pass -> single
pass; small batches a cluster split-K that merges through distributed shared memory and
may resolve its own slots) and their launch shapes, as a ``DecodeLaunch`` that a repeat
call replays. The kernel families, configs and split rule are ``kernels``'s."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from jit_kernels import capability, current_stream, max_active_clusters, prepare, sm_count
from jit_kernels.args import require_int

from .._jit import cuda_device_index
from ..contract import Options
from .checks import FP8_CACHE_DTYPES, offset_bits
from .kernels import (
    CHUNK,
    CLUSTER_SIZES,
    CLUSTER_SLOT_CAP,
    DECODE_MIN_PROGRAMS,
    SLOT_ENTRIES,
    SLOT_THREADS,
    WAVE_CONFIG,
    Clusters,
    Plan,
    decode_min_programs,
    decode_plan,
    decode_smem_bytes,
    fused_fits,
    gather_choice,
    launch_split,
    slot_plan,
    wave_smem_bytes,
)
from .launch import DecodeLaunch, SlotPass
from .short import (
    SHORT_DEFAULT,
    ShortCall,
    checked_short_config,
    short_choice,
    short_config,
    short_plan,
)


@dataclasses.dataclass(frozen=True)
class QsaOptions(Options):
    """The QSA launch choices; tools/bench_qsa.py --lean times each against the others.

    ``pdl``: every kernel a programmatic dependent launch (its launch and shared-memory
    setup overlap the previous kernel's tail). ``slot_entries``: slot-pass entries per
    thread (1, 2, 4 or 8; a thread's loads are all in flight at once, so more entries mean
    fewer threads waiting out the same two round trips). The single pass's loop forms:
    ``tmma``, groups of <= 8 query heads take the chunk's tokens as the MMAs' rows (half the
    MMAs, exponentials and accumulators: no padding heads); ``lean``, the loop's per-thread
    invariants stay in registers and the stages advance by counters. sm_90a SASS per
    16-token chunk (G=8, D=128, bulk): 332 instructions before, 260 with both.
    H200, graph µs per call (BENCHMARKS.md, 512 / 2048 / 256 rows): shipped 241.3 / 450.2 /
    410.7; all four off 248.1 / 484.0 / 422.9; each one off: no PDL 243.3 / 451.8 / 416.0,
    1 slot entry 245.8 / 454.2 / 416.4, no TMMA - / 473.0 / 416.3, no LEAN 243.1 / 458.1 /
    414.0. The other forms stay reachable for that comparison and are GPU-tested.
    ``short``: the short single pass (``short.py``, short.short_config in the slot pass's row
    order): None where ``short.takes_short`` says (sm_90, many rows, short selections);
    False never; True every call it serves (head_dim 64 or 128, topk > 0; a call at another
    head dim raises ValueError).
    """

    pdl: bool = True
    slot_entries: int = 4
    tmma: bool = True
    lean: bool = True
    short: bool | None = None

    def __post_init__(self) -> None:
        if self.slot_entries not in SLOT_ENTRIES:
            raise ValueError(f"slot_entries must be one of {SLOT_ENTRIES}, got {self.slot_entries}")
        if self.short is not None and not isinstance(self.short, bool):
            raise TypeError(f"short must be None, True or False, got {self.short!r}")


def bulk_ok(k_cache, v_cache, device: int) -> bool:
    """Whether one 256-byte bulk copy can fetch a token's K and V rows: D = 128 and V right
    after K with K's strides (the combined cache split, as the seed's warm-up does), sm_90+."""
    return (
        k_cache.shape[3] == 128
        and v_cache.stride() == k_cache.stride()
        and v_cache.data_ptr() == k_cache.data_ptr() + 128
        and capability(device) >= (9, 0)
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """A launch's forced shape (tools, tests): ``num_splits`` 1 is the single pass (after
    the slot pass), 2..8 a thread block cluster; ``fused`` (clusters only) resolves the
    slots in the decode (None: where a split's share fits CLUSTER_SLOT_CAP); ``config``
    (warps, stages, min CTAs), ``bulk`` (the gather) and ``pair`` (two chunks a step)
    replace the shipped rule where not None. ``short``: the single pass as qsa_decode_short
    (``short.py``; ``config`` from its ranges, default SHORT_DEFAULT), its rows in the slot
    pass's order or (``order`` False) in index order. ``order`` True on a cluster: after the
    slot pass, the clusters take the rows longest first (None: the single passes read the
    order, clusters do not)."""

    num_splits: int = 1
    fused: bool | None = None
    config: tuple[int, int, int] | None = None
    bulk: bool | None = None
    pair: bool | None = None
    short: bool = False
    order: bool | None = None


def _splits(topk: int, variant: Variant) -> tuple[int, int, bool]:
    """(splits, cluster size or 0, fused) of a variant, checked."""
    num_splits, fused = variant.num_splits, variant.fused
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
    if fused is None:  # (the row order comes with the slot pass)
        fused = bool(cluster) and fused_fits(topk, num_splits) and not variant.order
    return num_splits, cluster, fused


class Choice(NamedTuple):
    """What a call of a geometry launches (launch_choice): the decode's kernel and shape,
    and the slot pass's kernel (None where the decode resolves its own slots, or where the
    slot pass launches nothing)."""

    num_splits: int  # CTAs a (row, kv head): 1 the single pass, else a cluster of that many
    fused: bool  # the cluster resolves its own slots (no slot pass)
    kernel: Plan  # the decode's (family, params)
    bulk: bool  # one bulk copy per token's K and V rows
    config: tuple[int, int, int]  # (warps, stages, min CTAs)
    order: bool  # the decode reads the slot pass's row order (the single passes')
    slots: Plan | None  # the slot pass's (family, params)

    @property
    def cluster(self) -> int:
        """The cluster size (the kernels' CLUSTER): num_splits, 0 for the single pass."""
        return self.num_splits if self.num_splits > 1 else 0

    def plans(self) -> list[Plan]:
        """The kernels the call launches, the decode's first (compiled at once)."""
        return [self.kernel] + ([self.slots] if self.slots else [])


def launch_choice(
    variant: Variant,
    options: QsaOptions,
    group: int,
    head_dim: int,
    topk: int,
    page_size: int,
    pairs: int,
    sms: int,
    can_bulk: bool,
) -> Choice:
    """The kernels and shapes a call launches for ``variant`` (no device needed): ``pairs``
    = rows x Hkv, ``sms`` the device's SMs, ``can_bulk`` bulk_ok's answer. decode_launch
    launches exactly this; the benchmark tools plan their variants through it."""
    num_splits, cluster, fused = _splits(topk, variant)
    shape = (group, head_dim, cluster, fused, pairs * num_splits, sms)
    family, params, bulk, config, order = _kernel_choice(variant, options, *shape, can_bulk)
    slots = None if fused else slot_kernel(topk, page_size, order, options)
    return Choice(num_splits, fused, (family, params), bulk, config, order, slots)


def decode_launch(
    args: tuple, options: QsaOptions, variant: Variant, bulk: bool | None = None
) -> DecodeLaunch:
    """What a call launches (nothing is launched here); a repeat call replays it. ``bulk``:
    bulk_ok's answer where the caller has it (None: asked here)."""
    q, k_cache, v_cache, logical_indices, block_table, token_to_req = args[:6]
    rows, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    device = cuda_device_index(q)
    choice = launch_choice(
        variant, options, num_q_heads // num_kv_heads, head_dim, topk, page_size,
        rows * num_kv_heads, sm_count(device),
        bulk_ok(k_cache, v_cache, device) if bulk is None else bulk,
    )  # fmt: skip
    prepare(choice.plans(), device)  # compiled at once
    slot_pass = None
    if not choice.fused:
        slot_pass = make_slot_pass(
            logical_indices, block_table, token_to_req, k_cache, choice.order, options
        )
    family, params = choice.kernel
    return DecodeLaunch(
        family.get(params, device),
        (rows * num_kv_heads, choice.num_splits, 1),
        (32 * choice.config[0], 1, 1),
        decode_smem_bytes(
            head_dim, choice.config, choice.cluster, CLUSTER_SLOT_CAP * choice.fused, choice.bulk
        ),
        device,
        slot_pass,
        -(-topk // CHUNK) * CHUNK,
        offset_bits(page_size),
        args[:8],
        head_dim if choice.bulk else 0,
        options.pdl,
    )


def _kernel_choice(
    variant: Variant,
    options: QsaOptions,
    group: int,
    head_dim: int,
    cluster: int,
    fused: bool,
    grid_ctas: int,
    sms: int,
    can_bulk: bool,
) -> tuple:
    """(family, params, bulk, config, order) of a launch: ``order`` whether the decode reads
    the slot pass's row order (variant.order; None: the single passes do, clusters do not)."""
    order = not cluster if variant.order is None else variant.order
    if not (order or variant.short or cluster):
        raise ValueError("order=False applies to the short single pass (short=True) only")
    if order and fused:
        raise ValueError("order=True: the row order comes with the slot pass (fused=False)")
    if variant.short:
        if cluster or variant.pair:
            raise ValueError("the short single pass takes one split and one chunk a step")
        bulk = gather_choice(head_dim, 0, grid_ctas, sms, can_bulk, variant.bulk)[0]
        config = checked_short_config(variant.config or SHORT_DEFAULT, head_dim, bulk)
        family, params = short_plan(group, head_dim, bulk, config, options.tmma, order)
        return family, params, bulk, config, order
    bulk, config, pair = gather_choice(
        head_dim, cluster, grid_ctas, sms, can_bulk, variant.bulk, variant.config, variant.pair
    )
    family, params = decode_plan(
        group, head_dim, cluster, fused, bulk, config, options.tmma, options.lean, pair, order
    )
    return family, params, bulk, config, order


def slot_kernel(topk: int, page_size: int, order: bool, options: QsaOptions) -> Plan | None:
    """The slot pass's kernel, None where it launches nothing (no columns, no order)."""
    columns = -(-topk // CHUNK) * CHUNK
    return slot_plan(page_size, order, options.slot_entries) if columns or order else None


def make_slot_pass(
    logical_indices, block_table, token_to_req, k_cache, order: bool, options: QsaOptions
) -> SlotPass:
    """The slot pass of this metadata: [rows, TOPK rounded up to a chunk] int32 slots, then
    (``order``) the rows longest first, which the single pass reads."""
    rows, topk = logical_indices.shape[0], logical_indices.shape[1] - 1
    num_blocks, page_size, _, _ = k_cache.shape
    columns = -(-topk // CHUNK) * CHUNK
    entries = options.slot_entries
    kernel, plan = None, slot_kernel(topk, page_size, order, options)
    if plan is not None:
        family, params = plan
        kernel = family.get(params, cuda_device_index(logical_indices))
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
        options.pdl,
    )


def resolve_slots(logical_indices, block_table, token_to_req, k_cache) -> torch.Tensor:
    """The slot pass alone (tools): [rows, TOPK rounded up to a chunk] int32 packed slots,
    -1 masked."""
    options = QsaOptions(pdl=False)
    slot_pass = make_slot_pass(logical_indices, block_table, token_to_req, k_cache, False, options)
    ptrs = (logical_indices.data_ptr(), block_table.data_ptr(), token_to_req.data_ptr())
    slots = slot_pass.run(*ptrs, current_stream(cuda_device_index(logical_indices)))
    return slots.view(logical_indices.shape[0], -(-(logical_indices.shape[1] - 1) // CHUNK) * CHUNK)


def wave_clusters(device: int) -> Clusters:
    """Cluster size -> how many clusters of WAVE_CONFIG CTAs ``device`` runs at once (the
    one-wave split rule, kernels.launch_split); memoized by the engine."""
    threads = 32 * WAVE_CONFIG[0]
    return lambda k: max_active_clusters(device, k, threads, wave_smem_bytes(k))


def use_fp8_decode_kernel(
    base_programs: int,
    cache_dtype: torch.dtype,
    device: int | None = None,
    topk: int = 0,
    head_dim: int = 0,
) -> bool:
    """Whether a call with ``base_programs = rows * num_kv_heads`` takes the single pass on
    ``device`` (None: the current CUDA device; without CUDA, the crossover of other archs),
    for selections of ``topk`` tokens at ``head_dim`` (0, the seed's signature: the size
    crossover alone).

    Below the crossover (kernels.decode_min_programs: on sm_90 512, or 832 from topk 4096
    and at head_dim 128 from topk 2048, measured on the H200; the seed's 2048 elsewhere) the
    dispatcher splits each (row, kv head)'s selection over a thread block cluster of 2-8
    CTAs (``kernels.launch_split``)."""
    require_int("base_programs", base_programs, 0)
    require_int("topk", topk, 0)
    require_int("head_dim", head_dim, 0)
    if not isinstance(cache_dtype, torch.dtype):
        raise TypeError(f"cache_dtype must be a torch.dtype, got {type(cache_dtype).__name__}")
    if device is None and torch.cuda.is_available():
        device = torch.cuda.current_device()
    if device is None:
        return _single_pass(base_programs, cache_dtype, DECODE_MIN_PROGRAMS)
    least = decode_min_programs(capability(device), topk, head_dim)
    return _single_pass(base_programs, cache_dtype, least)


def _single_pass(base_programs: int, cache_dtype: torch.dtype, least: int) -> bool:
    return cache_dtype in FP8_CACHE_DTYPES and base_programs >= least


def short_variant(call: ShortCall) -> Variant:
    """The short single pass as the dispatcher launches it for ``call`` (short.short_config,
    rows in the slot pass's order)."""
    return Variant(
        config=short_config(call.bulk, call.topk, call.pairs, call.sms), short=True, order=True
    )


def dispatch_split(
    rows: int,
    num_kv_heads: int,
    topk: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    device: int,
    short: bool | None = None,
    *,
    group: int,
    bulk: bool,
) -> Variant:
    """The dispatcher's variant for a call: 1 split (the single pass) from the device's
    crossover on, else kernels.launch_split on this device's SMs and clusters; the short
    single pass in place of either where ``short`` (QsaOptions.short) and
    short.short_choice say (``group``: query heads a kv head; ``bulk``: bulk_ok's answer)."""
    cap = capability(device)
    least = decode_min_programs(cap, topk, head_dim)
    single = _single_pass(rows * num_kv_heads, cache_dtype, least)
    call = _short_call(rows, num_kv_heads, topk, head_dim, device, group, bulk)
    if short_choice(short, call, single):
        return short_variant(call)
    if single:
        return Variant()
    sms, clusters = call.sms, wave_clusters(device)
    split = launch_split(rows, num_kv_heads, topk, head_dim, sms, clusters, least, cap)
    return Variant(split.splits, None, split.config, None, split.pair, order=split.order or None)


def single_pass_variant(
    rows: int,
    num_kv_heads: int,
    topk: int,
    head_dim: int,
    device: int,
    short: bool | None = None,
    *,
    group: int,
    bulk: bool,
) -> Variant:
    """The single-pass entry point's variant: the single pass, or the short single pass
    where ``short`` (QsaOptions.short) and short.short_choice say."""
    call = _short_call(rows, num_kv_heads, topk, head_dim, device, group, bulk)
    return short_variant(call) if short_choice(short, call, True) else Variant()


def _short_call(rows: int, num_kv_heads: int, topk: int, head_dim: int, device: int, group: int,
                bulk: bool) -> ShortCall:  # fmt: skip
    cap, sms = capability(device), sm_count(device)
    return ShortCall(cap, head_dim, group, topk, rows * num_kv_heads, sms, bulk)
