"""The sm_90a TMA form of the paged MQA logits kernel (templates/mqa_logits/sm90_tma_wgmma.cuh): its
family, launch configuration and the tensor map over the fused KV pool.

The tensor map views the pool's fp8 values as ``[num_blocks][block_size][head_dim]``
bytes (block stride ``block_size * (head_dim + 4)``), read in column panels of at most 128
bytes with the swizzle of the panel's width that wgmma reads (``Panels`` in the template).
It depends on the pool's address, size and geometry only, so it is encoded once per pool and cached: a serving
engine's pool never moves, and the hot path is one dict lookup.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from jit_kernels import TENSOR_MAP, KernelUnavailable, LaunchError
from jit_kernels import driver as cu

from .._jit import kernel_family
from .checks import SMEM_LIMIT, STATIC_SMEM, TILE, reg_cap
from .ring import LOGITS_ARGS

TMA_DIMS = (32, 64, 128, 256)  # head dims the kernel serves (Panels in the template)
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
    (*LOGITS_ARGS, TENSOR_MAP),  # + the KV pool's tensor map
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
    head_dim ``dim``.

    Ring depth, measured on the H200 (per call in a graph of 8, BENCHMARKS.md, MQA round 9):
    a ring deeper than about 10 stages queues more reads than HBM's latency needs, and
    the calls were slower, most (8-9 %) at 47-62 tiles per SM. At n=64 with 4 warpgroups x 16
    stages against 3 x 9: B=256 L=8192 66.3 against 64.8 us, B=64 21.6 against 19.8, B=32
    L=16384 22.0 against 20.1; at B=32 L=8192, 2 x 22 against 2 x 6: 12.0 against 11.4.
    Other head dims keep the bytes in flight of these depths (stages x 128 / dim).

    - Small calls at n <= 64, and the smallest at n = 128: SMALL_CONFIG, two warpgroups
      with 3 stages each (half the Q loads of more warpgroups).
    - Other calls at n <= 64: NARROW_CONFIG, three warpgroups with 9 stages (four with 8
      read ~1 % slower). Below head_dim 128 a tile carries fewer bytes for the same
      epilogue, and four warpgroups were faster (SHORT_ROW_CONFIG, BENCHMARKS.md, MQA round
      10): B=256 L=8192 head_dim 32 4 x 32 stages 37.2 us against 3 x 36 40.0, head_dim 64
      4 x 16 42.4 against 3 x 18 44.1.
    - Larger n: the most warpgroups (at most 4) whose accumulators fit the block's register
      cap, since the consumers are latency-bound; one producer warp per warpgroup (warp p
      feeds warpgroup p, so one slow warpgroup does not hold up the others' stages); two Q
      buffers (prefetch) while that leaves at least 2 ring stages per warpgroup, else one
      (n=128: 83.7 against 88.0 us with one buffer at B=256, next_n=2, round 3); at most
      RING_STAGES stages. n=128: 4 warpgroups x 8 stages; n=192: 3 x 9.
    - The lean consumer loop (``lean``) for calls that are not small below head_dim 128 at
      next_n <= 2 (at 3 and 4 its store rows spill a few registers; never timed there),
      where it measured faster (docs/perf-log/mqa_logits.md, round 13; per call in a
      graph, lean against plain in the same run, two runs): head_dim 32 B=256 L=8192 35.1 /
      35.3 us against 37.4 / 37.5 (next_n=2: 48.8 / 48.5 against 50.3 / 51.3), head_dim 64
      41.3 / 40.1 against 41.4 / 42.6 (next_n=2: 57.0 / 57.8 against 59.3 / 61.9). At
      n=128, head_dim 128 it was slower (B=256 next_n=2 75.8 / 77.6 against 73.0 / 74.7,
      B=64 L=65536 144.7 / 150.2 against 138.3 / 140.5). At n=192 (next_n=3 H=64 B=128
      L=16384) it was faster, 95.3 / 98.7 against 99.4 / 103.6, but ptxas spills its loop
      counter there: left for a version that fits. Round 14 (the lean loop's tile as an
      inlined lambda, same instructions, other registers): head_dim 32 30.8 / 30.4 us in
      two runs against plain 37.7 / 37.9 (DeepGEMM 30.4 / 29.7).
    - Paired tiles (``pair``) at n = 64, head_dim 64, calls that are not small
      (PAIRED_CONFIG: 3 warpgroups, 18 stages at head_dim 64): B=256 L=8192 38.5 us
      against the lean 4 x 16's 41.1 (DeepGEMM 38.2), one run (round 14). Not taken where
      they were not faster: head_dim 32 3 x 36 pairs 31.8 against lean 4 x 32 30.8; head_dim
      128 3 x 12 pairs 67.1 / 126.7 against 66.5 / 127.1 (B=256 / B=64 L=65536); larger n
      does not fit two accumulator sets.
    - setmaxnreg (``regs``: the four producer warps give registers to the consumers, within
      the block's launch allocation), round 15, two runs each. n = 128, next_n <= 2: the
      lean loop with 112 registers, B=256 L=8192 next_n=2 head_dim 32 44.3 / 45.1 us against
      48.1 / 48.8 (DeepGEMM 45.0 / 45.5), head_dim 64 56.3 / 54.9 against 58.6 / 59.5; head_dim
      128 74.6 / 75.7 against 75.5 / 76.1, B=64 L=65536 137.4 / 143.9 against 140.1 / 144.1,
      B=128 with one 128K request 47.5 / 45.8 against 45.9 / 47.8. next_n 3-4 at head_dim
      128 (WIDE_REGS_CONFIGS, 3 warpgroups at 160): next_n=3 H=64 B=128 L=16384 94.6 / 93.9
      against 3 x 9's 102.2 / 102.0; next_n=4 H=32 75.3 / 75.2 against 4 x 8's 78.3 / 79.5.
    """
    if (small and n <= 64) or (small >= 2 and n == 128):
        return _deeper(SMALL_CONFIG, n, dim)
    config = _sized(n, dim)
    if small or dim > 128:
        return config
    if next_n > 2:
        return WIDE_REGS_CONFIGS.get(n, config) if dim == 128 else config
    if n == 128:
        return config._replace(lean=1, regs=LEAN_REGS)
    return config._replace(lean=1) if dim < 128 else config


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
    one column panel (min(dim, 128) bytes) x the tile's rows, in that panel's swizzle.
    ``promotion``: the L2 fill size in bytes (128 or 256; the benchmark compares them)."""
    key = (kv_ptr, num_blocks, block_size, dim, promotion)
    found = _maps.get(key)
    if found is not None:
        return found
    if num_blocks < 1:
        raise KernelUnavailable("kv_fused has no blocks: no tensor map to encode")
    width = min(dim, 128)
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
