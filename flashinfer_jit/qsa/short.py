"""The short single pass: short selections over many rows (issue 22). On sm_90 the dispatcher
takes it (``takes_short``, ``short_config``: with the slot pass's row order) in place of the
single pass from SHORT_MIN_PAIRS_PER_SM (row, kv head) pairs per SM on (by topk; with bulk
copies at topk <= 512 from SHORT_WIDE_MIN_PAIRS_PER_SM, two warps a row up to
SHORT_ONE_WARP_PER_SM, then one warp of 2 or 4 stages);
``QsaOptions.short`` forces it off or on. ``run_kernels(args, short=True, config=...,
order=...)`` launches any config, ``tools/bench_qsa.py --short`` times them beside the
shipped single pass and the seed's Triton kernel, and the dispatch sweep's "short" column
times the dispatched one.

Why (H200 figures of docs/perf-log/qsa.md, rounds 6 and 8): past the byte floor, the single
pass costs about the same time per row whatever the selection's length (4096/16/1 at topk
256 / 512 / 2048: 62 / 64 / 63 µs over the floor), about 7.5 µs per wave of 528 CTAs: a
row's life carries a fixed chain of dependent trips (row order, slots and q, the first
gathers, the merge and the gate) that only the 3 other rows of its SM overlap, since 4 warps
x 3 stages of 4224 bytes (54.9 KB with q) fit 4 CTAs per SM. The seed's Triton kernel keeps
2 rows per SM (200 registers x 128 threads), only 16 KB of K/V in flight per row (64-token
tiles loaded into registers, only the next tile's slots prefetched), and still lives about
6 µs a row against ours' ~14.6: it overlaps fewer rows but each one's chain is short.

What: one CTA of 1 or 2 warps per (row, kv head), the shipped loop (bulk copies, TMMA for
groups <= 8, LEAN), so 7-16 rows share an SM with 8-16 warps (k1: 16) and 32-48 chunks
in flight (k1: 48) (SHORT_CONFIGS); ``order`` False takes the rows in index order, which
drops a dependent L2 load from every CTA's chain and the slot pass's sorting CTA.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jit_kernels import KernelSpec, arch_capability

from .._jit import SM107A_TAKES_SM100A, kernel_family
from .kernels import (
    _DECODE_PARAMS,
    _DECODE_SIGNATURE,
    SMEM_LIMIT,
    TMMA_MAX_GROUP,
    Config,
    Plan,
    decode_smem_bytes,
)

decode_short_family = kernel_family(
    "qsa_decode_short",
    "qsa/sm89_mma_decode.cuh",
    "fij_qsa::qsa_decode_short",
    (*_DECODE_PARAMS, "bulk", "tmma", "order"),
    _DECODE_SIGNATURE,
    ptx_twins=SM107A_TAKES_SM100A,
)

SM_SMEM = 228 * 1024  # shared memory of an sm_90 / sm_100 SM
CTA_RESERVED = 1024  # what the driver keeps per resident CTA
SM_WARPS, SM_CTAS = 64, 32  # resident warps and CTAs per SM (sm_90, sm_100)
# (num_warps, num_stages, min_ctas) the bench times, D = 128, bulk copies: min_ctas is the
# launch bound (registers: 65536 / (32 warps min_ctas), 128 at 16 warps per SM, where q's
# fragments move to shared memory) and what the shared memory lets reside (short_ctas).
SHORT_CONFIGS = {
    "w1s2": (1, 2, 16),  # 16 rows an SM, 2 chunks in flight a row (12.4 KB: q in smem)
    "w1s3": (1, 3, 12),  # 12 rows, 3 chunks
    "w1s4": (1, 4, 12),  # 12 rows, 4 chunks (13 fit by shared memory)
    "w1s6": (1, 6, 8),  # 8 rows, 6 chunks
    "w2s2": (2, 2, 8),  # 8 rows, 4 chunks
    "w2s3": (2, 3, 8),  # 7 rows (8 by the bound; q in smem), 6 chunks
    "w4s3": (4, 3, 4),  # the single pass's config until session 27 (now 2 stages)
    "w4s2": (4, 2, 4),  # the single pass's config since: isolates the row order (order=False)
}
SHORT_DEFAULT = SHORT_CONFIGS["w1s4"]

# What the dispatcher takes, rows in the slot pass's order: w1s2 (16 one-warp rows an SM),
# and with bulk copies (D = 128, the combined cache) at topk <= SHORT_WIDE_MAX_TOPK w2s2 (8
# two-warp rows) up to SHORT_ONE_WARP_PER_SM pairs an SM, past it w1s2 or w1s4 (12 rows of
# 4 chunks), whichever takes fewer waves of rows, w1s4 at a tie. Head dims 64 and 128 (w1s2's
# launch bound of 16 CTAs leaves 128 registers, too few for D = 256's accumulators); sm_90
# only (what the H200 measured; sm_100/103/107 keep the single pass).
SHORT_DISPATCH = SHORT_CONFIGS["w1s2"]
SHORT_WIDE = SHORT_CONFIGS["w2s2"]
SHORT_DEEP = SHORT_CONFIGS["w1s4"]
SHORT_HEAD_DIMS = (64, 128)
SHORT_CAPS = ((9, 0),)
# (topk up to, rows x Hkv per SM from which the short pass is the faster), w1s2: the H200's
# dispatch sweep of QSA round 11 (72 points, rows x Hkv 512-4096, docs/perf-log/qsa.md),
# short / k1 by selection: topk 256 1.25-1.38 at 1024 pairs (7.8 an SM), 0.96 at 1536
# (11.6), 0.83-0.88 from 2048; topk 512 1.14 at 1536, 0.97-0.98 at 2048 (15.5), 0.98-1.02
# at 2112-3072, 0.83-0.92 at 4096; topk 2048 1.12-1.16 at 2048-3072, 0.93-1.01 at 4096
# (31), topk 4096 0.97-0.98 at 4096. Topk 1024 takes 2048's threshold (not measured).
SHORT_MIN_PAIRS_PER_SM = ((256, 11.5), (512, 15.5), (4096, 31.0))
SHORT_MAX_TOPK = SHORT_MIN_PAIRS_PER_SM[-1][0]
# With bulk copies at topk <= 512, w2s2 from these (QSA round 17, 34 points of G 4-16, topk
# 256 / 512 x 512-4096 pairs, beside the single pass at 2 stages, "k1s2"): topk 256 w2s2 /
# k1s2 0.96 at 768 pairs (5.8 an SM), 0.92 at 1024, 1.02 at 1536, 0.89-0.90 at 2048-3072;
# topk 512 1.04-1.06 at 1024-1536, 0.92 at 2048 (15.5), 0.93 at 3072.
SHORT_WIDE_MIN_PAIRS_PER_SM = ((256, 5.8), (512, 15.5))
SHORT_WIDE_MAX_TOPK = SHORT_WIDE_MIN_PAIRS_PER_SM[-1][0]
# One warp a row past these pairs an SM (QSA round 18: the same grid once the one-warp
# kernels wrote their output straight from registers, store_direct; best of w1s2 / w1s4 in
# row order against w2s2, G 16 at Hkv 1 / 4): topk 256 0.90 / 0.90 at 1536 pairs (11.6 an
# SM: w1s4, one wave), 0.95 / 0.96 at 2048 (w1s2, one wave), 0.98 / 0.97 at 3072 (w1s4, two
# waves), 0.93 / 0.91 at 4096 (w1s2); topk 512: w2s2 4-5 % ahead of w1s2 at 2048 (15.5 an
# SM, its two waves against one), 0.98 / 0.98 at 3072 (w1s4), 0.93 / 0.92 at 4096 (w1s2).
SHORT_ONE_WARP_PER_SM = ((256, 11.5), (512, 16.0))
# Past topk SHORT_WIDE_MAX_TOPK the short pass serves groups above TMMA_MAX_GROUP only: at
# groups <= 8 (the TMMA form) and topk 2048 it was 2.4-5.8 % behind the single pass at
# 4096-32768 pairs (QSA round 17: 512/32/8/2048 423.3 against 399.4 µs, 4096/8/1/2048
# 451.7 / 430.6, 4096/32/8/2048 3092 / 3020), where G = 16 stays 1-5 % ahead.


def _bulk_wide(bulk: bool, topk: int) -> bool:
    return bulk and 0 < topk <= SHORT_WIDE_MAX_TOPK


def short_min_pairs(sms: int, topk: int, bulk: bool) -> int:
    """rows x Hkv from which the rule takes the short single pass on ``sms`` SMs for a
    selection of ``topk`` (0 < topk <= SHORT_MAX_TOPK), ``bulk``: with bulk copies."""
    table = SHORT_WIDE_MIN_PAIRS_PER_SM if _bulk_wide(bulk, topk) else SHORT_MIN_PAIRS_PER_SM
    per_sm = next(p for upto, p in table if topk <= upto)
    return math.ceil(per_sm * sms)


def short_config(bulk: bool, topk: int, pairs: int, sms: int) -> Config:
    """The short single pass's (warps, stages, min CTAs) for a call it serves: with bulk
    copies at short selections w2s2 up to SHORT_ONE_WARP_PER_SM pairs an SM, past it w1s2
    or w1s4 by their waves of rows (fewer, then more stages); else w1s2."""
    if not _bulk_wide(bulk, topk):
        return SHORT_DISPATCH
    if pairs <= next(p for upto, p in SHORT_ONE_WARP_PER_SM if topk <= upto) * sms:
        return SHORT_WIDE

    def waves(config: Config) -> int:  # (bulk copies: D = 128)
        return -(-pairs // (short_ctas(128, config, True) * sms))

    return min((SHORT_DEEP, SHORT_DISPATCH), key=lambda c: (waves(c), -c[1]))


def short_configs(bulk: bool, topk: int | None = None) -> tuple[Config, ...]:
    """Every config short_config can pick with (``bulk``) or without bulk copies at selection
    width ``topk`` (None: any): what warm-up and prebuild list for the short pass."""
    wide = bulk and (topk is None or _bulk_wide(bulk, topk))
    return (SHORT_DISPATCH, SHORT_WIDE, SHORT_DEEP) if wide else (SHORT_DISPATCH,)


class ShortCall(NamedTuple):
    """What the short rule reads of a call: the device (capability, SMs), the geometry, the
    selection's width, rows x Hkv, and whether its gather is the bulk copies."""

    cap: tuple[int, int]
    head_dim: int
    group: int
    topk: int
    pairs: int
    sms: int
    bulk: bool


