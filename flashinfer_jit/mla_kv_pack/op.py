"""``concat_mla_kv_quant_fp8`` as an op of the contract (``flashinfer_jit.contract``):
checks, the backends' refusals, the plan both fused backends launch through, the torch
reference and the specs to prebuild."""

from __future__ import annotations

import dataclasses

import torch

from jit_kernels import KernelSpec, KernelUnavailable, capability, current_stream, sm_count
from jit_kernels.alloc import output_maker
from jit_kernels.launch import PER_CALL

from .._jit import cuda_device_index
from ..contract import Op, Options, ScalarArg, TensorArg
from . import cake, specialized
from .checks import NOPE, ROPE, WORKLOAD_FIELDS, V, check_args, fused_refusal
from .heuristics import WORKLOADS, auto_order, plan_cake, plan_specialized
from .reference import pack_torch

E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class MlaKvPackOptions(Options):
    """Forced plans (benchmarks, tests): the specialized kernel's heads per warp and the
    cake program's head group; None plans them."""

    heads_per_warp: int | None = None
    head_group: int | None = None


class Plan:
    """One fused launch with everything but the four tensors' addresses fixed: ``members``,
    the kernel's flattened arguments with those four PER_CALL, bound once."""

    __slots__ = (
        *("kernel", "grid", "block", "device", "align_mask", "replay", "new_key", "new_value"),
        *("key_bytes", "value_bytes", "go"),
    )

    def __init__(self, kernel, shape: tuple, kv_nope, align: int, members: tuple):
        self.kernel, (self.grid, self.block) = kernel, shape
        self.go = kernel.bind(self.grid, self.block, template=members)
        self.device = cuda_device_index(kv_nope)
        self.align_mask, self.replay = align - 1, True
        tokens, heads, width = kv_nope.shape
        # key and value, as the full path allocates them
        self.new_key = output_maker((tokens, heads, NOPE + ROPE), E4M3, kv_nope.device)
        self.new_value = output_maker((tokens, heads, width - NOPE), E4M3, kv_nope.device)
        rows = tokens * heads  # key and value are rows x (NOPE + ROPE) and rows x V bytes
        self.key_bytes, self.value_bytes = rows * (NOPE + ROPE), rows * V

    def run(
        self, kv_nope, k_pe, key, value, nope_dim: int = NOPE, backend: str = "auto"
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Launch on the current stream (allocating key/value given as None); None, with
        nothing launched, if an address is misaligned or key and value overlap (the full
        path's checks then say so). The metadata and the scalars are this plan's (the replay
        key says so)."""
        if key is None:
            key = self.new_key()
        if value is None:
            value = self.new_value()
        kv, pe, k, v = kv_nope.data_ptr(), k_pe.data_ptr(), key.data_ptr(), value.data_ptr()
        if (kv | pe | k | v) & self.align_mask:
            return None
        if k < v + self.value_bytes and v < k + self.key_bytes:
            return None
        self.go(current_stream(self.device), (kv, pe, k, v))
        return key, value


def plan_specialized_launch(kv_nope, k_pe, heads_per_warp: int | None = None) -> Plan:
    tokens, heads, _ = kv_nope.shape
    kernel = specialized.family.get(specialized.params(heads), cuda_device_index(kv_nope))
    per_warp = plan_specialized(tokens, heads) if heads_per_warp is None else heads_per_warp
    shape = specialized.launch_shape(tokens, heads, per_warp)
    members = (PER_CALL,) * 4 + (tokens, heads, per_warp, k_pe.stride(0))
    return Plan(kernel, shape, kv_nope, specialized.ALIGN, members)


def plan_cake_launch(kv_nope, k_pe, head_group: int | None = None) -> Plan:
    tokens, heads, _ = kv_nope.shape
    device = cuda_device_index(kv_nope)
    group = plan_cake(tokens, heads, sm_count(device)) if head_group is None else head_group
    kernel = cake.family.get((group,), device)
    grid, block, groups_per_token = cake.launch_shape(tokens, heads, group)
    rows, pe_stride = tokens * heads, k_pe.stride(0)
    # kv_nope {ptr; rows}, k_pe {ptr; T; LD}, key {ptr; rows}, value {ptr; rows}
    members = (PER_CALL, rows, PER_CALL, tokens, pe_stride, PER_CALL, rows, PER_CALL, rows)
    members += (tokens, heads, groups_per_token)
    return Plan(kernel, (grid, block), kv_nope, cake.ALIGN, members)


# name -> (its own refusal, its planner from (kv_nope, k_pe, options))
BACKENDS = {
    "specialized": (
        specialized.refusal,
        lambda kv, pe, o: plan_specialized_launch(kv, pe, o.heads_per_warp),
    ),
    "cake": (cake.refusal, lambda kv, pe, o: plan_cake_launch(kv, pe, o.head_group)),
}


class MlaKvPack(Op[Plan, MlaKvPackOptions]):
    name = "mla_kv_pack"
    log_name = custom_op = "concat_mla_kv_quant_fp8"
    workloads = WORKLOADS
    workload_fields = WORKLOAD_FIELDS
    args = (
        TensorArg("kv_nope"),
        TensorArg("k_pe"),
        TensorArg("key", optional=True, mutated=True),
        TensorArg("value", optional=True, mutated=True),
        ScalarArg("nope_dim", "int", NOPE),
        ScalarArg("backend", "str", "auto", typed=False),
    )
    options_type = MlaKvPackOptions

    def prepare(self, args: tuple) -> tuple:
        kv_nope, k_pe, key, value, nope_dim, backend = args
        k_pe = check_args(kv_nope, k_pe, key, value, nope_dim, backend)
        tokens, heads, width = kv_nope.shape
        if key is None:
            shape = (tokens, heads, nope_dim + k_pe.shape[1])
            key = torch.empty(shape, dtype=E4M3, device=kv_nope.device)
        if value is None:
            value = torch.empty(tokens, heads, width - nope_dim, dtype=E4M3, device=kv_nope.device)
        return kv_nope, k_pe, key, value, nope_dim, backend

    def empty(self, args: tuple) -> bool:
        return args[0].shape[0] == 0

    def kernel_call(self, args: tuple) -> bool:
        # The fused backends are built for nope_dim 128; other splits are the torch path's.
        return args[4] == NOPE and args[0].device.type == "cuda"

    def refusal(self, args: tuple) -> str | None:
        reason = fused_refusal(*args[:4])
        return None if reason is None else f"{args[5]} backend: {reason}"

    def plan(self, args: tuple, options: MlaKvPackOptions) -> Plan:
        """The first backend (``auto``: in the policy's order) that serves. Its plan may be
        replayed when every earlier choice is unavailable for the process (its kernel
        refused, remembered by the family), not when one refused this call's addresses: such
        a fallback must not stick."""
        kv_nope, k_pe, backend = args[0], args[1], args[5]
        names = (backend,)
        if backend == "auto":
            cap = capability(cuda_device_index(kv_nope))
            names = auto_order(kv_nope.shape[0], kv_nope.shape[1], cap)
        reasons, sticky = [], True
        for name in names:
            refuse, make_plan = BACKENDS[name]
            why = refuse(*args[:4])
            if why is None:
                try:
                    plan = make_plan(kv_nope, k_pe, options)
                except KernelUnavailable as exc:
                    why = str(exc)
                else:
                    plan.replay = sticky
                    return plan
            else:
                sticky = False
            reasons.append(f"{name}: {why}")
        raise KernelUnavailable(f"{backend} backend: {'; '.join(reasons)}")

    def reference(self, args: tuple) -> None:
        pack_torch(*args[:5])

    def result(self, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return args[2], args[3]

    def prebuild_specs(self, workloads: dict, options: MlaKvPackOptions) -> list[KernelSpec]:
        """Every specialization the shipped workloads can reach, for both fused backends."""
        heads = sorted({int(h) for h in workloads["num_heads"]})
        return specialized.specs(heads) + cake.specs()


OP = MlaKvPack()


@OP.entry()  # the body: the contract's call path (a repeat call replays its plan)
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
