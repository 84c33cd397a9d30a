"""The host launch of the QSA kernels: their arguments, in one place.

``plan.decode_launch`` picks the kernels and launch shapes of a checked call and builds a
``DecodeLaunch``: everything its arguments take from the tensors' metadata is fixed there,
and ``run`` adds the addresses and scales and launches. A repeat eager call with the same
metadata (``flashinfer_jit.contract.Runner``) replays the stored launch through the same
``run``.
"""

from __future__ import annotations

import torch

from jit_kernels import LoadedKernel, current_stream
from jit_kernels.launch import BoundLaunch

LOG2E = 1.4426950408889634  # the decode takes softmax_scale * log2(e) (it uses exp2)


def _launcher(kernel: LoadedKernel, grid: tuple, block: tuple, smem: int, pdl: bool) -> BoundLaunch:
    # PDL (QsaOptions.pdl): every QSA kernel waits for the previous kernel's results
    # (griddepcontrol.wait) before its first global access, so it may be launched early.
    return kernel.bind(grid, block, smem, programmatic=pdl)


class SlotPass:
    """The slot pass of one call's metadata: [rows, columns] int32 packed slots, -1 masked,
    followed (``order``: for the single pass) by the rows in the order the decode takes them
    (``kernel`` None: no columns and no order, nothing to launch)."""

    __slots__ = (
        *("kernel", "launch", "grid", "block", "size", "device", "idx", "table", "t2r", "tail"),
    )

    def __init__(
        self,
        kernel: LoadedKernel | None,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        columns: int,
        logical_indices: torch.Tensor,
        block_table: torch.Tensor,
        token_to_req: torch.Tensor,
        num_blocks: int,
        offset_bits: int,
        order: bool,
        pdl: bool,
    ):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.launch = None if kernel is None else _launcher(kernel, grid, block, 0, pdl)
        rows = logical_indices.shape[0]
        self.size, self.device = rows * columns + rows * order, logical_indices.device
        self.idx, self.table = logical_indices.stride(), block_table.stride()
        self.t2r = token_to_req.stride(0)
        topk = logical_indices.shape[1] - 1
        self.tail = (
            topk,
            columns,
            block_table.shape[1],
            block_table.shape[0],
            num_blocks,
            offset_bits,
        )

    def run(self, idx_ptr: int, table_ptr: int, t2r_ptr: int, stream: int) -> torch.Tensor:
        """Launch on ``stream``; returns the flat buffer (slots, then the order)."""
        slots = torch.empty(self.size, dtype=torch.int32, device=self.device)
        if self.kernel is not None:
            args = (
                idx_ptr, *self.idx, table_ptr, *self.table, t2r_ptr, self.t2r, slots.data_ptr(),
                *self.tail,
            )  # fmt: skip
            self.launch(stream, args)
        return slots


class DecodeLaunch:
    """One decode launch (after its slot pass, if any) with everything but the tensors'
    addresses and the scales fixed by their metadata. ``kv_gap``: 0, or (bulk copies) the
    byte distance from k_cache to v_cache that the kernel relies on."""

    __slots__ = (
        *("kernel", "grid", "block", "smem", "device", "slot_pass", "q", "k", "v", "columns"),
        *("counts", "idx", "out", "gate", "idx_column", "table", "tail", "kv_gap", "launch"),
        "replay",
    )

    def __init__(
        self,
        kernel: LoadedKernel,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        smem: int,
        device: int,
        slot_pass: SlotPass | None,
        columns: int,
        offset_bits: int,
        tensors: tuple[torch.Tensor, ...],
        kv_gap: int,
        pdl: bool,
    ):
        """``tensors``: the call's q, k_cache, v_cache, logical_indices, block_table,
        token_to_req, out and output_gate, whose metadata the launch fixes."""
        q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate = tensors
        self.kernel, self.grid, self.block, self.smem = kernel, grid, block, smem
        self.device, self.slot_pass, self.columns = device, slot_pass, columns
        self.kv_gap, self.replay = kv_gap, True
        self.launch = _launcher(kernel, grid, block, smem, pdl)
        num_blocks, page_size, num_kv_heads, _ = k_cache.shape
        topk = logical_indices.shape[1] - 1
        # byte strides (e4m3: 1 B) of the caches; the count is the indices' last column
        self.q, self.k, self.v = q.stride()[:2], k_cache.stride()[:3], v_cache.stride()[:3]
        self.counts = topk * logical_indices.stride(1) * 4
        self.idx = (logical_indices.stride(0), topk, offset_bits, num_kv_heads)
        self.out, self.gate = out.stride()[:2], output_gate.stride()[:2]
        self.idx_column = logical_indices.stride(1)
        self.table = (*block_table.stride(), block_table.shape[1], block_table.shape[0])
        self.tail = (token_to_req.stride(0), num_blocks, page_size)

    # fmt: off
    def run(self, q, k_cache, v_cache, logical_indices, block_table, token_to_req, out,
            output_gate, softmax_scale: float, output_scale: float,
            dispatch: bool = False) -> torch.Tensor | None:
        # fmt: on
        """Launch for these tensors (this launch's metadata) on the current stream and
        return ``out``; None, with nothing launched, when q, the caches, out or output_gate
        is not 16-byte aligned or (bulk copies) v_cache does not follow k_cache by
        ``kv_gap`` bytes: the kernels' requirements that the metadata does not fix.
        ``dispatch`` (the op's entry-point flag) was decided when this launch was planned."""
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        out_ptr, gate_ptr = out.data_ptr(), output_gate.data_ptr()
        if (q_ptr | k_ptr | v_ptr | out_ptr | gate_ptr) & 15:
            return None
        if self.kv_gap and v_ptr - k_ptr != self.kv_gap:
            return None
        idx_ptr, table_ptr = logical_indices.data_ptr(), block_table.data_ptr()
        t2r_ptr = token_to_req.data_ptr()
        stream = current_stream(self.device)
        slots, slots_ptr = None, 0  # the slots stay referenced until the decode is enqueued
        if self.slot_pass is not None:
            slots = self.slot_pass.run(idx_ptr, table_ptr, t2r_ptr, stream)
            slots_ptr = slots.data_ptr()
        params = (
            q_ptr, *self.q, k_ptr, *self.k, v_ptr, *self.v, slots_ptr, self.columns,
            idx_ptr + self.counts, *self.idx, out_ptr, *self.out, gate_ptr, *self.gate,
            float(softmax_scale) * LOG2E, float(output_scale),
            idx_ptr, self.idx_column, table_ptr, *self.table, t2r_ptr, *self.tail,
        )  # fmt: skip
        self.launch(stream, params)
        return out
