"""The torch path of ``concat_mla_kv_quant_fp8``: the reference semantics. It serves CPU
tensors and every call the fused backends cannot take."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN = 0x7F


def saturating_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The saturating e4m3 cast, bit-exact on every torch version.

    Round to nearest even; finite overflow and +-inf -> +-448; NaN -> 0x7F. Clamping
    first makes the result independent of whether this torch's cast saturates.
    """
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(torch.isnan(x), torch.full_like(codes, E4M3_NAN), codes)
    return codes.view(torch.float8_e4m3fn)


def pack_torch(kv_nope, k_pe, key, value, nope_dim: int) -> None:
    """Write ``key = [k_nope | k_pe]`` and ``value`` (``k_pe`` as [T, rope])."""
    key[..., :nope_dim].copy_(saturating_e4m3(kv_nope[..., :nope_dim]))
    key[..., nope_dim:].copy_(saturating_e4m3(k_pe).unsqueeze(1).expand_as(key[..., nope_dim:]))
    value.copy_(saturating_e4m3(kv_nope[..., nope_dim:]))
