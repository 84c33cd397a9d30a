"""The ``specialized`` backend of ``concat_mla_kv_quant_fp8``: the NVRTC kernel of
``templates/mla_kv_pack/sm90_warp_cvt.cuh`` (a warp per token, 16-byte loads)."""

from __future__ import annotations

from jit_kernels import I32, I64, PTR, capability

from .._jit import cuda_device_index, kernel_family

WARPS_PER_BLOCK = 8  # kWarpsPerBlock in the template
ALIGN = 16  # bytes; one 16-byte load per lane

family = kernel_family(
    "mla_kv_pack",
    "mla_kv_pack/sm90_warp_cvt.cuh",
    "fij_mla::concat_mla_kv_quant_fp8",
    ("num_heads", "unroll"),
    (
        *(PTR, PTR, PTR, PTR),  # kv_nope, k_pe, key, value
        *(I32, I32, I32),  # num_tokens, num_heads, heads_per_warp
        I64,  # k_pe's row stride
    ),
)


def params(heads: int) -> tuple[int, int]:
    # 12 local heads (96 over TP8) is the serving shape the fully unrolled variant is
    # for; every other head count shares the runtime-head variant.
    return (12, 6) if heads == 12 else (0, 4)


def heads_per_warp(tokens: int, heads: int) -> int:
    # Split the heads of a token over several warps until ~8K warps are in flight, so
    # decode-sized batches still spread over every SM; never below 4 heads a warp.
    chunks = max(1, min(-(-8192 // tokens), -(-heads // 4)))
    return -(-heads // chunks)


def refusal(kv_nope, k_pe, key, value) -> str | None:
    """What the specialized kernel needs beyond the shared rules (None when it can serve)."""
    if capability(cuda_device_index(kv_nope)) < (9, 0):
        return "compute capability below 9.0"
    if k_pe.stride(1) != 1 or k_pe.stride(0) % 8:
        return "k_pe rows are not unit-stride with a row stride that is a multiple of 8"
    if any(t.data_ptr() % ALIGN for t in (kv_nope, k_pe, key, value)):
        return f"a tensor is not {ALIGN}-byte aligned"
    return None


def launch_shape(tokens: int, heads: int, per_warp: int) -> tuple[tuple, tuple]:
    return (-(-tokens // WARPS_PER_BLOCK), -(-heads // per_warp), 1), (32 * WARPS_PER_BLOCK, 1, 1)


def specs(head_counts: list[int]) -> list:
    return sorted({family.spec(params(h)) for h in head_counts}, key=str)
