"""The QSA decode's kernels: families, launch configs, split rule, specs.

``plan.decode_launch`` picks a call's kernels with these helpers, and warm-up and prebuild
enumerate their specializations with the same helpers, so the three cannot drift apart.

The gathers and split-K forms come from one H200 sweep of variants (CUDA-graph µs per
call, whole call; D=128, page 64, the issue's inputs; rows/Hq/Hkv/topk; the single pass's
later loop forms, slot entries and PDL: QsaOptions in plan.py and BENCHMARKS.md):

    single pass                        512/64/4/2048   2048/32/4/1024
      cp.async gathers (before)            274.4           513.1
      256-byte bulk copies                 252.2           479.5
      + row order, early prologue, gate    242.8           478.0   <- shipped (round 3)
      + split QK chains                    242.0           476.2   (+12 registers, 127: no)
      128-byte bulk copies (K, V apart)    321.7           613.6   (cp.async stays for those)
    cluster split-K                     64/64/4/2048    4/64/4/2048
      before                                47.7            14.7
      interleaved splits + gate             47.5            13.7   <- shipped where bulk did not
      + bulk copies, 2 stages               43.5            14.3   <- shipped on multi-wave grids

Bulk copies fetch a token's K and V rows (256 bytes) at once, so they need D = 128 and V
right after K in memory with K's strides: the combined [blocks, Hkv, page, 2D] cache split
as the seed's warm-up does. Other caches and head dims keep the cp.async gathers.

Rounds 4-5 (docs/perf-log/qsa.md, "The split rule's sweeps") re-swept the clusters: fewer
splits (split_count's table), two cp.async stages, bulk copies only for 2-CTA clusters over
more than two waves of one CTA per SM; then wave_split, as many splits as keep every cluster
resident at once with one CTA per SM (WAVE_CONFIG; a cluster stays within a GPC, so the H200
runs 66/39/30/22/17/15/15 clusters of 2..8), CLUSTER_PAIR_CONFIG at most half a wave. Where
a split's slots do not fit the in-kernel list, a wave split of at most
WAVE_SLOT_PASS_SPLITS CTAs runs after the slot pass; larger ones keep the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from jit_kernels import (
    F32,
    I32,
    I64,
    PTR,
    U32,
    KernelFamily,
    KernelSpec,
    arch_capability,
    shipped_smem_per_block,
)

from .._jit import SM107A_TAKES_SM100A, kernel_family

CHUNK = 16  # tokens per warp step (kChunk in templates/qsa/util.cuh)
SLOT_THREADS = 256  # kSlotThreads in templates/qsa/sm89_slot_pass.cuh
SLOT_ENTRIES = (1, 2, 4, 8)  # slot-pass entries per thread the template allows
_RED_PAD = 4  # kRedPad in templates/qsa/util.cuh
_BULK_STAGE_BYTES = 4224  # kBulkStageBytes in templates/qsa/bulk.cuh
SMEM_LIMIT = shipped_smem_per_block()  # what one CTA may use on every shipped arch

# (num_warps, num_stages, min_ctas) of the cp.async single pass per head dim. A warp stage holds
# one 16-token chunk of K and V (D * 32 bytes); min_ctas is the launch bound (4 CTAs of 4
# warps moves Q to shared memory to fit 128 registers). D=128: 4 x 52 KB of shared memory,
# 16 warps per SM. (Round 3: several kv heads per CTA were slower at every shape.)
DECODE_CONFIG = {64: (4, 8, 1), 128: (4, 3, 4), 256: (4, 2, 1)}
# The bulk-copy decode (D=128): 4 CTAs of 4 warps per SM, 2 stages a warp, single pass and
# clusters alike; cp.async clusters at D=128 too (round 4), other head dims the single pass's.
# The single pass had 3 stages until session 27 (H200, graph µs: topk 256-512 at 512-1536
# pairs 3-8 % faster with 2, 512/16/1/256 21.9 -> 20.7; topk 1024-4096 at 512-8192 pairs
# 0.6 % slower to 1.8 % faster, 256/32/8/4096 399.4 -> 401.8; docs/perf-log/qsa.md round 17).
BULK_SINGLE_PASS = (4, 2, 4)
BULK_CLUSTER = (4, 2, 4)
CLUSTER_CONFIG = {128: (4, 2, 4)}
# A cp.async cluster grid of half a wave or less (one CTA per SM) steps its warps two chunks
# at a time (PAIR, templates/qsa/rows.cuh): its 6 stages hold 3 pairs, and 1 CTA per SM
# lifts the 128-register launch bound. H200, graph µs (one chunk a step, (4, 2, 4) -> pairs
# (4, 4, 1) / (4, 6, 1)): rows/Hq/Hkv/topk 1/64/4/2048 8.9 -> 8.6 / 8.7, 2/64/4/2048 9.7 ->
# 9.2 / 9.1, 4/64/4/2048 12.0 -> 11.2 / 10.9, 4/32/4/2048 11.6 -> 10.6 / 10.8; at 128 CTAs
# pairs lost (8/64/4/2048 14.8 -> 15.5, 4/64/4/8192 22.4 -> 23.0, 4/32/8/4096 19.7 -> 20.2).
# Four chunks a step ((4, 8, 1), a generalized loop tried in ff1b678) against two, later
# kernels: 10.43 / 10.51, 7.83 / 7.76, 8.72 / 8.31, 10.47 / 10.05 (rows 4, 1, 2 of G=16 and
# rows 4 of G=8): no better, so the pairs stay, in the loop the GPU tests ran.
CLUSTER_PAIR_CONFIG = (4, 6, 1)
# The one-wave split's launch (wave_split, round 5 above): one CTA per SM by its shared memory.
WAVE_CONFIG = (8, 4, 1)
# Split-K: the CLUSTER_SIZES splits of a (row, kv head) are one thread block cluster
# merging through distributed shared memory; a split whose share fits CLUSTER_SLOT_CAP
# entries resolves its own slots (no slot pass: one launch a call). Round 3 (H200, G=16
# Hkv=4): cluster split-K beat the workspace split-K (now removed) everywhere, and with 2
# splits it beat the single pass at rows * Hkv = 512 and 1024 too (topk 2048: 101 vs 113
# and 174 vs 194 µs; topk 8192: 331 vs 384 and 583 vs 714). _SPLIT_TABLE (round 4, the
# sweep above): per TOPK bucket, the most (row, kv head) pairs that still take 8 splits,
# then 4; more pairs take 2. Longer selections want more splits for as many pairs (more
# work per split amortizes the merge). Each split keeps _MIN_CHUNKS_PER_SPLIT chunks.
CLUSTER_SIZES = (2, 4, 8)  # the table's; wave_split takes any of 2..CLUSTER_MAX
CLUSTER_MAX = 8  # the portable cluster size limit
TMMA_MAX_GROUP = 8  # tokens as MMA rows: the group fills the MMA's 8 columns
CLUSTER_SLOT_CAP = 1024
DECODE_MIN_PROGRAMS, DECODE_MIN_PROGRAMS_SM90, DECODE_MIN_PROGRAMS_SM90_LONG = 2048, 512, 832
LONG_TOPK_SM90 = 4096  # selections from which sm_90's crossover is the LONG one (see below)
LONG_TOPK_SM90_D128 = 2048  # the same at head_dim 128, with the 2-split in row order
ORDERED_SPLIT_MIN_PAIRS_SM90 = 384  # rows x Hkv from which that 2-split is ordered (measured)
_SPLIT_TABLE = ((2048, 8, 32), (4096, 16, 128), (None, 64, 128))  # (TOPK up to, 8 to, 4 to)
_MIN_CHUNKS_PER_SPLIT = 8
# A selection of at most 16 chunks (topk <= 256) over at most 16 (row, kv head) pairs still
# splits 4 ways in one wave: H200, per call in a graph, topk 256 at rows * Hkv = 1-16, 4 CTAs
# 5.6-6.4 µs against 2 CTAs' 5.9-6.7 (at 32 pairs 2 CTAs win: 6.8 against 7.0).
_MIN_CHUNKS_SHORT = 4
WAVE_SLOT_PASS_SPLITS = 3  # the most one-wave splits that take the slot pass (see above)

slots_family = kernel_family(
    "qsa_slots",
    "qsa/sm89_slot_pass.cuh",
    "fij_qsa::qsa_slots",
    ("page_size", "order", "entries"),
    (PTR, I64, I64, PTR, I64, I64, PTR, I64, PTR, I32, I32, I32, I32, I32, I32),
)
_DECODE_SIGNATURE = (
    *(PTR, I64, I64),  # q
    *(PTR, U32, U32, U32, PTR, U32, U32, U32),  # k, v caches and their byte strides (32-bit)
    *(PTR, I32, PTR, I64, I32, I32, I32),  # slots, counts, topk, offset bits, Hkv
    *(PTR, I64, I64, PTR, I64, I64),  # out, gate
    *(F32, F32),  # scales
    *(PTR, I64, PTR, I64, I64, I32, I32, PTR, I64, I32, I32),  # fused slot resolution's inputs
)
_DECODE_PARAMS = ("group_size", "head_dim", "num_warps", "num_stages", "min_ctas")
decode_family = kernel_family(
    "qsa_decode",
    "qsa/sm89_mma_decode.cuh",
    "fij_qsa::qsa_decode",
    (*_DECODE_PARAMS, "bulk"),
    _DECODE_SIGNATURE,
)
# The single pass in its TMMA / LEAN loop form (QsaOptions.tmma and .lean; decode_plan).
decode_form_family = kernel_family(
    "qsa_decode_form",
    "qsa/sm89_mma_decode.cuh",
    "fij_qsa::qsa_decode_form",
    (*_DECODE_PARAMS, "bulk", "tmma", "lean"),
    _DECODE_SIGNATURE,
    ptx_twins=SM107A_TAKES_SM100A,
)
cluster_family = kernel_family(
    "qsa_decode_cluster",
    "qsa/sm89_mma_decode.cuh",
    "fij_qsa::qsa_decode_cluster",
    (*_DECODE_PARAMS, "cluster", "slot_cap", "bulk", "pair", "order"),
    _DECODE_SIGNATURE,
    ptx_twins=SM107A_TAKES_SM100A,
)

Config = tuple[int, int, int]  # (num_warps, num_stages, min_ctas)
Plan = tuple[KernelFamily, tuple]  # a family and its parameters
# cluster size -> clusters of WAVE_CONFIG CTAs the device runs at once (plan.wave_clusters)
Clusters = Callable[[int], int]
# More SMs than any part of a shipped arch has (today at most 160): what prebuild plans for.
MAX_SMS = 512
# What jit_kernels.max_active_clusters answers on the H200 for WAVE_CONFIG launches of 2..8
# CTAs (measured): the device-free stand-in of the CPU tests and tools/profile_host.py --stub.
H200_WAVE_CLUSTERS = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}


def decode_smem_bytes(
    head_dim: int, config: Config, cluster: int, slot_cap: int, bulk: bool
) -> int:
    """DecodeSmem<...>::kBytes of templates/qsa/util.cuh."""
    warps, stages, min_ctas = config
    q_in_smem = head_dim > 128 or warps * min_ctas >= 16
    q_bytes = (head_dim // 64) * 4 * 32 * 16 if q_in_smem else 0
    stage = warps * stages * (_BULK_STAGE_BYTES if bulk else head_dim * 32)
    red = warps * 16 * (head_dim + _RED_PAD) * 4 + warps * 16 * 2 * 4
    items = -(-16 * (head_dim // 8) // cluster) if cluster else 0  # inbox_items
    inbox = cluster * (items * 8 + 16 * 2) * 4
    bars = warps * stages * 8 if bulk else 0
    return q_bytes + max(stage + slot_cap * 4, red) + inbox + bars


def decode_min_programs(cap: tuple[int, int], topk: int = 0, head_dim: int = 0) -> int:
    """rows * Hkv from which the dispatcher takes the single pass on ``cap`` for selections
    of ``topk`` at ``head_dim`` (0: any). H200 (graph µs): the best split over the single
    pass 0.58-0.87 at 256 pairs, 0.99-1.25 at 512, 1.1-1.4 from 1024; at long selections the
    single pass's one wave (528 CTAs) ends with its longest row: from topk 4096 the 2-split
    0.95-1.00 of it at 512-768 pairs, 1.05-1.07 at 896 (session 29), and at head_dim 128
    from topk 2048 the ordered 2-split 0.87-0.99, 1.04-1.09 at 896 (session 30; QSA rounds
    19-20 in docs/perf-log/qsa.md). Other archs: the seed's."""
    if cap != (9, 0):
        return DECODE_MIN_PROGRAMS
    long = topk >= LONG_TOPK_SM90 or (head_dim == 128 and topk >= LONG_TOPK_SM90_D128)
    return DECODE_MIN_PROGRAMS_SM90_LONG if long else DECODE_MIN_PROGRAMS_SM90


