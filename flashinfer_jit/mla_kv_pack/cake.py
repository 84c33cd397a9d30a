"""The ``cake`` backend of ``concat_mla_kv_quant_fp8``: CuTe-DSL programs, one per head group.

The generator is ``templates/mla_kv_pack/sm90_cute_dsl.py``; the engine compiles it into
cubins (on a machine with the DSL, e.g. ``flashinfer-jit prebuild``) and this module only
plans the head group, checks what the programs need and shapes their launch. Nothing here
imports the DSL, so a GPU host without it runs the cake backend from prebuilt cubins.
"""

from __future__ import annotations

import torch

from jit_kernels import I32, I64, PTR, KernelSpec, capability, struct

from .._jit import cuda_device_index, kernel_family

# Mirrors of the generator's constants (tests check they agree).
HEAD_GROUPS = (1, 2, 4, 8)  # head pairs a warp owns: one program each
WARPS_PER_BLOCK = 8
# The cubins are built for these exact compute capabilities (arch-specific targets).
CAPABILITIES = ((9, 0), (10, 0), (10, 3))
ALIGN = 32  # bytes; every tensor's base (one 32-byte chunk per lane)
PE_STRIDE_MULTIPLE = 16  # elements; keeps every k_pe row 32-byte aligned

# The DSL passes each cute.Tensor by value as {pointer; dynamic shape; dynamic strides}.
family = kernel_family(
    "mla_kv_pack_cake",
    "mla_kv_pack/sm90_cute_dsl.py",
    "_pack",
    ("head_group",),
    (
        struct(PTR, I64, what="kv_nope {ptr; rows}"),
        struct(PTR, I32, I64, what="k_pe {ptr; tokens; row stride}"),
        struct(PTR, I64, what="key {ptr; rows}"),
        struct(PTR, I64, what="value {ptr; rows}"),
        *(I32, I32, I32),  # num_tokens, num_heads, groups_per_token
    ),
    compiler="cute",
    # CAPABILITIES' archs: CuTe DSL 4.8.1 refuses sm_107a (with its bundled CUDA 12.9), so
    # prebuild skips that arch for this family instead of failing its kernels.
    archs=tuple(f"sm_{major}{minor}a" for major, minor in CAPABILITIES),
)

# Warps per SM below which SMs idle (4 warp schedulers x 8 warps each): the planner then
# trades a long per-warp unroll for more warps.
_MIN_WARPS_PER_SM = 32


def plan_head_group(tokens: int, heads: int, sms: int) -> int:
    """Head pairs per warp for ``tokens`` x ``heads`` on ``sms`` SMs: the largest group that
    still gives every SM enough warps and does not pad the last group by more than a pair."""
    pairs = (heads + 1) // 2
    best = 1
    for group in HEAD_GROUPS[1:]:
        groups = -(-pairs // group)
        if group > pairs or tokens * groups < _MIN_WARPS_PER_SM * sms:
            continue
        if groups * group - pairs > 1:
            continue
        best = group
    return best


def refusal(
    kv_nope: torch.Tensor, k_pe: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> str | None:
    """What the cake programs need beyond the shared fused-path checks (None: servable)."""
    cap = capability(cuda_device_index(kv_nope))
    if cap not in CAPABILITIES:
        return f"compute capability {cap} has no cake build"
    if k_pe.stride(1) != 1 or k_pe.stride(0) % PE_STRIDE_MULTIPLE:
        return f"k_pe rows must be unit-stride with a row stride that is a multiple of {PE_STRIDE_MULTIPLE}"
    if any(t.data_ptr() % ALIGN for t in (kv_nope, k_pe, key, value)):
        return f"a tensor is not {ALIGN}-byte aligned"
    return None


def launch_shape(tokens: int, heads: int, head_group: int) -> tuple[tuple, tuple, int]:
    """(grid, block, groups_per_token) of the program for ``head_group``."""
    groups_per_token = -(-((heads + 1) // 2) // head_group)
    grid = (-(-(tokens * groups_per_token) // WARPS_PER_BLOCK), 1, 1)
    return grid, (32 * WARPS_PER_BLOCK, 1, 1), groups_per_token


def specs() -> list[KernelSpec]:
    """Every cake program: the planner may pick any head group for some token count."""
    return [family.spec((group,)) for group in HEAD_GROUPS]
