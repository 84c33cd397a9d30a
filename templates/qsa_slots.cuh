// QSA slot pass: translate each row's logical token indices through the page table once,
// for every KV head, into packed physical slots `page << offset_bits | page_offset`.
//
// An entry j of row r is attended when j < min(valid_count, TOPK), the logical index is
// >= 0, its page lies inside the block-table row, the row's request is in
// [0, num_requests), and the physical page is in [0, num_blocks). Every other entry, and
// the padding columns past TOPK (up to slot_columns, a multiple of the decode chunk), is
// written as -1, so the decode kernel needs no other validity information.
//
// One thread per column; grid = (rows, ceil(slot_columns / 256)). PAGE_SIZE is a template
// parameter so the index split is a multiply-shift even for non-power-of-two pages.
#pragma once

namespace fij_qsa {

constexpr int kSlotThreads = 256;

template <int PAGE_SIZE>
__global__ void __launch_bounds__(kSlotThreads)
qsa_slots(const int* __restrict__ indices, long long idx_row_stride, long long idx_col_stride,
          const int* __restrict__ block_table, long long bt_row_stride, long long bt_col_stride,
          const int* __restrict__ token_to_req, long long t2r_stride, int* __restrict__ slots,
          int topk, int slot_columns, int table_width, int num_requests, int num_blocks,
          int offset_bits) {
  const int column = blockIdx.y * kSlotThreads + threadIdx.x;
  if (column >= slot_columns) return;
  const long long row = blockIdx.x;
  const int* row_indices = indices + row * idx_row_stride;
  const int count = min(max(__ldg(row_indices + (long long)topk * idx_col_stride), 0), topk);
  const int request = __ldg(token_to_req + row * t2r_stride);
  int slot = -1;
  if (column < count && request >= 0 && request < num_requests) {
    const int logical = __ldg(row_indices + (long long)column * idx_col_stride);
    if (logical >= 0) {
      const int page = logical / PAGE_SIZE;
      if (page < table_width) {
        const int physical =
            __ldg(block_table + (long long)request * bt_row_stride + (long long)page * bt_col_stride);
        if (physical >= 0 && physical < num_blocks)
          slot = (physical << offset_bits) | (logical - page * PAGE_SIZE);
      }
    }
  }
  slots[row * slot_columns + column] = slot;
}

}  // namespace fij_qsa
