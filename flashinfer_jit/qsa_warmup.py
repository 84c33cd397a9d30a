"""Warm-up and prebuild of the QSA decode (split from ``qsa``): which kernels a serving step
or a shipped workload reaches, from the same helpers the dispatcher uses (``qsa_kernels``).

The launch choices (``qsa.SLOT_ENTRIES_PER_THREAD``, ``TMMA``, ``LEAN_LOOP``) are read from
``qsa`` at call time, so a flipped choice warms and prebuilds what the dispatcher launches.
"""

from __future__ import annotations

import torch

from jit_kernels import KernelSpec, capability, kernels_disabled, sm_count
from jit_kernels.args import require_int

from ._jit import cuda_device_index
from .qsa_checks import FP8_CACHE_DTYPES, HEAD_DIMS, MAX_GROUP
from .qsa_kernels import all_specs, dispatch_plans


# TOPK (the issue lists a "TOPK tile count" axis) is not a template parameter: the decode
# loop runs to each row's own valid count. It decides the split counts and whether a
# cluster's splits can resolve their own slots, so warm-up (which knows the selection width
# and the device) compiles exactly what the dispatcher reaches, and prebuild (which knows
# neither) every variant.
def warmup_qsa_fp8_decode(
    kv_cache: torch.Tensor, block_table: torch.Tensor, *, num_query_heads: int, selection_width: int
) -> tuple[tuple, ...]:
    """Compile and load every kernel a serving step over ``kv_cache`` needs.

    ``kv_cache`` is the combined [num_blocks, Hkv, page_size, 2 * D] cache (uint8 codes or
    float8_e4m3fn). Returns one (family, parameters) entry per kernel made ready: the slot
    pass, the single pass and the cluster split-K kernels that calls of any row count reach
    (split over ``kv_cache.transpose(1, 2).split(D, -1)``), or () where the fp8 kernels do
    not apply (CPU, dtype, arch, shape, or kernels disabled). ``selection_width`` is TOPK.
    """
    from . import qsa

    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
        raise ValueError(
            "kv_cache must be a 4-D tensor [num_blocks, num_kv_heads, page_size, 2 * head_dim]"
        )
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError("block_table must be a 2-D tensor [num_requests, width]")
    require_int("selection_width", selection_width, 0)
    require_int("num_query_heads", num_query_heads, 1)
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
    k_cache, v_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    plans = dispatch_plans(
        num_query_heads // num_kv_heads,
        head_dim,
        page_size,
        num_kv_heads,
        selection_width,
        qsa._bulk_ok(k_cache, v_cache, device),
        sm_count(device),
        qsa.SLOT_ENTRIES_PER_THREAD,
        qsa.wave_clusters(device),
        qsa.TMMA,
        qsa.LEAN_LOOP,
    )
    for family, params in plans:
        family.get(params, device)
    return tuple((family.family, params) for family, params in plans)


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads can reach."""
    from . import qsa

    specs: set[KernelSpec] = set()
    entries, forms = qsa.SLOT_ENTRIES_PER_THREAD, (qsa.TMMA, qsa.LEAN_LOOP)
    for entry in workloads["configs"]:
        for head_dim in entry["head_dims"]:
            for group in entry["group_sizes"]:
                for page_size in entry["page_sizes"]:
                    specs.update(
                        all_specs(int(group), int(head_dim), int(page_size), entries, *forms)
                    )
    return sorted(specs, key=str)