def takes_short(call: ShortCall) -> bool:
    """The dispatcher's rule (``QsaOptions.short`` None) for a call that takes the single
    pass anyway. The sweeps move the thresholds here, in one place."""
    return (
        call.cap in SHORT_CAPS
        and call.head_dim in SHORT_HEAD_DIMS
        and 0 < call.topk <= SHORT_MAX_TOPK
        and (call.topk <= SHORT_WIDE_MAX_TOPK or call.group > TMMA_MAX_GROUP)
        and call.pairs >= short_min_pairs(call.sms, call.topk, call.bulk)
    )


def short_choice(option: bool | None, call: ShortCall, single: bool) -> bool:
    """Whether a call takes the short single pass: ``option`` (QsaOptions.short) None, the
    rule where the call takes the single pass (``single``); False, never; True, every call
    it serves (head_dim 64 or 128, a selection: topk > 0), any arch, any row count, in
    place of the single pass or the split. True at another head dim raises ValueError."""
    if option is None:
        return single and takes_short(call)
    if option and call.head_dim not in SHORT_HEAD_DIMS:
        raise ValueError(
            f"QsaOptions(short=True): the short single pass serves head_dim "
            f"{' or '.join(map(str, SHORT_HEAD_DIMS))}, got head_dim {call.head_dim}"
        )
    return bool(option) and call.topk > 0


