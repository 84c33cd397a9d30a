"""Argument checks of ``concat_mla_kv_quant_fp8`` and the rules both fused backends share."""

from __future__ import annotations

import torch

from jit_kernels.args import require_int, require_no_overlap

from ..workload_format import Fields, int_list, json_object, one_of

BACKENDS = ("auto", "specialized", "cake")
# The geometry both fused backends are built for (DeepSeek MLA), and their surface.
NOPE, ROPE, V = 128, 64, 128
MAX_HEADS, MAX_TOKENS = 128, 131072


def _check_kv_nope(kv_nope, nope_dim: int) -> None:
    if not isinstance(kv_nope, torch.Tensor) or kv_nope.dim() != 3:
        raise ValueError("kv_nope must be a 3-D tensor [num_tokens, num_heads, nope_dim + v_dim]")
    if not kv_nope.dtype.is_floating_point or kv_nope.dtype.itemsize < 2:  # no fp8 inputs
        raise TypeError(
            "kv_nope must be a floating tensor of 16 bits or more (bf16 for the fused paths), got "
            f"{kv_nope.dtype}"
        )
    width = kv_nope.shape[2]
    if not 0 < nope_dim < width:
        raise ValueError(
            f"nope_dim must be in (0, {width}) for kv_nope's last dim {width}, got {nope_dim}"
        )


def _check_k_pe(k_pe, kv_nope) -> torch.Tensor:
    if not isinstance(k_pe, torch.Tensor) or k_pe.dim() not in (2, 3):
        raise ValueError("k_pe must be [num_tokens, rope_dim] or [num_tokens, 1, rope_dim]")
    if k_pe.dim() == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(
                f"a 3-D k_pe must be [num_tokens, 1, rope_dim], got {tuple(k_pe.shape)}"
            )
        k_pe = k_pe[:, 0]
    if k_pe.shape[0] != kv_nope.shape[0]:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens, kv_nope has {kv_nope.shape[0]}")
    if k_pe.dtype != kv_nope.dtype:
        raise TypeError(f"k_pe dtype {k_pe.dtype} differs from kv_nope's {kv_nope.dtype}")
    if k_pe.device != kv_nope.device:
        raise ValueError(f"k_pe is on {k_pe.device}, kv_nope on {kv_nope.device}")
    return k_pe


def check_args(kv_nope, k_pe, key, value, nope_dim: int, backend: str) -> torch.Tensor:
    """Validate everything; return k_pe as [T, rope]."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    require_int("nope_dim", nope_dim)
    _check_kv_nope(kv_nope, nope_dim)
    k_pe = _check_k_pe(k_pe, kv_nope)
    tokens, heads, width = kv_nope.shape
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
    require_no_overlap({"key": key, "value": value}, {"kv_nope": kv_nope, "k_pe": k_pe})
    return k_pe


def fused_refusal(kv_nope, k_pe, key, value) -> str | None:
    """Why neither fused backend can serve this call (None when the shared rules hold)."""
    if kv_nope.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if kv_nope.dtype != torch.bfloat16:
        return f"dtype {kv_nope.dtype} (fused backends take bfloat16)"
    tokens, heads, width = kv_nope.shape
    if (width, k_pe.shape[1]) != (NOPE + V, ROPE):
        return f"geometry nope+v={width}, rope={k_pe.shape[1]} (fused: {NOPE}+{V}, {ROPE})"
    if not (1 <= heads <= MAX_HEADS and 1 <= tokens <= MAX_TOKENS):
        return f"{tokens} tokens x {heads} heads is outside 1..{MAX_TOKENS} x 1..{MAX_HEADS}"
    if not (kv_nope.is_contiguous() and key.is_contiguous() and value.is_contiguous()):
        return "kv_nope, key or value is not contiguous"
    return None


# The fields of this op's workloads files (flashinfer_jit.workload_format): what prebuild
# compiles for; the rules follow what the fused backends accept.
WORKLOAD_FIELDS: Fields = {
    "num_heads": (True, int_list(1, MAX_HEADS)),
    "num_tokens": (False, int_list(1, MAX_TOKENS)),
    "dtype": (False, one_of("bfloat16")),
    "nope_dim": (False, one_of(NOPE)),
    "rope_dim": (False, one_of(ROPE)),
    "v_dim": (False, one_of(V)),
    "max_heads": (False, one_of(MAX_HEADS)),
    "max_tokens": (False, one_of(MAX_TOKENS)),
    "tuned": (False, json_object),  # measurements; only the shipped file's are used
}
