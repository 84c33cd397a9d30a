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
// With split-K the pass also zeroes the decode's per-(row, kv head) completion counters
// (`counters`, null otherwise): the decode of the same call is stream-ordered after it.
#pragma once

namespace fij_qsa {

constexpr int kSlotThreads = 256;

template <int PAGE_SIZE>
__global__ void __launch_bounds__(kSlotThreads)
qsa_slots(const int* __restrict__ indices, long long idx_row_stride, long long idx_col_stride,
          const int* __restrict__ block_table, long long bt_row_stride, long long bt_col_stride,
          const int* __restrict__ token_to_req, long long t2r_stride, int* __restrict__ slots,
          int topk, int slot_columns, int table_width, int num_requests, int num_blocks,
          int offset_bits, unsigned* __restrict__ counters, int num_kv_heads) {
  if (counters != nullptr && blockIdx.y == 0)
    for (int h = threadIdx.x; h < num_kv_heads; h += kSlotThreads) counters[(long long)blockIdx.x * num_kv_heads + h] = 0u;
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

// ---- diagnostic: the decode's gather alone ------------------------------------------------
// Reads every byte the decode kernel would read for the resolved slots (K and V of every kv
// head of every attended token) with plain 16-byte loads, UNROLL in flight per thread, and
// does nothing with them but fold them into one word per thread (so they are not dead).
// tools/bench_qsa.py times it as the ceiling of this access pattern on the device's memory
// system: the decode cannot gather the same pieces faster than this.
// grid = (rows, token slices), block = kSlotThreads.
namespace fij_qsa {

template <int HEAD_DIM>
__global__ void __launch_bounds__(kSlotThreads)
qsa_gather_probe(const unsigned char* __restrict__ k_cache, unsigned k_block, unsigned k_token, unsigned k_head,
                 const unsigned char* __restrict__ v_cache, unsigned v_block, unsigned v_token, unsigned v_head,
                 const int* __restrict__ slots, int slot_columns, const int* __restrict__ counts,
                 long long count_row_stride, int topk, int offset_bits, int num_kv_heads,
                 unsigned* __restrict__ sink) {
  constexpr int PIECES = HEAD_DIM / 16;  // 16-byte pieces of one head's K (or V) row
  constexpr int UNROLL = 8;
  const int row = blockIdx.x;
  const int count = min(max(__ldg(counts + (long long)row * count_row_stride), 0), topk);
  const int per = (count + gridDim.y - 1) / gridDim.y;
  const int t0 = blockIdx.y * per, t1 = min(count, t0 + per);
  const int per_token = num_kv_heads * 2 * PIECES;  // piece fastest, then K/V, then head
  const int n = max(t1 - t0, 0) * per_token;
  const unsigned mask = (1u << offset_bits) - 1u;
  const int* srow = slots + (long long)row * slot_columns;
  unsigned acc = 0;
  for (int base = threadIdx.x; base < n; base += kSlotThreads * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * kSlotThreads;
      v[u] = make_uint4(0, 0, 0, 0);
      if (i < n) {
        const int tok = i / per_token, r = i - tok * per_token;
        const int head = r / (2 * PIECES), kv = (r / PIECES) & 1, piece = r % PIECES;
        const int slot = __ldg(srow + t0 + tok);
        if (slot >= 0) {
          const unsigned s = (unsigned)slot;
          const unsigned char* p =
              kv ? v_cache + (unsigned long long)(s >> offset_bits) * v_block + (unsigned long long)(s & mask) * v_token +
                       (unsigned long long)head * v_head
                 : k_cache + (unsigned long long)(s >> offset_bits) * k_block + (unsigned long long)(s & mask) * k_token +
                       (unsigned long long)head * k_head;
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                       : "l"(p + 16 * piece));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  sink[((long long)row * gridDim.y + blockIdx.y) * kSlotThreads + threadIdx.x] = acc;
}

}  // namespace fij_qsa
