"""The QSA decode's kernels (split from ``qsa``): families, launch configs, split rule, specs.

``qsa._decode_launch`` picks a call's kernels with these helpers, and warm-up and prebuild
enumerate their specializations with the same helpers, so the three cannot drift apart.

The gathers and split-K forms come from one H200 sweep of variants (CUDA-graph µs per
call, whole call; D=128, page 64, the issue's inputs; rows/Hq/Hkv/topk; the single pass's
later loop forms, slot entries and PDL: qsa.py's launch choices and BENCHMARKS.md):

    single pass                        512/64/4/2048   2048/32/4/1024
      cp.async gathers (before)            274.4           513.1
      256-byte bulk copies                 252.2           479.5
      + row order, early prologue, gate    242.8           478.0   <- ships
      + split QK chains                    242.0           476.2   (+12 registers, 127: no)
      128-byte bulk copies (K, V apart)    321.7           613.6   (cp.async stays for those)
    cluster split-K                     64/64/4/2048    4/64/4/2048
      before                                47.7            14.7
      interleaved splits + gate             47.5            13.7   <- ships where bulk does not
      + bulk copies, 2 stages               43.5            14.3   <- ships on multi-wave grids

Bulk copies fetch a token's K and V rows (256 bytes) at once, so they need D = 128 and V
right after K in memory with K's strides: the combined [blocks, Hkv, page, 2D] cache split
as the seed's warm-up does. Other caches and head dims keep the cp.async gathers. So does a
cluster grid that fits one CTA per SM (rows=4, measured above), probably because bulk
clusters keep 2 stages (3 would cost the 4 CTAs per SM of larger grids) and a warp there
has about 3 chunks, all of which 3 cp.async stages hold at once (tools/bench_qsa.py --lean
times "bulk s3" against it).
"""

from __future__ import annotations

from jit_kernels import KernelFamily, KernelSpec

from ._jit import kernel_family

CHUNK = 16  # tokens per warp step (kChunk in templates/qsa_util.cuh)
SLOT_THREADS = 256  # kSlotThreads in templates/qsa_slots.cuh
SLOT_ENTRIES = (1, 2, 4, 8)  # slot-pass entries per thread the template allows
_RED_PAD = 4  # kRedPad in templates/qsa_util.cuh
_BULK_STAGE_BYTES = 4224  # kBulkStageBytes in templates/qsa_bulk.cuh
SMEM_LIMIT = 227 * 1024  # dynamic shared memory of one CTA (sm_90, sm_100)

# (num_warps, num_stages, min_ctas) of the cp.async decode per head dim. A warp stage holds
# one 16-token chunk of K and V (D * 32 bytes); min_ctas is the launch bound (4 CTAs of 4
# warps moves Q to shared memory to fit 128 registers). D=128: 4 x 52 KB of shared memory,
# 16 warps per SM. (Round 3: several kv heads per CTA were slower at every shape.)
DECODE_CONFIG = {64: (4, 8, 1), 128: (4, 3, 4), 256: (4, 2, 1)}
# The bulk-copy decode (D=128): the single pass keeps 4 CTAs of 3 stages (4 x 54 KB); a
# cluster, whose partials need room too, 2 stages to keep 4 CTAs per SM.
BULK_SINGLE_PASS = (4, 3, 4)
BULK_CLUSTER = (4, 2, 4)
# Split-K: the CLUSTER_SIZES splits of a (row, kv head) are one thread block cluster
# merging through distributed shared memory; a split whose share fits CLUSTER_SLOT_CAP
# entries resolves its own slots (no slot pass: one launch a call). Round 3 (H200, G=16
# Hkv=4): cluster split-K beat the workspace split-K (now removed) everywhere, and with 2
# splits it beat the single pass at rows * Hkv = 512 and 1024 too (topk 2048: 101 vs 113
# and 174 vs 194 µs; topk 8192: 331 vs 384 and 583 vs 714). The split count fills about
# _SPLIT_TARGET_CTAS CTAs per 2048 of topk (more work per split amortizes the merge:
# 8192 wanted 4x the CTAs), at least 2, at most 8, each split keeping
# _MIN_CHUNKS_PER_SPLIT chunks. DECODE_MIN_PROGRAMS: rows * Hkv from which one pass runs
# (the measured crossover; see qsa.use_fp8_decode_kernel).
CLUSTER_SIZES = (2, 4, 8)
TMMA_MAX_GROUP = 8  # tokens as MMA rows: the group fills the MMA's 8 columns
CLUSTER_SLOT_CAP = 1024
DECODE_MIN_PROGRAMS = 2048
_SPLIT_TARGET_CTAS = 256
_MIN_CHUNKS_PER_SPLIT = 8

