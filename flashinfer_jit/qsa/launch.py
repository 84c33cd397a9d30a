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
from jit_kernels.alloc import Scratch, raw_allocator
from jit_kernels.launch import PER_CALL, BoundLaunch

LOG2E = 1.4426950408889634  # the decode takes softmax_scale * log2(e) (it uses exp2)


def _launcher(
    kernel: LoadedKernel, grid: tuple, block: tuple, smem: int, pdl: bool, members: tuple
) -> BoundLaunch:
    # PDL (QsaOptions.pdl): every QSA kernel waits for the previous kernel's results
    # (griddepcontrol.wait) before its first global access, so it may be launched early.
    return kernel.bind(grid, block, smem, pdl, members)


class SlotPass:
    """The slot pass of one call's metadata: [rows, columns] int32 packed slots, -1 masked,
    followed (``order``: for the single pass) by the rows in the order the decode takes them
    (``kernel`` None: no columns and no order, nothing to launch)."""

    __slots__ = ("kernel", "launch", "grid", "block", "size", "device")

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
        rows, topk = logical_indices.shape[0], logical_indices.shape[1] - 1
        self.size, self.device = rows * columns + rows * order, logical_indices.device
        # The indices, table, token_to_req and slots addresses change per call.
        members = (PER_CALL, *logical_indices.stride(), PER_CALL, *block_table.stride())
        members += (PER_CALL, token_to_req.stride(0), PER_CALL, topk, columns)
        members += (block_table.shape[1], block_table.shape[0], num_blocks, offset_bits)
        self.launch = None if kernel is None else _launcher(kernel, grid, block, 0, pdl, members)

    def run(self, idx_ptr: int, table_ptr: int, t2r_ptr: int, stream: int) -> torch.Tensor:
        """Launch on ``stream``; returns the flat buffer (slots, then the order)."""
        slots = torch.empty(self.size, dtype=torch.int32, device=self.device)
        if self.launch is not None:
            self.launch(stream, (idx_ptr, table_ptr, t2r_ptr, slots.data_ptr()))
        return slots


class DecodeLaunch:
    """One decode launch (after its slot pass, if any) with everything but the tensors'
    addresses and the scales fixed by their metadata. ``kv_gap``: 0, or (bulk copies) the
    byte distance from k_cache to v_cache that the kernel relies on."""

    __slots__ = (
        *("kernel", "grid", "block", "smem", "device", "slot_pass", "slot_launch", "slots"),
        *("counts", "kv_gap", "launch", "replay"),
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
        self.device, self.slot_pass, self.kv_gap, self.replay = device, slot_pass, kv_gap, True
        # The slot pass's launch (None: nothing to launch) and its buffer, scratch memory
        # of this call's launches (None: no buffer, the decode gets address 0).
        self.slot_launch = None if slot_pass is None else slot_pass.launch
        self.slots = None
        if slot_pass is not None and slot_pass.size:
            where = slot_pass.device
            self.slots = Scratch(4 * slot_pass.size, where, device, raw_allocator(where))
        num_blocks, page_size, num_kv_heads, _ = k_cache.shape
        topk = logical_indices.shape[1] - 1
        self.counts = topk * logical_indices.stride(1) * 4  # the indices' last column
        # Per call: the addresses (the slots', the counts') and the scales; the rest is
        # metadata: byte strides (e4m3: 1 B) of the caches, the indices' and table's.
        members = (PER_CALL, *q.stride()[:2], PER_CALL, *k_cache.stride()[:3], PER_CALL)
        members += (*v_cache.stride()[:3], PER_CALL, columns, PER_CALL)
        members += (logical_indices.stride(0), topk, offset_bits, num_kv_heads, PER_CALL)
        members += (*out.stride()[:2], PER_CALL, *output_gate.stride()[:2], PER_CALL, PER_CALL)
        members += (PER_CALL, logical_indices.stride(1), PER_CALL, *block_table.stride())
        members += (block_table.shape[1], block_table.shape[0], PER_CALL)
        members += (token_to_req.stride(0), num_blocks, page_size)
        self.launch = _launcher(kernel, grid, block, smem, pdl, members)

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
        # The slot pass and the decode inline, not through SlotPass.run: a frame and a
        # slots tensor less per call (its memory is the allocator's all the same, Scratch).
        scratch, slots, held = self.slots, 0, None
        if scratch is not None:
            slots, held = scratch.take(stream)
        try:
            if self.slot_launch is not None:
                self.slot_launch(stream, (idx_ptr, table_ptr, t2r_ptr, slots))
            params = (
                q_ptr, k_ptr, v_ptr, slots, idx_ptr + self.counts, out_ptr, gate_ptr,
                float(softmax_scale) * LOG2E, float(output_scale), idx_ptr, table_ptr, t2r_ptr,
            )  # fmt: skip
            self.launch(stream, params)
        finally:  # the launches are enqueued (or one failed): the buffer goes back
            if scratch is not None:
                scratch.give(slots, held)
        return out