def ordered_split(cap: tuple[int, int], pairs: int, splits: int, head_dim: int, topk: int) -> bool:
    """Whether a split launch takes the rows in the slot pass's order (longest first; after
    the slot pass, no in-kernel slots): on sm_90 a 2-split of head_dim 128 from topk 2048
    past one wave of 2-CTA clusters (264 on the H200), where the order lets the later
    clusters fill in behind the long rows. H200 (session 30, graph µs, 3 geometries x 384-768
    pairs x topk 2048 / 4096): 0.90-0.98 of the 2-split in index order at topk 4096, 0.93-1.01
    at 2048; at 256 pairs (one wave) 0.98-1.06 at topk 2048-4096, 1.11-1.18 at topk 256-512."""
    return (
        cap == (9, 0)
        and splits == 2
        and head_dim == 128
        and topk >= LONG_TOPK_SM90_D128
        and pairs >= ORDERED_SPLIT_MIN_PAIRS_SM90
    )


def ordered_prebuilt_on(spec: KernelSpec, arch: str) -> bool:
    """Whether prebuild builds ``spec`` for ``arch``: a cluster in row order only where
    ordered_split takes it (sm_90a); every other kernel, yes."""
    ordered = spec.family == cluster_family.family and spec.param_dict["order"]
    return not ordered or arch_capability(arch) == (9, 0)


