"""Fused MLA K/V pack with a saturating e4m3 cast: ``concat_mla_kv_quant_fp8``.

    key   = [k_nope | k_pe]  as e4m3   [T, H, nope + rope]
    value = v                as e4m3   [T, H, v]

``op`` is the op (checks, backends, plan, launch); ``checks``, ``specialized`` (the NVRTC
kernel), ``cake`` (the CuTe-DSL programs), ``heuristics`` and ``tuning`` (which backend
and plan), and ``reference`` (the torch path, which defines the semantics).
"""

from .checks import BACKENDS, MAX_HEADS, MAX_TOKENS
from .heuristics import WORKLOADS, auto_order, plan_cake, plan_specialized
from .op import OP, MlaKvPackOptions, concat_mla_kv_quant_fp8
from .reference import saturating_e4m3

__all__ = [
    "BACKENDS",
    "MAX_HEADS",
    "MAX_TOKENS",
    "OP",
    "WORKLOADS",
    "MlaKvPackOptions",
    "auto_order",
    "concat_mla_kv_quant_fp8",
    "plan_cake",
    "plan_specialized",
    "saturating_e4m3",
]
