"""Warm-up and prebuild of the QSA decode: which kernels a serving step or a shipped
workload reaches, from the same helpers the dispatcher uses (``kernels``, ``plan``), with
the same options (``QsaOptions``), so both make ready what the dispatcher launches.
"""

from __future__ import annotations

import torch

from jit_kernels import (
    MIN_CAPABILITY,
    KernelSpec,
    capability,
    kernels_disabled,
    prepare,
    sm_count,
)
from jit_kernels.args import require_int

from .._jit import cuda_device_index
from .checks import FP8_CACHE_DTYPES, HEAD_DIMS, MAX_GROUP
from .kernels import (
    CLUSTER_MAX,
    CLUSTER_PAIR_CONFIG,
    CLUSTER_SIZES,
    DECODE_MIN_PROGRAMS,
    MAX_SMS,
    WAVE_CONFIG,
    WAVE_SLOT_PASS_SPLITS,
    Clusters,
    Plan,
    decode_min_programs,
    decode_plan,
    default_config,
    fused_fits,
    gather_choice,
    launch_split,
    pairs_apply,
    slot_plan,
    table_pairs_unfused,
    takes_bulk,
)
from .plan import QsaOptions, bulk_ok, wave_clusters
from .short import SHORT_HEAD_DIMS, ShortCall, short_configs, short_plan, short_reached


# TOPK (the issue lists a "TOPK tile count" axis) is not a template parameter: the decode
# loop runs to each row's own valid count. It decides the split counts and whether a
# cluster's splits can resolve their own slots, so warm-up (which knows the selection width
# and the device) compiles exactly what the dispatcher reaches, and prebuild (which knows
# neither) every variant.
def warmup_qsa_fp8_decode(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    *,
    num_query_heads: int,
    selection_width: int,
    options: QsaOptions = QsaOptions(),  # noqa: B008 (frozen: one shared default is safe)
) -> tuple[tuple, ...]:
    """Compile and load every kernel a serving step over ``kv_cache`` needs.

    ``kv_cache`` is the combined [num_blocks, Hkv, page_size, 2 * D] cache (uint8 codes or
    float8_e4m3fn). Returns one (family, parameters) entry per kernel made ready: the slot
    pass, the single pass, the short single pass and the cluster split-K kernels that calls
    of any row count reach (split over ``kv_cache.transpose(1, 2).split(D, -1)``), or ()
    where the fp8 kernels do not apply (CPU, dtype, arch, shape, or kernels disabled). ``selection_width`` is TOPK;
    ``options`` the launch choices the calls will take.
    """
    _check_args(kv_cache, block_table, num_query_heads, selection_width)
    _, num_kv_heads, page_size, width = kv_cache.shape
    head_dim = width // 2
    if (
        kernels_disabled()
        or kv_cache.device.type != "cuda"
        or kv_cache.dtype not in FP8_CACHE_DTYPES
        or width % 2
        or head_dim not in HEAD_DIMS
        or num_query_heads // num_kv_heads > MAX_GROUP
        or capability(cuda_device_index(kv_cache)) < MIN_CAPABILITY
    ):
        return ()
    cap = capability(device := cuda_device_index(kv_cache))
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    group, bulk = num_query_heads // num_kv_heads, bulk_ok(k_cache, v_cache, device)
    geometry = (group, head_dim, page_size, num_kv_heads)
    plans = dispatch_plans(
        *geometry,
        selection_width,
        bulk,
        sm_count(device),
        options.slot_entries,
        wave_clusters(device),
        options.tmma,
        options.lean,
        decode_min_programs(cap, selection_width, head_dim),
        short_reached(options.short, ShortCall(cap, head_dim, group, selection_width, 0, 0, bulk)),
        cap=cap,
    )
    prepare(plans, device)  # compiled at once, then loaded one by one
    for family, params in plans:
        family.get(params, device)
    return tuple((family.family, params) for family, params in plans)