def split_count(
    rows: int, num_kv_heads: int, topk: int, min_programs: int = DECODE_MIN_PROGRAMS
) -> int:
    """The dispatcher's splits per (row, kv head): 1 (single pass, from ``min_programs``
    pairs on) or a cluster size."""
    pairs = max(1, rows * num_kv_heads)
    if pairs >= min_programs:
        return 1
    _, eight, four = next(row for row in _SPLIT_TABLE if row[0] is None or topk <= row[0])
    k = 8 if pairs <= eight else 4 if pairs <= four else 2
    while k > 1 and -(-topk // CHUNK) < k * _MIN_CHUNKS_PER_SPLIT:
        k //= 2
    return k


def table_pairs_unfused(cluster: int, sms: int) -> bool:
    """Whether split_count's table can launch ``cluster`` CTAs without in-kernel slots two
    chunks a step (takes_pairs: at most half a wave) on ``sms`` SMs: without the slots a
    split exceeds CLUSTER_SLOT_CAP entries, so none is halved for want of chunks, and the
    fewest pairs the table gives ``cluster`` past that size make the smallest grid."""
    for upto, eight, four in _SPLIT_TABLE:
        least = 1 if cluster == 8 else eight + 1 if cluster == 4 else four + 1
        if (upto is None or upto > CLUSTER_SLOT_CAP * cluster) and 2 * cluster * least <= sms:
            return True
    return False


def wave_smem_bytes(cluster: int) -> int:
    """Shared memory of a WAVE_CONFIG launch of ``cluster`` splits (in-kernel slots)."""
    return decode_smem_bytes(128, WAVE_CONFIG, cluster, CLUSTER_SLOT_CAP, False)


def wave_fits(pairs: int, topk: int, splits: int, clusters: Clusters) -> bool:
    """Whether ``splits`` CTAs per (row, kv head) qualify for the one-wave launch: the
    clusters of ``pairs`` pairs all run at once with one CTA per SM, and each split keeps
    _MIN_CHUNKS_PER_SPLIT chunks (_MIN_CHUNKS_SHORT for a short selection's few pairs)."""
    chunks = -(-topk // CHUNK)
    short = chunks <= 16 and pairs <= 16
    least = _MIN_CHUNKS_SHORT if short else _MIN_CHUNKS_PER_SPLIT
    return chunks >= splits * least and pairs <= clusters(splits)


def wave_split(pairs: int, head_dim: int, topk: int, clusters: Clusters) -> int:
    """The most splits (2..CLUSTER_MAX) that ``wave_fits``, where their slots fit the
    kernel's list or they are at most WAVE_SLOT_PASS_SPLITS (after the slot pass); else 0
    (and at D != 128: two chunks a step need it)."""
    if head_dim != 128:
        return 0
    k = next((k for k in range(CLUSTER_MAX, 1, -1) if wave_fits(pairs, topk, k, clusters)), 0)
    return k if k <= WAVE_SLOT_PASS_SPLITS or fused_fits(topk, k) else 0


class Split(NamedTuple):
    """launch_split's answer: CTAs a (row, kv head), config and pair (None: gather_choice's)."""

    splits: int
    config: Config | None = None
    pair: bool | None = None
    order: bool = False


def launch_split(
    rows: int,
    num_kv_heads: int,
    topk: int,
    head_dim: int,
    sms: int,
    clusters: Clusters,
    min_programs: int = DECODE_MIN_PROGRAMS,
    cap: tuple[int, int] | None = None,
) -> Split:
    """The dispatcher's split below the single pass's crossover: the one-wave split where
    there is one (CLUSTER_PAIR_CONFIG at most half a wave with its own slots, else
    WAVE_CONFIG; two chunks a step), else split_count's table, in row order where
    ordered_split says so on a device of ``cap`` (None: no order)."""
    pairs = max(1, rows * num_kv_heads)
    k = wave_split(pairs, head_dim, topk, clusters) if pairs < min_programs else 0
    if k:
        half = 2 * pairs * k <= sms and fused_fits(topk, k)
        return Split(k, CLUSTER_PAIR_CONFIG if half else WAVE_CONFIG, True)
    splits = split_count(rows, num_kv_heads, topk, min_programs)
    order = cap is not None and ordered_split(cap, pairs, splits, head_dim, topk)
    return Split(splits, order=order)


def fused_fits(topk: int, num_splits: int) -> bool:
    """Whether one split's share of the slots fits the in-kernel slot list."""
    chunks = -(-topk // CHUNK)
    per_split = -(-chunks // num_splits) * CHUNK
    return 0 < per_split <= CLUSTER_SLOT_CAP


def takes_bulk(bulk_ok: bool, cluster: int, grid_ctas: int, sms: int) -> bool:
    """The shipped gather: bulk copies wherever they apply (``bulk_ok``: D=128, V right
    after K) for the single pass; of the clusters, only 2-CTA ones over more than two waves
    of one CTA per SM (the round 4 sweep above)."""
    return bulk_ok and (not cluster or (cluster == 2 and grid_ctas > 2 * sms))


def default_config(head_dim: int, cluster: int, bulk: bool) -> Config:
    if bulk:
        return BULK_CLUSTER if cluster else BULK_SINGLE_PASS
    if cluster:
        return CLUSTER_CONFIG.get(head_dim, DECODE_CONFIG[head_dim])
    return DECODE_CONFIG[head_dim]


def pairs_apply(head_dim: int, cluster: int, bulk: bool) -> bool:
    """Whether a launch can step two chunks at a time: a cp.async cluster at D=128."""
    return bool(cluster) and not bulk and head_dim == 128


def takes_pairs(head_dim: int, cluster: int, bulk: bool, grid_ctas: int, sms: int) -> bool:
    """The shipped step: two chunks at a time where pairs apply and the grid is at most
    half a wave."""
    return pairs_apply(head_dim, cluster, bulk) and 2 * grid_ctas <= sms


def checked_config(config: tuple, head_dim: int, bulk: bool, pair: bool = False) -> Config:
    """An opt-in (warps, stages, min CTAs): in the template's ranges and within SMEM_LIMIT."""
    warps, stages, min_ctas = (int(c) for c in config)
    if warps not in (4, 8) or not 2 <= stages <= 8 or not 1 <= min_ctas <= 8:
        raise ValueError(f"config (warps, stages, min_ctas) out of range: {config}")
    if pair and (stages < 4 or stages % 2):
        raise ValueError(f"two chunks a step need an even number of stages >= 4: {config}")
    worst = decode_smem_bytes(head_dim, (warps, stages, min_ctas), 8, CLUSTER_SLOT_CAP, bulk)
    if worst > SMEM_LIMIT:
        raise ValueError(f"config {config} needs more than {SMEM_LIMIT} bytes of shared memory")
    return warps, stages, min_ctas


def gather_choice(
    head_dim: int,
    cluster: int,
    grid_ctas: int,
    sms: int,
    bulk_ok: bool,
    bulk: bool | None = None,
    config: tuple | None = None,
    pair: bool | None = None,
) -> tuple[bool, Config, bool]:
    """(bulk, config, pair) of a decode launch: the shipped rule, or opt-in overrides,
    checked."""
    if bulk is None:
        bulk = takes_bulk(bulk_ok, cluster, grid_ctas, sms)
    elif bulk and not bulk_ok:
        raise ValueError(
            "bulk copies need head_dim 128, v_cache right after k_cache with its strides "
            "(the combined cache) and sm_90+"
        )
    if pair is None:  # a config given without pair: the one-chunk step
        pair = config is None and takes_pairs(head_dim, cluster, bulk, grid_ctas, sms)
    elif pair and (not cluster or bulk):
        raise ValueError("two chunks a step: cp.async clusters only")
    if config is None:
        config = CLUSTER_PAIR_CONFIG if pair else default_config(head_dim, cluster, bulk)
        return bool(bulk), config, bool(pair)
    return bool(bulk), checked_config(config, head_dim, bulk, pair), bool(pair)


def slot_plan(page_size: int, order: bool, entries: int) -> Plan:
    return slots_family, (page_size, order, entries)


def decode_plan(
    group: int,
    head_dim: int,
    cluster: int,
    fused: bool,
    bulk: bool,
    config: Config,
    tmma: bool = False,
    lean: bool = False,
    pair: bool = False,
    order: bool = False,
) -> Plan:
    """The decode kernel of a single pass (``cluster`` 0) or of a cluster split-K. The single
    pass's loop forms: ``tmma``, tokens as the MMAs' rows (groups of at most 8 heads; ignored
    above); ``lean``, loop invariants kept in registers. A cluster's ``pair``: two chunks a
    step; ``order``: rows in the slot pass's order (not ``fused``)."""
    if not cluster:
        tmma = tmma and group <= TMMA_MAX_GROUP
        if tmma or lean:
            return decode_form_family, (group, head_dim, *config, bulk, tmma, lean)
        return decode_family, (group, head_dim, *config, bulk)
    slot_cap = CLUSTER_SLOT_CAP * fused
    return cluster_family, (group, head_dim, *config, cluster, slot_cap, bulk, pair, order)
