"""``fp8_paged_mqa_logits`` as an op of the contract (``flashinfer_jit.contract``).

logits[b*next_n + t, pos] = scale[pos] * sum_h weights[b*next_n + t, h] * relu(q[b,t,h] . k[pos])
"""

from __future__ import annotations

from pathlib import Path

import torch

from jit_kernels import MIN_CAPABILITY, KernelSpec, capability, validate_values
from jit_kernels.args import require_no_overlap

from .._jit import cuda_device_index
from ..contract import Op, ScalarArg, TensorArg
from .checks import (
    WORKLOAD_FIELDS,
    check_args,
    check_dtypes,
    check_out,
    check_schedule,
    check_workload_rows,
    padded_seq_len,
    validate_preconditions,
)
from .launch import Launch
from .plan import MqaLogitsOptions, launch_for, prebuild_specs, prebuilt_on
from .reference import paged_mqa_logits_torch
from .schedule import check_current


class MqaLogits(Op[Launch, MqaLogitsOptions]):
    name = "mqa_logits"
    log_name = custom_op = "fp8_paged_mqa_logits"
    workloads = Path(__file__).parent / "workloads.json"
    workload_fields = WORKLOAD_FIELDS
    # The kernels read q, kv_fused and weights densely: only their density is in the key.
    args = (
        *(TensorArg(n, dense=True) for n in ("q", "kv_fused", "weights")),
        TensorArg("block_tables"),
        TensorArg("seq_lens"),
        ScalarArg("max_seq_len", "int"),
        *(
            ScalarArg(n, "ScalarType", torch.float32, typed=False)
            for n in ("output_dtype", "epi_dtype", "acc_dtype")
        ),
        TensorArg("schedule_meta", optional=True),
        TensorArg("out", optional=True, mutated=True),
        # bfloat16 logits: the DeepGEMM surface's (flashinfer_jit.deep_gemm), rounded once
        # from the float32 epilogue; the seed's entry point passes False and refuses them.
        ScalarArg("bf16_out", "bool", False, typed=False),
    )
    options_type = MqaLogitsOptions

    def prepare(self, args: tuple) -> tuple:
        q, kv_fused, weights, block_tables, seq_lens, max_seq_len = args[:6]
        output_dtype, schedule_meta, out = args[6], args[9], args[10]
        check_dtypes(*args[6:9], args[11])
        batch, next_n, _, _, block_size = check_args(
            q, kv_fused, weights, block_tables, seq_lens, max_seq_len
        )
        rows, cols = batch * next_n, padded_seq_len(max_seq_len)
        if out is not None:
            check_out(out, rows, cols, output_dtype, q.device)
            inputs = dict(q=q, kv_fused=kv_fused, weights=weights, block_tables=block_tables,
                          seq_lens=seq_lens, schedule_meta=schedule_meta)  # fmt: skip
            require_no_overlap({"out": out}, inputs)
        else:
            out = torch.empty(rows, cols, dtype=output_dtype, device=q.device)
        if schedule_meta is not None:
            check_schedule(schedule_meta, q.device)
        if validate_values(q.device):
            validate_preconditions(kv_fused, block_tables, seq_lens, max_seq_len, block_size)
            if schedule_meta is not None:
                check_current(schedule_meta, seq_lens)
        return (*args[:10], out, args[11])

    def empty(self, args: tuple) -> bool:
        return args[0].shape[0] == 0 or args[5] == 0

    def check_workloads(self, data: dict, where: str) -> None:
        check_workload_rows(data, where)

    def refusal(self, args: tuple) -> str | None:
        q, kv_fused = args[0], args[1]
        if capability(cuda_device_index(q)) < MIN_CAPABILITY:
            return "compute capability below 9.0 (the kernels use Hopper's features)"
        if kv_fused.data_ptr() % 16 or q.data_ptr() % 16:
            return "kv_fused or q is not 16-byte aligned"
        if kv_fused.shape[0] == 0:  # no tensor map to encode (every length is 0 then)
            return "kv_fused has no blocks"
        return None

    def plan(self, args: tuple, options: MqaLogitsOptions) -> Launch:
        return launch_for(args, options)

    def reference(self, args: tuple) -> None:
        q, kv_fused, weights, block_tables, seq_lens = args[:5]
        epi_dtype, acc_dtype, out = args[7], args[8], args[10]
        paged_mqa_logits_torch(
            q, kv_fused, weights, block_tables, seq_lens, out, epi_dtype, acc_dtype
        )

    def result(self, args: tuple) -> torch.Tensor:
        out, rows, max_seq_len = args[10], args[0].shape[0] * args[0].shape[1], args[5]
        # A view of the whole of `out` is `out` itself: skip the slicing (~2 us of host time).
        return out if out.shape == (rows, max_seq_len) else out[:rows, :max_seq_len]

    def prebuild_specs(self, workloads: dict, options: MqaLogitsOptions) -> list[KernelSpec]:
        return prebuild_specs(workloads)

    def prebuilt_on(self, spec: KernelSpec, arch: str) -> bool:
        return prebuilt_on(spec, arch)


OP = MqaLogits()
_run = OP.default.run  # the shipped options' call path


@OP.entry(bf16_out=False)  # the body: the contract's call path (a repeat call replays)
def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_fused: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    output_dtype: torch.dtype = torch.float32,
    epi_dtype: torch.dtype = torch.float32,
    acc_dtype: torch.dtype = torch.float32,
    schedule_meta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted per-head ReLU scores of ``q`` against a paged FP8 KV pool.

    Returns the ``[batch_size*next_n, max_seq_len]`` view of ``out`` (or of an internal
    ``[batch_size*next_n, padded_seq_len(max_seq_len)]`` allocation). Row b*next_n + t is
    valid for positions 0 .. seq_lens[b] - next_n + t; the rest is unspecified, and rows of
    requests with seq_lens[b] == 0 are never written.
    """


def paged_logits(*args) -> torch.Tensor:
    """``fp8_paged_mqa_logits`` with every argument positional and ``bf16_out`` last (the
    DeepGEMM surface, flashinfer_jit.deep_gemm, admits bfloat16 logits)."""
    return _run(args)
