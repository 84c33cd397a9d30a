"""The ring / direct form of the paged MQA logits kernel
(``templates/mqa_logits/sm90_ring_wgmma.cuh``): its family and template parameters."""

from __future__ import annotations

import torch

from jit_kernels import I32, I64, PTR, KernelUnavailable

from .._jit import SM107A_TAKES_SM100A, kernel_family
from .checks import launch_config, reg_cap, ring_regs, ring_stages

GEOMETRY = ("next_n", "num_heads", "head_dim", "block_size")
DTYPES = ("output_dtype", "epi_dtype", "acc_dtype")
# The launch arguments every logits kernel starts with (the TMA and generic kernels append
# their own): q, kv_fused, weights, block_tables {ptr; row stride}, seq_lens {ptr; stride},
# schedule, out {ptr; row stride}, batch, flags (logits_flags; the generic kernel: the KV
# stream's L2 policy alone).
LOGITS_ARGS = (PTR, PTR, PTR, PTR, I64, PTR, I64, PTR, PTR, I64, I32, I32)


# One 16-bit specialization of the ring and TMA kernels serves float16 and bfloat16 logits:
# their store rounds to either, picked by bit 1 of the flags argument (TileSums::write), so
# each shape is built twice instead of three times (prebuild: 120 kernels fewer).
def kernel_dtypes(dtypes: tuple) -> tuple:
    """The (output, epilogue, accumulator) template dtypes of the ring and TMA kernels for
    a call's dtypes: bfloat16 logits take the float16 specialization."""
    return (torch.float16 if dtypes[0] == torch.bfloat16 else dtypes[0], *dtypes[1:])


def logits_flags(dtypes: tuple, evict: int) -> int:
    """The ring and TMA kernels' flags argument: bit 0 the KV stream's evict-first L2 policy,
    bit 1 bfloat16 logits (from the 16-bit specialization)."""
    return int(evict) | (2 if dtypes[0] == torch.bfloat16 else 0)


ring_family = kernel_family(
    "mqa_logits",
    "mqa_logits/sm90_ring_wgmma.cuh",
    "fij_mqa::paged_mqa_logits",
    (*GEOMETRY, *DTYPES, "warpgroups", "stages", "portable", "ring"),
    LOGITS_ARGS,
    ptx_twins=SM107A_TAKES_SM100A,
)

RingConfig = tuple[int, int, bool, bool]  # (warpgroups, stages, portable, ring)


def _forced(n: int, dim: int, config: RingConfig) -> tuple[int, int, bool, bool]:
    """A forced (warpgroups, stages, portable, ring), checked; stages 0: as many as fit."""
    warpgroups, stages, portable, ring = config
    # Forced configs whose accumulators cannot fit the block's register cap would fail
    # to compile (ptxas C7602) or spill: refuse them (the generic kernel serves).
    need = ring_regs(n, dim) if ring else n // 2 + 40
    cap = reg_cap(128 * warpgroups + 32 * ring)
    if need > cap:
        raise KernelUnavailable(
            f"forced config {config}: ~{need} registers a thread exceed the cap "
            f"of {warpgroups} warpgroups ({cap})"
        )
    if ring and stages == 0:
        stages = ring_stages(n, dim, warpgroups)
    if ring and (stages < 1 or stages % warpgroups):
        raise KernelUnavailable(f"ring stages {stages} must be a positive multiple of {warpgroups}")
    return warpgroups, stages, portable, ring


def ring_params(geometry: tuple, dtypes: tuple, forced: RingConfig | None = None) -> tuple:
    """The specialization's template parameters: the dispatcher's choice (launch_config)
    unless ``forced`` (a benchmark's or a test's variant). ``portable`` (mma.sync on
    widened fragments, the sm_100a/sm_103a code path) is never chosen on sm_90a: it exists
    so the H200 tests cover what the other arches run."""
    next_n, heads, dim, _ = geometry
    n = next_n * heads
    if forced is None:
        warpgroups, stages, ring = launch_config(n, dim)
        config = (warpgroups, stages, False, ring)
    else:
        config = _forced(n, dim, forced)
    return (*geometry, *kernel_dtypes(dtypes), *config)
