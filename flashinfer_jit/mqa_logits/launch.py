"""The launch of the logits kernels: their arguments, in one place.

``plan.launch_for`` builds a ``Launch`` from a checked call: the ``KernelPlan`` that serves
it and everything the kernel's arguments take from the tensors' metadata; ``run`` adds the
addresses and launches. An eager call that repeats a kernel call's metadata
(``flashinfer_jit.contract.Runner``) replays the stored launch through the same ``run``:
every check of the full path depends only on that metadata, so only the 16-byte alignment
of q and kv_fused is checked again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from jit_kernels import LoadedKernel, current_stream
from jit_kernels.alloc import output_maker
from jit_kernels.launch import PER_CALL

# Pools whose kernel arguments a launch keeps: more than a model's layers (a serving engine
# passes each layer's own pool, so a one-entry memo re-encoded the tensor map every call).
KV_MEMO_POOLS = 512


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The kernel that serves a geometry and its launch shape. ``extra`` is appended to
    every launch's arguments; ``kv_args``, when not None, maps (kv_fused address, kv_fused)
    to the per-pool arguments appended after them (the TMA kernel's tensor map);
    ``programmatic``: a programmatic dependent launch (the kernel waits for the preceding
    grid itself); ``table_prefetch``: None where the kernel takes no table-prefetch
    argument (the TMA kernel's ``table_cols``), else whether the call's block-table
    columns go there (0 otherwise)."""

    kernel: LoadedKernel
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    extra: tuple = ()
    kv_args: Callable[[int, torch.Tensor], tuple] | None = None
    programmatic: bool = False
    table_prefetch: bool | None = None


class Launch:
    """One call's kernel launch with everything but the tensors' addresses fixed."""

    __slots__ = (
        *("kernel", "go", "grid", "block", "smem", "extra", "kv_args", "device", "copy"),
        *("table_stride", "lens_stride", "lens_offset", "out_stride", "batch", "alloc"),
        *("view", "kv_memo", "replay"),
    )

    def __init__(
        self,
        plan: KernelPlan,
        device: int,
        q: torch.Tensor,
        weights: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
        max_seq_len: int,
        lens_offset: int = 0,
    ):
        """``lens_offset``: bytes from the address of the lengths a call passes to the
        lengths the kernel reads (the DeepGEMM surface passes 2-D lengths and the kernel
        reads their newest slot's column in place: flashinfer_jit.deep_gemm)."""
        self.kernel, self.grid, self.block, self.smem = (
            plan.kernel,
            plan.grid,
            plan.block,
            plan.smem,
        )
        self.extra, self.kv_args, self.replay = plan.extra, plan.kv_args, True
        self.device = device
        self.copy = not (q.is_contiguous() and weights.is_contiguous())
        self.table_stride, self.lens_stride = block_tables.stride(0), seq_lens.stride(0)
        self.lens_offset, self.out_stride, self.batch = lens_offset, out.stride(0), q.shape[0]
        # The output a replay with out=None allocates (the full path's allocation).
        self.alloc = output_maker(tuple(out.shape), out.dtype, out.device)
        rows = q.shape[0] * q.shape[1]
        whole = tuple(out.shape) == (rows, max_seq_len)
        self.view = None if whole else ((rows, max_seq_len), out.stride())
        self.kv_memo: dict[int, tuple] = {}  # kv_fused address -> its kv args
        # q, kv_fused, weights, tables, lengths, schedule and out (+ the pool's tensor map)
        # change per call; the strides and the batch are this launch's metadata.
        members = (PER_CALL,) * 4 + (self.table_stride, PER_CALL, self.lens_stride, PER_CALL)
        members += (PER_CALL, self.out_stride, self.batch, *self.extra)
        if plan.table_prefetch is not None:
            members += (block_tables.shape[1] if plan.table_prefetch else 0,)
        members += (PER_CALL,) * (plan.kv_args is not None)
        self.go = plan.kernel.bind(plan.grid, plan.block, plan.smem, plan.programmatic, members)

    # fmt: off
    def run(self, q, kv_fused, weights, block_tables, seq_lens, max_seq_len: int, output_dtype,
            epi_dtype, acc_dtype, schedule: torch.Tensor | None, out: torch.Tensor | None,
            bf16_out: bool = False) -> torch.Tensor | None:
        # fmt: on
        """Launch for these tensors (this launch's metadata; the scalars are its own, the
        replay key says so) on the current stream and return the logits view of ``out``
        (None: allocated here); None, with nothing launched, when q or kv_fused is not
        16-byte aligned."""
        q_ptr, kv_ptr = q.data_ptr(), kv_fused.data_ptr()
        if (q_ptr | kv_ptr) & 15:
            return None
        if self.copy:  # the kernel reads dense q and weights rows
            q, weights = q.contiguous(), weights.contiguous()
            q_ptr = q.data_ptr()
        fresh = out is None
        if fresh:
            out = self.alloc()
        args = (
            q_ptr, kv_ptr, weights.data_ptr(), block_tables.data_ptr(),
            seq_lens.data_ptr() + self.lens_offset, 0 if schedule is None else schedule.data_ptr(),
            out.data_ptr(),
        )  # fmt: skip
        if self.kv_args is not None:  # per-pool arguments (the TMA kernel's tensor map)
            # They depend on the pool's address and metadata only, and this launch fixes
            # the metadata: a serving engine's pools (one a layer) never move, so each
            # pool's are kept (a bounded memo; a dropped one is encoded again).
            kv = self.kv_memo.get(kv_ptr)
            if kv is None:
                if len(self.kv_memo) >= KV_MEMO_POOLS:
                    self.kv_memo.clear()
                kv = self.kv_memo[kv_ptr] = self.kv_args(kv_ptr, kv_fused)
            args += kv
        self.go(current_stream(self.device), args)
        if self.view is None:
            return out
        # The [:rows, :max_seq_len] logits. An allocation of this call that nobody else holds
        # is reshaped in place (as_strided_: the same sizes, strides and padded storage, no
        # second tensor nor view bookkeeping, ~0.4 us less, CPU); a caller's `out` is viewed
        # (as_strided: ~0.4-0.9 us cheaper than slicing, timeit, CPU).
        return out.as_strided_(*self.view) if fresh else out.as_strided(*self.view)
