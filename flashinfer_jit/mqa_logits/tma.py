"""The sm_90a TMA form of the paged MQA logits kernel (templates/mqa_logits/sm90_tma_wgmma.cuh): its
family, launch configuration and the tensor map over the fused KV pool.

The tensor map views the pool's fp8 values as ``[num_blocks][block_size][head_dim]``
bytes (block stride ``block_size * (head_dim + 4)``), read in column panels of at most 128
bytes with the swizzle of the panel's width that wgmma reads (``Panels`` in the template).
It depends on the pool's address, size and geometry only, so it is encoded once per pool and cached: a serving
engine's pools (one a layer) never move, and the hot path is one dict lookup.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jit_kernels import I32, TENSOR_MAP, KernelUnavailable, LaunchError
from jit_kernels import driver as cu

from .._jit import kernel_family
from .checks import SMEM_LIMIT, STATIC_SMEM, TILE, reg_cap
from .ring import LOGITS_ARGS

TMA_DIMS = (32, 64, 96, 128, 256)  # head dims the kernel serves (Panels in the template)


def panel_width(dim: int) -> int:
    """Bytes of one column panel of a tile row (Panels in the template): 128 where ``dim``
    is a multiple of 128, 64 at 64, else 32 (one panel per 32-byte k step)."""
    return 128 if dim % 128 == 0 else 64 if dim == 64 else 32


TMA_MAX_STAGES = 24

tma_family = kernel_family(
    "mqa_logits_tma",
    "mqa_logits/sm90_tma_wgmma.cuh",
    "fij_mqa::paged_mqa_logits_tma",
    (
        "next_n",
        "num_heads",
        "head_dim",
        "block_size",
        "output_dtype",
        "epi_dtype",
        "acc_dtype",
        "warpgroups",
        "stages",
        "producers",
        "qbuf",
        "lean",
        "pair",
        "regs",
    ),
    (*LOGITS_ARGS, I32, TENSOR_MAP),  # + the block-table columns to prefetch, the pool's tensor map
    archs=("sm_90a",),
)


class TmaConfig(NamedTuple):
    """The TMA kernel's launch configuration: its template parameters after the geometry and
    dtypes. As ``MqaLogitsOptions.config`` (tests, benchmarks) ``stages`` 0 means as many
    as fit."""

    warpgroups: int  # consumer warpgroups
    stages: int  # ring stages
    producers: int  # producer warps
    qbuf: int  # Q buffers per warpgroup (2: the next request's Q is prefetched)
    # 1: the lean consumer loop (sm90_tma_wgmma.cuh, LEAN): a tile's MMA is issued right
    # after its stage lands, on the current request's Q, its request checked after (a
    # switch drains and reissues), the loop's state warp-uniform and every per-tile address
    # one add from a per-thread or per-request base; the producers issue from an elected
    # lane. tma_config picks it where it measured faster.
    lean: int = 0
    # 1 (with lean): a warpgroup takes tiles in pairs, both MMAs in flight, the first's
    # epilogue under the second's MMA; stages a multiple of twice the warpgroups and of
    # twice the producer warps.
    pair: int = 0
    # > 0: setmaxnreg gives each consumer thread this many registers (the four producer
    # warps what is left of the launch allocation), weights in registers where they fit.
    regs: int = 0


def tma_regs(n: int) -> int:
    """Registers a consumer thread needs: f32 accumulators + ~32 of addressing and epilogue
    (ptxas on sm_90a: 72 at n=64, 94 at n=128, 134 at n=192 with room to spare)."""
    return n // 2 + 32


def lane_weight_bytes(n: int) -> int:
    """One weight buffer (LaneWeights in templates/mqa_logits/tile.cuh): 4 lane rows of
    n/4 floats, each padded to 16 bytes plus 16."""
    return 4 * 4 * (-(-n // 16) * 4 + 4)


def _stage_bytes(dim: int) -> int:
    """One ring stage: the tile's values and scales, its descriptor and two mbarriers."""
    return TILE * (dim + 4) + 32


