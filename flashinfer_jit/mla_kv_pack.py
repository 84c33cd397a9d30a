"""Fused MLA K/V pack with a saturating e4m3 cast: ``concat_mla_kv_quant_fp8``.

    key   = [k_nope | k_pe]  as e4m3   [T, H, nope + rope]
    value = v                as e4m3   [T, H, v]

Read top to bottom: argument checks, which backend can serve the call, the launch,
and the composable torch path, which defines the semantics and serves everything else.
"""

from __future__ import annotations

import torch

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    current_stream,
    fall_back,
    kernels_disabled,
)

from ._jit import cuda_device_index, kernel_family

OP = "concat_mla_kv_quant_fp8"
BACKENDS = ("auto", "specialized", "cake")
E4M3_MAX = 448.0
E4M3_NAN = 0x7F

# The geometry both fused backends are built for (DeepSeek MLA), and their surface.
NOPE, ROPE, V = 128, 64, 128
MAX_HEADS, MAX_TOKENS = 128, 131072
WORKLOADS = "mla_kv_pack_fp8_workloads.json"

_WARPS_PER_BLOCK = 8  # kWarpsPerBlock in templates/mla_kv_pack.cuh
_specialized = kernel_family(
    "mla_kv_pack",
    "mla_kv_pack.cuh",
    "fij_mla::concat_mla_kv_quant_fp8",
    ("num_heads", "unroll"),
    ("P", "P", "P", "P", "i", "i", "i", "q"),
)


# -- the composable torch path (reference semantics; CPU tensors; every other call) ------
def saturating_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The saturating e4m3 cast, bit-exact on every torch version.

    Round to nearest even; finite overflow and +-inf -> +-448; NaN -> 0x7F. Clamping
    first makes the result independent of whether this torch's cast saturates.
    """
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(torch.isnan(x), torch.full_like(codes, E4M3_NAN), codes)
    return codes.view(torch.float8_e4m3fn)


def _pack_torch(kv_nope, k_pe, key, value, nope_dim: int) -> None:
    key[..., :nope_dim].copy_(saturating_e4m3(kv_nope[..., :nope_dim]))
    key[..., nope_dim:].copy_(saturating_e4m3(k_pe).unsqueeze(1).expand_as(key[..., nope_dim:]))
    value.copy_(saturating_e4m3(kv_nope[..., nope_dim:]))


# -- argument checks -----------------------------------------------------------------
def _check_args(kv_nope, k_pe, key, value, nope_dim: int, backend: str) -> torch.Tensor:
    """Validate everything; return k_pe as [T, rope]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(kv_nope, torch.Tensor) or kv_nope.dim() != 3:
        raise ValueError("kv_nope must be a 3-D tensor [num_tokens, num_heads, nope_dim + v_dim]")
    if not kv_nope.dtype.is_floating_point or kv_nope.dtype == torch.float8_e4m3fn:
        raise TypeError(f"kv_nope must be a floating tensor (bf16 for the fused paths), got {kv_nope.dtype}")
    tokens, heads, width = kv_nope.shape
    if not 0 < nope_dim < width:
        raise ValueError(f"nope_dim must be in (0, {width}) for kv_nope's last dim {width}, got {nope_dim}")
    if not isinstance(k_pe, torch.Tensor) or k_pe.dim() not in (2, 3):
        raise ValueError("k_pe must be [num_tokens, rope_dim] or [num_tokens, 1, rope_dim]")
    if k_pe.dim() == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(f"a 3-D k_pe must be [num_tokens, 1, rope_dim], got {tuple(k_pe.shape)}")
        k_pe = k_pe[:, 0]
    if k_pe.shape[0] != tokens:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens, kv_nope has {tokens}")
    if k_pe.dtype != kv_nope.dtype:
        raise TypeError(f"k_pe dtype {k_pe.dtype} differs from kv_nope's {kv_nope.dtype}")
    if k_pe.device != kv_nope.device:
        raise ValueError(f"k_pe is on {k_pe.device}, kv_nope on {kv_nope.device}")
    rope = k_pe.shape[1]
    for name, out, last in (("key", key, nope_dim + rope), ("value", value, width - nope_dim)):
        if out is None:
            continue
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (tokens, heads, last):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"{name} must have shape {(tokens, heads, last)}, got {got}")
        if out.dtype != torch.float8_e4m3fn:
            raise TypeError(f"{name} must be torch.float8_e4m3fn, got {out.dtype}")
        if out.device != kv_nope.device:
            raise ValueError(f"{name} is on {out.device}, kv_nope on {kv_nope.device}")
    return k_pe