def short_reached(option: bool | None, call: ShortCall) -> bool:
    """Whether some row count of this geometry takes the short pass (warm-up): the rule's
    threshold is a number of rows, which a serving step can reach at any width (``call``'s
    pairs and SMs are not read)."""
    return short_choice(option, call._replace(pairs=1 << 62, sms=1), single=True)


def short_smem_bytes(head_dim: int, config: Config, bulk: bool) -> int:
    """Dynamic shared memory of a short launch (a single pass's DecodeSmem)."""
    return decode_smem_bytes(head_dim, config, 0, 0, bulk)


def short_ctas(head_dim: int, config: Config, bulk: bool) -> int:
    """CTAs of ``config`` one SM holds by shared memory, warps, CTAs and the launch bound."""
    warps, _, min_ctas = config
    by_smem = SM_SMEM // (short_smem_bytes(head_dim, config, bulk) + CTA_RESERVED)
    return min(by_smem, SM_WARPS // warps, SM_CTAS, min_ctas)


def checked_short_config(config: tuple, head_dim: int, bulk: bool) -> Config:
    """A short launch's (warps, stages, min CTAs): 1, 2 or 4 warps, 2-8 stages (the
    validity ring holds 8), a launch bound the SM can hold, within SMEM_LIMIT."""
    warps, stages, min_ctas = (int(c) for c in config)
    if warps not in (1, 2, 4) or not 2 <= stages <= 8 or not 1 <= min_ctas <= SM_CTAS:
        raise ValueError(f"short config (warps, stages, min_ctas) out of range: {config}")
    if warps * min_ctas > SM_WARPS:
        raise ValueError(f"short config {config}: more warps than an SM holds")
    if short_smem_bytes(head_dim, (warps, stages, min_ctas), bulk) > SMEM_LIMIT:
        raise ValueError(f"short config {config} needs more than {SMEM_LIMIT} bytes of smem")
    return warps, stages, min_ctas


def short_plan(
    group: int, head_dim: int, bulk: bool, config: Config, tmma: bool, order: bool
) -> Plan:
    """The short single pass's kernel: the shipped loop forms (TMMA for groups <= 8 where
    ``tmma``, LEAN) at ``config``, rows in the slot pass's order or (``order`` False) in
    index order."""
    tmma = tmma and group <= TMMA_MAX_GROUP
    return decode_short_family, (group, head_dim, *config, bool(bulk), bool(tmma), bool(order))


def short_prebuilt_on(spec: KernelSpec, arch: str) -> bool:
    """Whether prebuild builds ``spec`` for ``arch``: the short single pass only for the
    archs whose dispatcher takes it (SHORT_CAPS: sm_90a), every other kernel as it supports."""
    ours = spec.family == decode_short_family.family
    return spec.supports(arch) and (not ours or arch_capability(arch) in SHORT_CAPS)
