"""Fused MLA K/V pack with a saturating e4m3 cast: ``concat_mla_kv_quant_fp8``.

    key   = [k_nope | k_pe]  as e4m3   [T, H, nope + rope]
    value = v                as e4m3   [T, H, v]

Read top to bottom: argument checks, which backend can serve the call, the launch,
and the composable torch path, which defines the semantics and serves everything else.
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling as _is_compiling  # one global, not two lookups

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    current_stream,
    fall_back,
    kernels_disabled,
)
from jit_kernels.arch import capability
from jit_kernels.args import require_int, require_no_overlap
from jit_kernels.plan_cache import PlanCache

from . import mla_kv_pack_cake as cake
from . import mla_kv_pack_tuning as tuning
from ._jit import WORKLOAD_ROOT, cuda_device_index, kernel_family

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
    require_int("nope_dim", nope_dim)
    if not isinstance(kv_nope, torch.Tensor) or kv_nope.dim() != 3:
        raise ValueError("kv_nope must be a 3-D tensor [num_tokens, num_heads, nope_dim + v_dim]")
    if not kv_nope.dtype.is_floating_point or kv_nope.dtype == torch.float8_e4m3fn:
        raise TypeError(
            f"kv_nope must be a floating tensor (bf16 for the fused paths), got {kv_nope.dtype}"
        )
    tokens, heads, width = kv_nope.shape
    if not 0 < nope_dim < width:
        raise ValueError(
            f"nope_dim must be in (0, {width}) for kv_nope's last dim {width}, got {nope_dim}"
        )
    if not isinstance(k_pe, torch.Tensor) or k_pe.dim() not in (2, 3):
        raise ValueError("k_pe must be [num_tokens, rope_dim] or [num_tokens, 1, rope_dim]")
    if k_pe.dim() == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(
                f"a 3-D k_pe must be [num_tokens, 1, rope_dim], got {tuple(k_pe.shape)}"
            )
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
    require_no_overlap({"key": key, "value": value}, {"kv_nope": kv_nope, "k_pe": k_pe})
    return k_pe


# -- which fused backend can serve a call --------------------------------------------
def _fused_refusal(kv_nope, k_pe, key, value) -> str | None:
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


def _specialized_refusal(kv_nope, k_pe, key, value) -> str | None:
    """What the specialized kernel needs beyond the shared rules (None when it can serve)."""
    if capability(cuda_device_index(kv_nope)) < (9, 0):
        return "compute capability below 9.0"
    if k_pe.stride(1) != 1 or k_pe.stride(0) % 8:
        return "k_pe rows are not unit-stride with a row stride that is a multiple of 8"
    if any(t.data_ptr() % 16 for t in (kv_nope, k_pe, key, value)):
        return "a tensor is not 16-byte aligned"
    return None


# Measured per-point choices (workloads JSON, "tuned"); the heuristics below fill gaps.
TUNED = tuning.load(WORKLOAD_ROOT / WORKLOADS, cake.HEAD_GROUPS)


def _heads_per_warp(tokens: int, heads: int) -> int:
    # Split the heads of a token over several warps until ~8K warps are in flight, so
    # decode-sized batches still spread over every SM; never below 4 heads a warp.
    chunks = max(1, min(-(-8192 // tokens), -(-heads // 4)))
    return -(-heads // chunks)


def plan_specialized(tokens: int, heads: int) -> int:
    """Heads per warp for the specialized kernel: measured, else the heuristic."""
    tuned = TUNED.get("specialized_heads_per_warp", tokens, heads)
    return min(tuned, heads) if tuned is not None else _heads_per_warp(tokens, heads)


def plan_cake(tokens: int, heads: int) -> int:
    """Head pairs per warp for the cake programs: measured, else the heuristic."""
    tuned = TUNED.get("cake_head_group", tokens, heads)
    return tuned if tuned is not None else cake.plan_head_group(tokens, heads)


def _specialized_params(heads: int) -> tuple[int, int]:
    # 12 local heads (96 over TP8) is the serving shape the fully unrolled variant is
    # for; every other head count shares the runtime-head variant.
    return (12, 6) if heads == 12 else (0, 4)


class Plan:
    """One fused launch with everything but the four tensors' addresses fixed: what the
    fast path replays when a call repeats the shapes, strides, dtypes and device."""

    __slots__ = ("kernel", "grid", "block", "device", "align_mask", "scalars", "cake", "rows")

    def __init__(
        self, kernel, grid, block, device: int, align: int, scalars: tuple, cake_layout: bool
    ):
        self.kernel, self.grid, self.block, self.device = kernel, grid, block, device
        self.align_mask, self.scalars, self.cake = align - 1, scalars, cake_layout
        # tokens * heads: key and value are rows x (NOPE + ROPE) and rows x V bytes
        self.rows = scalars[0] if cake_layout else scalars[0] * scalars[1]

    def args(self, kv: int, pe: int, key: int, value: int) -> tuple:
        """The kernel's arguments for these addresses."""
        if self.cake:  # kv_nope {ptr; rows}, k_pe {ptr; T; LD}, key {ptr; rows}, value {ptr; rows}
            rows, tokens, pe_stride, tail = self.scalars
            return (kv, rows, pe, tokens, pe_stride, key, rows, value, rows, *tail)
        return (kv, pe, key, value, *self.scalars)

    def launch(self, kv: int, pe: int, key: int, value: int) -> bool:
        """Launch on the current stream; False (nothing launched) if an address is misaligned
        or key and value overlap."""
        if (kv | pe | key | value) & self.align_mask:
            return False
        rows = self.rows  # key and value overlapping: the full path's checks say so
        if key < value + rows * V and value < key + rows * (NOPE + ROPE):
            return False
        stream = current_stream(self.device)
        self.kernel.launch(self.grid, self.block, stream, self.args(kv, pe, key, value))
        return True


