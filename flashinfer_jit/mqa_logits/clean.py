"""DeepGEMM's ``clean_logits`` for flashinfer_jit.deep_gemm: -inf at every position past
each output row's visible length, up to max_context_len. One small kernel writes only
those positions (templates/mqa_logits/sm90_clean_fill.cuh); the torch path (CPU tensors, no
kernel) masks the same positions."""

from __future__ import annotations

import torch

from jit_kernels import (
    I32,
    I64,
    PTR,
    KernelSpec,
    KernelUnavailable,
    current_stream,
    fall_back,
    kernels_disabled,
)

from .._jit import cuda_device_index, kernel_family

OP = "clean_logits"
_THREADS = 256  # the kernel's block (its __launch_bounds__ and stride)
CLEAN_DTYPES = (torch.float32, torch.bfloat16)

clean_family = kernel_family(
    "mqa_logits_clean",
    "mqa_logits/sm90_clean_fill.cuh",
    "fij_mqa::clean_logits",
    ("output_dtype",),
    (PTR, I64, I64, I32, I32, PTR, I64, I32),  # lens {ptr; strides}, 2-D?, next_n, logits
)


def clean_specs() -> list[KernelSpec]:
    return [clean_family.spec((dtype,)) for dtype in CLEAN_DTYPES]


def visible(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Per output row, how many leading positions it sees (int64 [B * next_n], >= 0)."""
    if context_lens.dim() == 2:
        return context_lens.reshape(-1).long().clamp_min(0)
    t = torch.arange(next_n, device=context_lens.device)
    return (context_lens.long()[:, None] - next_n + 1 + t).reshape(-1).clamp_min(0)


def clean_logits(logits: torch.Tensor, context_lens: torch.Tensor, next_n: int) -> None:
    """Write -inf into ``logits`` [B * next_n, max_context_len] (rows dense, any row stride)
    past each row's visible length; graph-capturable."""
    rows, cols = logits.shape
    if rows == 0 or cols == 0:
        return
    if logits.is_cuda and not kernels_disabled():
        try:
            kernel = clean_family.get((logits.dtype,), cuda_device_index(logits))
            two_d = context_lens.dim() == 2
            args = (
                context_lens.data_ptr(), context_lens.stride(0), context_lens.stride(1) if two_d else 0,
                int(two_d), next_n, logits.data_ptr(), logits.stride(0), cols,
            )  # fmt: skip
            stream = current_stream(cuda_device_index(logits))
            kernel.launch((rows, 1, 1), (_THREADS, 1, 1), stream, args)
            return
        except KernelUnavailable as exc:
            fall_back(OP, str(exc))
    positions = torch.arange(cols, device=logits.device)
    logits.masked_fill_(positions[None, :] >= visible(context_lens, next_n)[:, None], float("-inf"))