slots_family = kernel_family(
    "qsa_slots",
    "qsa_slots.cuh",
    "fij_qsa::qsa_slots",
    ("page_size", "order", "entries"),
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
decode_family = kernel_family(
    "qsa_decode",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode",
    (*_DECODE_PARAMS, "bulk"),
    _DECODE_SIGNATURE,
)
# The single pass in its TMMA / LEAN loop form (qsa.TMMA, qsa.LEAN_LOOP: shipped; decode_plan).
decode_form_family = kernel_family(
    "qsa_decode_form",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_form",
    (*_DECODE_PARAMS, "bulk", "tmma", "lean"),
    _DECODE_SIGNATURE,
)
cluster_family = kernel_family(
    "qsa_decode_cluster",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_cluster",
    (*_DECODE_PARAMS, "cluster", "slot_cap", "bulk"),
    _DECODE_SIGNATURE,
)

Config = tuple[int, int, int]  # (num_warps, num_stages, min_ctas)
Plan = tuple[KernelFamily, tuple]  # a family and its parameters


def decode_smem_bytes(
    head_dim: int, config: Config, cluster: int, slot_cap: int, bulk: bool
) -> int:
    """DecodeSmem<...>::kBytes of templates/qsa_util.cuh."""
    warps, stages, min_ctas = config
    q_in_smem = head_dim > 128 or warps * min_ctas >= 16
    q_bytes = (head_dim // 64) * 4 * 32 * 16 if q_in_smem else 0
    stage = warps * stages * (_BULK_STAGE_BYTES if bulk else head_dim * 32)
    red = warps * 16 * (head_dim + _RED_PAD) * 4 + warps * 16 * 2 * 4
    part = 16 * (head_dim + 2) * 4 if cluster else 0
    bars = warps * stages * 8 if bulk else 0
    return q_bytes + max(stage + slot_cap * 4, red + part) + bars


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


def fused_fits(topk: int, num_splits: int) -> bool:
    """Whether one split's share of the slots fits the in-kernel slot list."""
    chunks = -(-topk // CHUNK)
    per_split = -(-chunks // num_splits) * CHUNK
    return 0 < per_split <= CLUSTER_SLOT_CAP


def takes_bulk(bulk_ok: bool, cluster: int, grid_ctas: int, sms: int) -> bool:
    """The shipped gather: bulk copies wherever they apply (``bulk_ok``: D=128, V right
    after K), except a cluster grid that fits one CTA per SM."""
    return bulk_ok and not (cluster and grid_ctas <= sms)


def default_config(head_dim: int, cluster: int, bulk: bool) -> Config:
    if bulk:
        return BULK_CLUSTER if cluster else BULK_SINGLE_PASS
    return DECODE_CONFIG[head_dim]


def checked_config(config: tuple, head_dim: int, bulk: bool) -> Config:
    """An opt-in (warps, stages, min CTAs): in the template's ranges and within 227 KB."""
    warps, stages, min_ctas = (int(c) for c in config)
    if warps not in (4, 8) or not 2 <= stages <= 8 or not 1 <= min_ctas <= 8:
        raise ValueError(f"config (warps, stages, min_ctas) out of range: {config}")
    worst = decode_smem_bytes(head_dim, (warps, stages, min_ctas), 8, CLUSTER_SLOT_CAP, bulk)
    if worst > SMEM_LIMIT:
        raise ValueError(f"config {config} needs more than 227 KB of shared memory")
    return warps, stages, min_ctas


def gather_choice(
    head_dim: int,
    cluster: int,
    grid_ctas: int,
    sms: int,
    bulk_ok: bool,
    bulk: bool | None = None,
    config: tuple | None = None,
) -> tuple[bool, Config]:
    """(bulk, config) of a decode launch: the shipped rule, or opt-in overrides, checked."""
    if bulk is None:
        bulk = takes_bulk(bulk_ok, cluster, grid_ctas, sms)
    elif bulk and not bulk_ok:
        raise ValueError(
            "bulk copies need head_dim 128, v_cache right after k_cache with its strides "
            "(the combined cache) and sm_90+"
        )
    if config is None:
        return bool(bulk), default_config(head_dim, cluster, bulk)
    return bool(bulk), checked_config(config, head_dim, bulk)


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
) -> Plan:
    """The decode kernel of a single pass (``cluster`` 0) or of a cluster split-K. The single
    pass's loop forms: ``tmma``, tokens as the MMAs' rows (groups of at most 8
    heads; ignored above); ``lean``, loop invariants kept in registers."""
    if not cluster:
        tmma = tmma and group <= TMMA_MAX_GROUP
        if tmma or lean:
            return decode_form_family, (group, head_dim, *config, bulk, tmma, lean)
        return decode_family, (group, head_dim, *config, bulk)
    return cluster_family, (group, head_dim, *config, cluster, CLUSTER_SLOT_CAP * fused, bulk)


def dispatch_plans(
    group: int,
    head_dim: int,
    page_size: int,
    num_kv_heads: int,
    topk: int,
    bulk_ok: bool,
    sms: int,
    entries: int,
    tmma: bool = False,
    lean: bool = False,
) -> list[Plan]:
    """Every kernel the dispatcher and the single-pass function launch for calls of this
    geometry, whatever their row count: the single pass (its loop form as ``tmma`` and
    ``lean`` flip it) with its ordered slot pass, and the cluster split-K of each row count
    below DECODE_MIN_PROGRAMS / Hkv."""
    single = default_config(head_dim, 0, bulk_ok)
    plans = [slot_plan(page_size, True, entries)]
    plans.append(decode_plan(group, head_dim, 0, False, bulk_ok, single, tmma, lean))
    for rows in range(1, -(-DECODE_MIN_PROGRAMS // num_kv_heads)):
        splits = split_count(rows, num_kv_heads, topk) if topk else 1
        if splits == 1:
            continue
        fused = fused_fits(topk, splits)
        bulk, config = gather_choice(head_dim, splits, rows * num_kv_heads * splits, sms, bulk_ok)
        if not fused:
            plans.append(slot_plan(page_size, False, entries))
        plans.append(decode_plan(group, head_dim, splits, fused, bulk, config))
    return list(dict.fromkeys(plans))


def all_specs(
    group: int, head_dim: int, page_size: int, entries: int, tmma: bool = False, lean: bool = False
) -> list[KernelSpec]:
    """Every specialization the dispatcher can launch for this geometry on any cache, row
    count and TOPK (prebuild), the single pass in the loop form ``tmma``/``lean`` pick."""
    bulks = (False, True) if head_dim == 128 else (False,)
    plans = [slot_plan(page_size, order, entries) for order in (True, False)]
    for bulk in bulks:
        single = default_config(head_dim, 0, bulk)
        plans.append(decode_plan(group, head_dim, 0, False, bulk, single, tmma, lean))
        for cluster in CLUSTER_SIZES:
            config = default_config(head_dim, cluster, bulk)
            for fused in (True, False):
                plans.append(decode_plan(group, head_dim, cluster, fused, bulk, config))
    return [family.spec(params) for family, params in plans]