def _plan_specialized(kv_nope, k_pe, heads_per_warp: int | None = None) -> Plan:
    tokens, heads, _ = kv_nope.shape
    device = cuda_device_index(kv_nope)
    kernel = _specialized.get(_specialized_params(heads), device)
    per_warp = plan_specialized(tokens, heads) if heads_per_warp is None else heads_per_warp
    grid = (-(-tokens // _WARPS_PER_BLOCK), -(-heads // per_warp), 1)
    return Plan(
        kernel,
        grid,
        (32 * _WARPS_PER_BLOCK, 1, 1),
        device,
        16,
        (tokens, heads, per_warp, k_pe.stride(0)),
        False,
    )


def _plan_cake(kv_nope, k_pe, head_group: int | None = None) -> Plan:
    tokens, heads, _ = kv_nope.shape
    group = plan_cake(tokens, heads) if head_group is None else head_group
    device = cuda_device_index(kv_nope)
    kernel, grid, block, groups_per_token = cake.prepare(tokens, heads, group, device)
    return Plan(
        kernel,
        grid,
        block,
        device,
        cake.ALIGN,
        (tokens * heads, tokens, k_pe.stride(0), (tokens, heads, groups_per_token)),
        True,
    )


def _launch(plan: Plan, kv_nope, k_pe, key, value) -> None:
    if not plan.launch(kv_nope.data_ptr(), k_pe.data_ptr(), key.data_ptr(), value.data_ptr()):
        raise ValueError("a tensor is misaligned for the planned kernel")


def _launch_specialized(kv_nope, k_pe, key, value, heads_per_warp: int | None = None) -> None:
    _launch(_plan_specialized(kv_nope, k_pe, heads_per_warp), kv_nope, k_pe, key, value)


# name -> (its own refusal, its planner)
_FUSED = {
    "specialized": (_specialized_refusal, _plan_specialized),
    "cake": (cake.refusal, _plan_cake),
}


# ``auto``'s policy, per compute capability, from kernel times (tools/bench_mla_kv_pack.py,
# back-to-back calls in CUDA graphs, median of interleaved rounds; BENCHMARKS.md).
# sm_90 (H200, measured): the specialized kernel wins with one head at every token count
# (its warp-per-token layout; 131072 x 1: 37.3 vs 43.7 µs) and for calls of at most 16
# tokens (16 x 128: 2.21 vs 2.30 µs); cake wins or ties (within 2.5 %) everywhere else.
# sm_100/sm_103 (not measured here): the seed's rule from GB300/B200 numbers, the fully
# unrolled specialized variant for 12 local heads and cake for every other head count.
_SM90_SPECIALIZED_MAX_TOKENS = 16


def _auto_first(tokens: int, heads: int, cap: tuple[int, int]) -> str:
    if cap == (9, 0):
        return "specialized" if heads == 1 or tokens <= _SM90_SPECIALIZED_MAX_TOKENS else "cake"
    return "specialized" if heads == 12 else "cake"


def auto_order(tokens: int, heads: int, cap: tuple[int, int] = (9, 0)) -> tuple[str, str]:
    """The fused backends in the order ``auto`` tries them on compute capability ``cap``."""
    first = _auto_first(tokens, heads, cap)
    return ("specialized", "cake") if first == "specialized" else ("cake", "specialized")


def _run_fused(backend: str, kv_nope, k_pe, key, value) -> Plan | bool | None:
    """Serve the call with ``backend`` (``auto``: both, in the policy's order).

    Returns the plan that served it when the fast path may replay it (the first choice
    served, or the second because the first's kernel is unavailable in this process:
    a fallback for this call's addresses must not stick), None when the second served
    otherwise, and False, with the reasons reported through ``fall_back``, when none can.
    """
    reason = _fused_refusal(kv_nope, k_pe, key, value)
    if reason is not None:
        fall_back(OP, f"{backend} backend: {reason}")
        return False
    tokens, heads = kv_nope.shape[0], kv_nope.shape[1]
    if backend == "auto":
        names = auto_order(tokens, heads, capability(cuda_device_index(kv_nope)))
    else:
        names = (backend,)
    reasons = []
    sticky = True  # every earlier choice is unavailable for the process (remembered)
    for name in names:
        refuse, make_plan = _FUSED[name]
        why = refuse(kv_nope, k_pe, key, value)
        if why is None:
            try:
                plan = make_plan(kv_nope, k_pe)
            except KernelUnavailable as exc:
                why = str(exc)
            else:
                _launch(plan, kv_nope, k_pe, key, value)
                return plan if sticky else None
        else:
            sticky = False
        reasons.append(f"{name}: {why}")
    fall_back(OP, f"{backend} backend: {'; '.join(reasons)}")
    return False


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads can reach, for both fused backends."""
    heads = sorted({int(h) for h in workloads["num_heads"]})
    specialized = {_specialized.spec(_specialized_params(h)) for h in heads}
    return sorted(specialized, key=str) + cake.specs()


# -- the op ------------------------------------------------------------------------------
# The fast path: a call whose tensors repeat an earlier fused call's shapes, strides,
# dtypes, device, nope_dim and backend replays that call's plan with new addresses,
# skipping the argument checks and planning (a serving engine calls this every step).
# Only the addresses' alignment is checked again; a miss takes the full path. The key
# follows jit_kernels.plan_cache.
_replays: PlanCache[Plan] = PlanCache()


def _signature(kv_nope, k_pe, key, value, nope_dim: int, backend: str) -> tuple | None:
    """The replay key of a call; None: not tensors (the checks say what)."""
    try:
        return (
            (type(nope_dim), nope_dim, backend),
            kv_nope.shape, kv_nope.stride(), kv_nope.dtype, kv_nope.get_device(),
            k_pe.shape, k_pe.stride(), k_pe.dtype, k_pe.get_device(),
            key.shape, key.stride(), key.dtype, key.get_device(),
            value.shape, value.stride(), value.dtype, value.get_device(),
        )  # fmt: skip
    except (AttributeError, TypeError):
        return None


def _concat_impl(kv_nope, k_pe, key, value, nope_dim: int, backend: str) -> Plan | None:
    """Write key/value; return the fused plan the fast path may replay, if any."""
    if kv_nope.shape[0] == 0:
        return None
    if not kernels_disabled() and nope_dim == NOPE and kv_nope.device.type == "cuda":
        plan = _run_fused(backend, kv_nope, k_pe, key, value)
        if plan is not False:
            return plan
    _pack_torch(kv_nope, k_pe, key, value, nope_dim)
    return None


@torch.library.custom_op("flashinfer_jit::concat_mla_kv_quant_fp8", mutates_args=("key", "value"))
def _concat_op(
    kv_nope: torch.Tensor,
    k_pe: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    nope_dim: int,
    backend: str,
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
    compiling = _is_compiling()
    sig = None  # calls that pass both outputs replay (allocating ones never find a plan)
    if key is not None and value is not None and not compiling:
        tensors = (kv_nope, k_pe, key, value)
        plan = _replays.recall((type(nope_dim), nope_dim, backend), tensors)
        if plan is None:
            sig = _signature(kv_nope, k_pe, key, value, nope_dim, backend)
            plan = _replays.get(sig, tensors)
        if plan is not None:
            if plan.launch(kv_nope.data_ptr(), k_pe.data_ptr(), key.data_ptr(), value.data_ptr()):
                return key, value
            if sig is None:  # a recalled plan declined these addresses: the full path decides
                sig = _signature(kv_nope, k_pe, key, value, nope_dim, backend)
    pe2 = _check_args(kv_nope, k_pe, key, value, nope_dim, backend)
    tokens, heads, width = kv_nope.shape
    if key is None:
        key = torch.empty(
            tokens, heads, nope_dim + pe2.shape[1], dtype=torch.float8_e4m3fn, device=kv_nope.device
        )
    if value is None:
        value = torch.empty(
            tokens, heads, width - nope_dim, dtype=torch.float8_e4m3fn, device=kv_nope.device
        )
    if compiling:
        _concat_op(kv_nope, pe2, key, value, nope_dim, backend)
        return key, value
    # Eager calls skip the custom-op dispatcher's host cost.
    plan = _concat_impl(kv_nope, pe2, key, value, nope_dim, backend)
    if plan is not None and sig is not None:
        _replays.put(sig, plan, (kv_nope, k_pe, key, value))
    return key, value