def tma_smem_bytes(n: int, dim: int, warpgroups: int, stages: int, qbuf: int) -> int:
    """Dynamic shared memory (TmaLayout in the template, + 1024 bytes of alignment slack):
    per stage the tile's values, scales, descriptor and two mbarriers; per warpgroup
    ``qbuf`` Q buffers and weight buffers."""
    per_buffer = n * dim + lane_weight_bytes(n)
    return stages * _stage_bytes(dim) + warpgroups * qbuf * per_buffer + 1024


def stage_unit(warpgroups: int, producers: int, pair: int = 0) -> int:
    """Ring stages come in multiples of this: whole rounds of the warpgroups and of the
    producer warps (of their pairs of tiles with ``pair``)."""
    return math.lcm(warpgroups, producers) * (2 if pair else 1)


def tma_stages(
    n: int,
    dim: int,
    warpgroups: int,
    producers: int,
    qbuf: int,
    cap: int = TMA_MAX_STAGES,
    pair: int = 0,
) -> int:
    """The most stages, at most ``cap`` (a multiple of stage_unit), that fit beside the Q
    buffers."""
    free = SMEM_LIMIT - STATIC_SMEM - tma_smem_bytes(n, dim, warpgroups, 0, qbuf)
    stages = max(0, min(cap, free // _stage_bytes(dim)))
    unit = stage_unit(warpgroups, producers, pair)
    return stages // unit * unit


def tma_threads(warpgroups: int, producers: int) -> int:
    return 128 * warpgroups + 32 * producers


# Tiles per SM at most (an upper bound from max_seq_len) of the small-call classes 1 and 2.
SMALL_WORK_TILES_PER_SM = (32, 16)


def small_work(batch: int, max_seq_len: int, num_sms: int) -> int:
    """How small a call is: 2 with at most 16 tiles per SM, 1 with at most 32, else 0. The
    tiles are bounded from max_seq_len: the host does not read seq_lens."""
    tiles = batch * -(-max_seq_len // TILE)
    return sum(tiles <= per_sm * num_sms for per_sm in SMALL_WORK_TILES_PER_SM)


# The KV stream's L2 policy (KvPolicy, templates/mqa_logits/ring.cuh) without an option:
# evict-first where the reads it keeps in L2 (each request's Q and weights, read by every CTA
# of the request, the block table, and the logits it writes, which the caller's top-k reads
# next) are worth more than the stream's: small calls (MQA round 8), every next_n=1 call
# and every next_n=2-3 call at head_dim EVICT_MIN_DIM or more. Measured (sessions 26-27,
# H200, per call in a graph) with each call after a clean read of twice the L2 and charged
# its own write-back, as a serving step's other kernels leave the L2 between two layers'
# calls: next_n=1 2.7-6.3 % faster at ten shapes of 16-128 requests x 8K-128K tokens, head
# dims 64-256, level at head_dim 32; next_n=2 at head_dim 128 1.2-6.3 % faster at 64-256
# requests, H=32 and 64, at head_dim 96 3 % (B=256); next_n=3 level to 1 %. Calls back to
# back, 8 to a graph (the L2 holding the previous call's data), read -1 to +5 % at next_n=1
# and +1 to +3 % slower at next_n=2 below 256 requests: the policy is chosen for the serving
# step, not for a loop over one layer. Evict-normal stays where it measured slower either
# way: next_n=2 at head dims 32-64 (1-2 %) and next_n=4 H=32 (2-3 %).
EVICT_MIN_DIM = 96


def kv_evict_first(small: int, geometry: tuple) -> bool:
    """The dispatcher's KV policy for a call (``small``: small_work; ``geometry``: (next_n,
    heads, head_dim, ...))."""
    next_n, dim = geometry[0], geometry[2]
    return small > 0 or next_n == 1 or (2 <= next_n <= 3 and dim >= EVICT_MIN_DIM)


# The block table into L2 beside the lengths' read (prefetch_table in util.cuh): a call
# after other kernels otherwise waits on HBM for the lengths, then the table, then the KV.
# H200, one process, with / without (MQA round 28): B=1 3.9 / 4.1 us, 0.2-0.6 us less at
# next_n=1 B=256-1024 and L=64K, level elsewhere within 0.3 but d96n2 (+0.6). (The kernels
# at next_n*heads 192 skip it: see the template.)
TABLE_PREFETCH = True

# Ring depth (64-token stages): 8-10 (68-85 KB of reads in flight per SM, what HBM's
# latency under load needs) stream the pool fastest; small calls 6 (see tma_config).
RING_STAGES = 10  # at most, in any config tma_config picks
SMALL_CONFIG = TmaConfig(2, 6, 2, 2)  # small calls at n <= 64, and the smallest at n = 128
NARROW_CONFIG = TmaConfig(3, 9, 3, 2)  # the other calls at n <= 64
SHORT_ROW_CONFIG = TmaConfig(4, 8, 4, 2)  # the other calls at n <= 64, head_dim < 128
PAIRED_CONFIG = TmaConfig(3, 9, 3, 2, 1, 1)  # the other calls at n = 64, head_dim 64
# setmaxnreg (see tma_config): the lean loop at n = 128, next_n <= 2 with 112 registers a
# consumer thread; at next_n 3-4 (n = 128, 192), head_dim 128 (the one measured), 3
# warpgroups at 160 with four producer warps.
LEAN_REGS = 112
# Paired tiles at 232 registers (two warpgroups, two accumulator sets each, 16 stages) for
# the other calls at next_n = 2, n = 128, head_dim 128 (see tma_config).
PAIRED_WIDE_CONFIG = TmaConfig(2, 16, 4, 2, 1, 1, 232)
WIDE_REGS_CONFIGS = {128: TmaConfig(3, 12, 4, 2, 1, 0, 160), 192: TmaConfig(3, 12, 4, 1, 1, 0, 160)}


def _deeper(config: TmaConfig, n: int, dim: int) -> TmaConfig:
    """``config`` (a depth measured at head_dim 128) with as many stages as keep the same
    bytes in flight at head_dim ``dim``, within what fits."""
    unit = stage_unit(config.warpgroups, config.producers, config.pair)
    least = -(-2 * config.warpgroups // unit) * unit  # two stages a warpgroup
    want = max(least, config.stages * 128 // dim // unit * unit)
    fit = tma_stages(n, dim, config.warpgroups, config.producers, config.qbuf, want, config.pair)
    return config._replace(stages=fit)


def tma_config(n: int, small: int = 0, dim: int = 128, next_n: int = 1) -> TmaConfig:
    """The configuration for next_n*num_heads = n (``small``: the class of small_work) at
    head_dim ``dim``. Every rule below was measured on the H200, per call in a graph beside
    the alternatives in the same run; the figures are in docs/perf-log/mqa_logits.md (the
    round named).

    - Ring depth (round 9): past ~10 stages of 64 tokens the ring queues more reads than
      HBM's latency needs and calls got slower (8-9 % at 47-62 tiles per SM); other head
      dims keep the same bytes in flight (stages x 128 / dim).
    - Small calls at n <= 64, and the smallest at n = 128: SMALL_CONFIG, two warpgroups
      with 3 stages each (half the Q loads of more warpgroups).
    - Other calls at n <= 64: NARROW_CONFIG, 3 warpgroups x 9 stages (4 x 8 ~1 % slower);
      below head_dim 128, where a tile carries fewer bytes for the same epilogue,
      SHORT_ROW_CONFIG's four warpgroups (round 10: 7 % faster at head_dim 32, 4 % at 64).
    - Larger n: the most warpgroups (at most 4) whose accumulators fit the register cap
      (the consumers are latency-bound), one producer warp per warpgroup, two Q buffers
      while that leaves 2 ring stages a warpgroup (round 3: 5 % faster at n=128).
    - The lean consumer loop (``lean``) at next_n <= 2 for calls that are not small below
      head_dim 128 (rounds 13-14: 3-18 % faster than the plain loop; at next_n 3-4 its
      store rows spill without setmaxnreg), and at n <= 64 up to head_dim 128, small calls
      too (rounds 16-20, the "other loop" column of four runs beside DeepGEMM: B=32 2.5-4 %
      faster in 4 of 4, B=1 2-12 % in 3 of 4, B=64 L=64K 1-2 % in 4 of 4, H=32 B=256 1.5 %
      in 2 of 2, B=256 and B=1024 level).
    - Paired tiles (``pair``) at n = 64, head_dim 64 (PAIRED_CONFIG; round 14, level with
      DeepGEMM, 6 % faster than lean 4 x 16); not faster at head_dim 32 or 128.
    - setmaxnreg (``regs``: the four producer warps give registers to the consumers within
      the block's launch allocation; round 15, two to four runs each): the lean loop with
      112 registers at n = 128, next_n <= 2 (head_dim 32 8 %, 64 6 %, 128 1-2 % faster than
      before), and WIDE_REGS_CONFIGS' 3 warpgroups at 160 at next_n 3-4, head_dim 128
      (next_n=3 H=64 8 %, next_n=4 H=32 4-6 % faster).
    - PAIRED_WIDE_CONFIG at next_n = 2, n = 128, head_dim 128 (round 25: 2.7-4.3 % faster
      than the 4 x 8 lean loop at 112 registers over eleven shapes of 16-256 requests x
      8K-128K tokens, one process; faster or level in six earlier ones; at head_dim 64
      slower, 32 level, 96 mixed).
    """
    if small and n <= 64:
        return _deeper(SMALL_CONFIG, n, dim)._replace(lean=int(dim <= 128 and next_n <= 2))
    if small >= 2 and n == 128:
        return _deeper(SMALL_CONFIG, n, dim)
    config = _sized(n, dim)
    if small or dim > 128:
        return config
    if next_n > 2:
        return WIDE_REGS_CONFIGS.get(n, config) if dim == 128 else config
    if n == 128 and next_n == 2 and dim == 128:
        return PAIRED_WIDE_CONFIG
    if n == 128:
        return config._replace(lean=1, regs=LEAN_REGS)
    return config._replace(lean=1) if dim < 128 or n <= 64 else config


def _sized(n: int, dim: int) -> TmaConfig:
    """tma_config's choice for calls that are not small, before the loop's."""
    if n == 64 and dim == 64:  # (paired tiles need the lean loop: next_n <= 2 here)
        return _deeper(PAIRED_CONFIG, n, dim)
    if n <= 64:
        return _deeper(NARROW_CONFIG if dim >= 128 else SHORT_ROW_CONFIG, n, dim)
    for warpgroups in (4, 3, 2, 1):
        producers = warpgroups
        if tma_regs(n) > reg_cap(tma_threads(warpgroups, producers)):
            continue
        for qbuf in (2, 1):
            cap = max(2 * warpgroups, RING_STAGES * 128 // dim)
            stages = tma_stages(n, dim, warpgroups, producers, qbuf, cap)
            if stages >= 2 * warpgroups:
                return TmaConfig(warpgroups, stages, producers, qbuf)
    raise KernelUnavailable(f"next_n*num_heads={n} at head_dim {dim} does not fit the TMA kernel")


_maps: dict[tuple[int, ...], bytes] = {}
_MAPS_MAX = 64


def kv_tensor_map(
    kv_ptr: int, num_blocks: int, block_size: int, dim: int, promotion: int = 128
) -> bytes:
    """The 128-byte CUtensorMap of a fused pool (cached per address and geometry): boxes of
    one column panel (``panel_width`` bytes) x the tile's rows, in that panel's swizzle.
    ``promotion``: the L2 fill size in bytes (128 or 256; the benchmark compares them)."""
    key = (kv_ptr, num_blocks, block_size, dim, promotion)
    found = _maps.get(key)
    if found is not None:
        return found
    if num_blocks < 1:
        raise KernelUnavailable("kv_fused has no blocks: no tensor map to encode")
    width = panel_width(dim)
    try:
        encoded = cu.encode_tiled(
            cu.TENSOR_MAP_UINT8,
            kv_ptr,
            (dim, block_size, num_blocks),
            (dim, block_size * (dim + 4)),
            (width, min(block_size, TILE), 1),
            (1, 1, 1),
            cu.SWIZZLE_BYTES[width],
            # 128, not 256: the tiles are whole 128-byte rows, and 256-byte promotion slowed
            # the streaming by 5-8 % on the H200 (BENCHMARKS.md, MQA round 7).
            cu.L2_PROMOTION_BYTES[promotion],
            "cuTensorMapEncodeTiled for kv_fused",
        )
    except LaunchError as exc:
        raise KernelUnavailable(str(exc)) from exc
    if len(_maps) >= _MAPS_MAX:
        _maps.clear()
    _maps[key] = encoded
    return encoded
