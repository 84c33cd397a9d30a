"""The generic ``fp8_paged_mqa_logits`` kernel: one cubin per dtype triple serving every
geometry (next_n, num_heads, head_dim <= 256, block_size are runtime arguments).

It serves when the call's specialization cannot be built or loaded (no NVRTC, or
``FLASHINFER_JIT_DISABLE=1`` and the specialization is not in the cache), so ``prebuild``
ships it for every dtype triple of the workloads (plan.prebuild_specs): a host without
NVRTC serves any geometry of those dtypes with it. A call of another triple (no workload has
it) gets its specialization compiled on first use, or without NVRTC the torch path. See
templates/mqa_logits/sm90_ring_generic.cuh.
"""

from __future__ import annotations

import logging

from jit_kernels import I32, KernelUnavailable, sm_count

from .._jit import SM107A_TAKES_SM100A, kernel_family
from .checks import ring_smem_bytes, ring_stages
from .launch import KernelPlan
from .ring import LOGITS_ARGS

log = logging.getLogger(__name__)
GENERIC_ROWS = 256  # Q rows of the generic kernel's buffer: next_n * num_heads <= 256
GENERIC_MAX_DIM = 256
GENERIC_WARPGROUPS = 1  # 5 warps: 255 registers a thread (9 warps would cap at 168 and spill)

generic_family = kernel_family(
    "mqa_logits_generic",
    "mqa_logits/sm90_ring_generic.cuh",
    "fij_mqa::paged_mqa_logits_generic",
    ("output_dtype", "epi_dtype", "acc_dtype"),
    (*LOGITS_ARGS, I32, I32, I32, I32, I32),  # + next_n, num_heads, head_dim, block, stages
    ptx_twins=SM107A_TAKES_SM100A,
)


def generic_plan(
    geometry, output_dtype, epi_dtype, acc_dtype, device: int, why: str, kv_evict_first: int
) -> KernelPlan:
    """The launch plan of the generic kernel for this call."""
    next_n, heads, dim, block_size = geometry
    stages = ring_stages(GENERIC_ROWS, dim, GENERIC_WARPGROUPS)
    if dim > GENERIC_MAX_DIM or stages < 2:
        raise KernelUnavailable(f"{why}; the generic kernel takes head_dim <= {GENERIC_MAX_DIM}")
    kernel = generic_family.get((output_dtype, epi_dtype, acc_dtype), device)
    log.info("fp8_paged_mqa_logits: generic kernel for %s (%s)", geometry, why)
    smem = ring_smem_bytes(GENERIC_ROWS, dim, GENERIC_WARPGROUPS, stages)
    threads = 128 * GENERIC_WARPGROUPS + 32
    extra = (kv_evict_first, next_n, heads, dim, block_size, stages)
    return KernelPlan(kernel, (sm_count(device), 1, 1), (threads, 1, 1), smem, extra)