def _check_args(kv_cache, block_table, num_query_heads: int, selection_width: int) -> None:
    """What a call over this cache would be refused for (the geometry's, not the values')."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
        raise ValueError(
            "kv_cache must be a 4-D tensor [num_blocks, num_kv_heads, page_size, 2 * head_dim]"
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be a 2-D tensor [num_requests, width]")
    require_int("selection_width", selection_width, 0)
    require_int("num_query_heads", num_query_heads, 1)
    num_kv_heads = kv_cache.shape[1]
    if num_kv_heads < 1 or num_query_heads % num_kv_heads:
        raise ValueError(
            f"num_query_heads ({num_query_heads}) must be a multiple of kv_cache's "
            f"num_kv_heads ({num_kv_heads})"
        )


def prebuild_specs(workloads: dict, options: QsaOptions) -> list[KernelSpec]:
    """Every specialization the shipped workloads can reach with ``options``."""
    specs: set[KernelSpec] = set()
    # the short single pass unless never taken (Qsa.prebuilt_on: on the archs that take it)
    forms = (options.slot_entries, options.tmma, options.lean, options.short is not False)
    for entry in workloads["configs"]:
        for head_dim in entry["head_dims"]:
            for group in entry["group_sizes"]:
                for page_size in entry["page_sizes"]:
                    specs.update(all_specs(int(group), int(head_dim), int(page_size), *forms))
    return sorted(specs, key=str)


def dispatch_plans(
    group: int,
    head_dim: int,
    page_size: int,
    num_kv_heads: int,
    topk: int,
    bulk_ok: bool,
    sms: int,
    entries: int,
    clusters: Clusters,
    tmma: bool = False,
    lean: bool = False,
    min_programs: int = DECODE_MIN_PROGRAMS,
    short: bool = False,
    *,
    cap: tuple[int, int] | None = None,
) -> list[Plan]:
    """Every kernel the dispatcher and the single-pass function launch for calls of this
    geometry, whatever their row count: the single pass (its loop form as ``tmma`` and
    ``lean`` flip it) with its ordered slot pass, the short single pass where ``short``
    (short.short_reached), and the cluster split-K of each row count below the crossover
    ``min_programs`` / Hkv (``clusters``: the device's, see launch_split), in the slot pass's
    row order where ordered_split says so on a device of ``cap``."""
    single = default_config(head_dim, 0, bulk_ok)
    plans = [slot_plan(page_size, True, entries)]
    plans.append(decode_plan(group, head_dim, 0, False, bulk_ok, single, tmma, lean))
    if short:  # takes bulk copies wherever the single pass does (gather_choice)
        for config in short_configs(bulk_ok, topk):  # what short.short_config may pick
            plans.append(short_plan(group, head_dim, bulk_ok, config, tmma, True))
    if not topk:
        return plans  # nothing to split: the single pass serves every row count
    for rows in range(1, -(-min_programs // num_kv_heads)):
        splits, config, pair, order = launch_split(
            rows, num_kv_heads, topk, head_dim, sms, clusters, min_programs, cap
        )
        if splits == 1:
            continue
        pairs = rows * num_kv_heads
        fused = fused_fits(topk, splits) and not order
        bulk, config, pair = gather_choice(
            head_dim, splits, pairs * splits, sms, bulk_ok, None, config, pair
        )
        if not fused:
            plans.append(slot_plan(page_size, order, entries))
        plans.append(
            decode_plan(group, head_dim, splits, fused, bulk, config, pair=pair, order=order)
        )
    return list(dict.fromkeys(plans))


def all_specs(
    group: int,
    head_dim: int,
    page_size: int,
    entries: int,
    tmma: bool = False,
    lean: bool = False,
    short: bool = False,
) -> list[KernelSpec]:
    """Every specialization the dispatcher can launch for this geometry on any cache, row
    count and TOPK on devices of up to MAX_SMS SMs (prebuild), the single pass in the loop
    form ``tmma``/``lean`` pick, and (``short``) the short single pass it may take."""
    bulks = (False, True) if head_dim == 128 else (False,)
    plans = [slot_plan(page_size, order, entries) for order in (True, False)]
    for bulk in bulks:
        single = default_config(head_dim, 0, bulk)
        plans.append(decode_plan(group, head_dim, 0, False, bulk, single, tmma, lean))
        if short and head_dim in SHORT_HEAD_DIMS:
            for config in short_configs(bulk):
                plans.append(short_plan(group, head_dim, bulk, config, tmma, True))
        for cluster in CLUSTER_SIZES:
            # takes_bulk gives bulk copies to 2-CTA clusters only (over two waves of CTAs)
            if bulk and not takes_bulk(True, cluster, grid_ctas=3, sms=1):
                continue
            config = default_config(head_dim, cluster, bulk)
            if head_dim == 128 and cluster == 2:  # the 2-split in row order (ordered_split)
                plans.append(decode_plan(group, head_dim, 2, False, bulk, config, order=True))
            for fused in (True, False):
                plans.append(decode_plan(group, head_dim, cluster, fused, bulk, config))
                # small grids take it; 2 or 4 CTAs without slots, only past MAX_SMS SMs
                reach = fused or table_pairs_unfused(cluster, MAX_SMS)
                if reach and pairs_apply(head_dim, cluster, bulk):
                    pairs = (cluster, fused, False, CLUSTER_PAIR_CONFIG)
                    plans.append(decode_plan(group, head_dim, *pairs, pair=True))
    # The one-wave splits (launch_split): any cluster size, as the device's GPCs decide;
    # the smallest also after the slot pass (past CLUSTER_SLOT_CAP slots a split).
    for cluster in range(2, CLUSTER_MAX + 1) if pairs_apply(head_dim, 2, False) else ():
        for config in (CLUSTER_PAIR_CONFIG, WAVE_CONFIG):
            plans.append(decode_plan(group, head_dim, cluster, True, False, config, pair=True))
        if cluster <= WAVE_SLOT_PASS_SPLITS:
            plans.append(
                decode_plan(group, head_dim, cluster, False, False, WAVE_CONFIG, pair=True)
            )
    return [family.spec(params) for family, params in list(dict.fromkeys(plans))]