# -- which fused backend can serve a call --------------------------------------------
def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def _specialized_refusal(kv_nope, k_pe, key, value) -> str | None:
    """Why the specialized kernel cannot serve this call (None when it can)."""
    if kv_nope.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if torch.cuda.get_device_capability(kv_nope.device) < (9, 0):
        return "compute capability below 9.0"
    if kv_nope.dtype != torch.bfloat16:
        return f"dtype {kv_nope.dtype} (fused backends take bfloat16)"
    tokens, heads, width = kv_nope.shape
    if (width, k_pe.shape[1]) != (NOPE + V, ROPE):
        return f"geometry nope+v={width}, rope={k_pe.shape[1]} (fused: {NOPE}+{V}, {ROPE})"
    if not (1 <= heads <= MAX_HEADS and 1 <= tokens <= MAX_TOKENS):
        return f"{tokens} tokens x {heads} heads is outside 1..{MAX_TOKENS} x 1..{MAX_HEADS}"
    if not (kv_nope.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        return "kv_nope, key or value is not contiguous"
    if k_pe.stride(1) != 1 or k_pe.stride(0) % 8:
        return "k_pe rows are not unit-stride with a row stride that is a multiple of 8"
    if not all(_aligned(t, 16) for t in (kv_nope, k_pe, key, value)):
        return "a tensor is not 16-byte aligned"
    return None


def _heads_per_warp(tokens: int, heads: int) -> int:
    # Split the heads of a token over several warps until ~8K warps are in flight, so
    # decode-sized batches still spread over every SM; never below 4 heads a warp.
    chunks = max(1, min(-(-8192 // tokens), -(-heads // 4)))
    return -(-heads // chunks)


def _specialized_params(heads: int) -> tuple[int, int]:
    # 12 local heads (96 over TP8) is the serving shape the fully unrolled variant is
    # for; every other head count shares the runtime-head variant.
    return (12, 6) if heads == 12 else (0, 4)


def _launch_specialized(kv_nope, k_pe, key, value) -> None:
    tokens, heads, _ = kv_nope.shape
    device = cuda_device_index(kv_nope)
    kernel = _specialized.get(_specialized_params(heads), device)
    per_warp = _heads_per_warp(tokens, heads)
    grid = (-(-tokens // _WARPS_PER_BLOCK), -(-heads // per_warp), 1)
    args = (
        kv_nope.data_ptr(), k_pe.data_ptr(), key.data_ptr(), value.data_ptr(),
        tokens, heads, per_warp, k_pe.stride(0),
    )
    kernel.launch(grid, (32 * _WARPS_PER_BLOCK, 1, 1), current_stream(device), args)


def _run_fused(backend: str, kv_nope, k_pe, key, value) -> bool:
    """Try ``backend``; False (with the reason logged once) when it cannot serve."""
    reason = _specialized_refusal(kv_nope, k_pe, key, value)
    if reason is None:
        try:
            _launch_specialized(kv_nope, k_pe, key, value)
            return True
        except KernelUnavailable as exc:
            reason = str(exc)
    fall_back(OP, f"{backend} backend: {reason}")
    return False


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads can reach."""
    heads = sorted({int(h) for h in workloads["num_heads"]})
    return sorted({_specialized.spec(_specialized_params(h)) for h in heads}, key=str)


# -- the op ------------------------------------------------------------------------------
def _concat_impl(kv_nope, k_pe, key, value, nope_dim: int, backend: str) -> None:
    if kv_nope.shape[0] == 0:
        return
    if not kernels_disabled() and nope_dim == NOPE and kv_nope.device.type == "cuda":
        if _run_fused(backend, kv_nope, k_pe, key, value):
            return
    _pack_torch(kv_nope, k_pe, key, value, nope_dim)


@torch.library.custom_op("flashinfer_jit::concat_mla_kv_quant_fp8", mutates_args=("key", "value"))
def _concat_op(
    kv_nope: torch.Tensor, k_pe: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    nope_dim: int, backend: str,
) -> None:
    _concat_impl(kv_nope, k_pe, key, value, nope_dim, backend)


@_concat_op.register_fake
def _(kv_nope, k_pe, key, value, nope_dim, backend) -> None:
    return None


def concat_mla_kv_quant_fp8(
    kv_nope: torch.Tensor,
    k_pe: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    *,
    nope_dim: int = 128,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``kv_nope = [k_nope | v]`` and the shared ``k_pe`` into e4m3 ``(key, value)``.

    ``key``/``value`` given by the caller are written in place and returned; otherwise
    they are allocated. Results are bit-exact across backends and the torch path.
    """
    k_pe = _check_args(kv_nope, k_pe, key, value, nope_dim, backend)
    tokens, heads, width = kv_nope.shape
    if key is None:
        key = torch.empty(tokens, heads, nope_dim + k_pe.shape[1], dtype=torch.float8_e4m3fn, device=kv_nope.device)
    if value is None:
        value = torch.empty(tokens, heads, width - nope_dim, dtype=torch.float8_e4m3fn, device=kv_nope.device)
    if torch.compiler.is_compiling():
        _concat_op(kv_nope, k_pe, key, value, nope_dim, backend)
    else:  # eager calls skip the custom-op dispatcher's host cost
        _concat_impl(kv_nope, k_pe, key, value, nope_dim, backend)
    return key, value
