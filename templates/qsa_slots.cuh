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
// parameter so the index split is a multiply-shift even for non-power-of-two pages. The
// opt-in qsa_slots_order also sorts the rows for the decode; resolve_slot_list is the
// decode's own (fused) resolution under the same rules.
#pragma once

namespace fij_qsa {

constexpr int kSlotThreads = 256;

// Slot column `column` of row `row` (the body of qsa_slots).
template <int PAGE_SIZE>
__device__ __forceinline__ void slot_of(long long row, int column, const int* __restrict__ indices,
                                        long long idx_row_stride, long long idx_col_stride,
                                        const int* __restrict__ block_table, long long bt_row_stride,
                                        long long bt_col_stride, const int* __restrict__ token_to_req,
                                        long long t2r_stride, int* __restrict__ slots, int topk, int slot_columns,
                                        int table_width, int num_requests, int num_blocks, int offset_bits) {
  if (column >= slot_columns) return;
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

#define FIJ_QSA_SLOT_PARAMS                                                                                    \
  const int *__restrict__ indices, long long idx_row_stride, long long idx_col_stride,                         \
      const int *__restrict__ block_table, long long bt_row_stride, long long bt_col_stride,                   \
      const int *__restrict__ token_to_req, long long t2r_stride, int *__restrict__ slots, int topk,           \
      int slot_columns, int table_width, int num_requests, int num_blocks, int offset_bits
#define FIJ_QSA_SLOT_ARGS                                                                                      \
  indices, idx_row_stride, idx_col_stride, block_table, bt_row_stride, bt_col_stride, token_to_req, t2r_stride, \
      slots, topk, slot_columns, table_width, num_requests, num_blocks, offset_bits

template <int PAGE_SIZE>
__global__ void __launch_bounds__(kSlotThreads) qsa_slots(FIJ_QSA_SLOT_PARAMS) {
  slot_of<PAGE_SIZE>(blockIdx.x, blockIdx.y * kSlotThreads + threadIdx.x, FIJ_QSA_SLOT_ARGS);
}

// The decode's fused slot resolution (SLOT_CAP > 0, templates/qsa_decode.cuh): one CTA's
// entries, same rules as slot_of, into slot_list. Position i is the CTA's local chunk
// i / 16 (global chunk chunk_of(i / 16)), entry i % 16; n_local chunks are read. Each
// thread resolves up to PER entries, all index loads first and then all table lookups (two
// dependent round trips a CTA, not two per entry). ILV (chunk_of needs no count): the index
// loads go out with the count and request loads instead of after them; the host keeps
// every split's entries within SLOT_CAP for any count up to topk.
template <int THREADS, int SLOT_CAP, bool ILV, typename ChunkOf>
__device__ __forceinline__ void resolve_slot_list(int* slot_list, ChunkOf chunk_of, int n_local, int count, int topk,
                                                  const int* __restrict__ irow, long long idx_col_stride,
                                                  const int* __restrict__ block_table, long long bt_row_stride,
                                                  long long bt_col_stride, int table_width, int num_requests,
                                                  int request, int num_blocks, int page_size, int offset_bits) {
  constexpr int PER = (SLOT_CAP + THREADS - 1) / THREADS;
  const bool req_ok = request >= 0 && request < num_requests;
  const int n_tok = ILV ? SLOT_CAP : n_local * 16;
  int logical[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = u * THREADS + threadIdx.x, j = chunk_of(i / 16) * 16 + i % 16;
    if constexpr (ILV) {
      // volatile: the compiler would otherwise sink these loads under the count/request test
      logical[u] = -1;
      if (i < SLOT_CAP && j < topk)
        asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(logical[u]) : "l"(irow + (long long)j * idx_col_stride));
      if (j >= count || !req_ok) logical[u] = -1;
    } else {
      logical[u] = i < n_tok && j < count && req_ok ? __ldg(irow + (long long)j * idx_col_stride) : -1;
    }
  }
  int physical[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int page = logical[u] / page_size;
    physical[u] = logical[u] >= 0 && page < table_width
                      ? __ldg(block_table + (long long)request * bt_row_stride + (long long)page * bt_col_stride)
                      : -1;
  }
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = u * THREADS + threadIdx.x;
    const int offset = logical[u] - (logical[u] / page_size) * page_size;
    if (i < n_tok)
      slot_list[i] = physical[u] >= 0 && physical[u] < num_blocks ? (physical[u] << offset_bits) | offset : -1;
  }
}

// ---- opt-in (kFeatOrder, flashinfer_jit/qsa_variants.py) -------------------------------------
constexpr int kOrderBins = 1024;  // chunk-count keys; longer rows share the last bin

// order[0..rows) = the rows by descending chunk count (a counting sort in one CTA), so the
// decode's CTAs, dispatched in index order, start the longest rows first and the grid's
// last wave is made of short rows (a shorter tail).
__device__ __forceinline__ void row_order(const int* __restrict__ indices, long long idx_row_stride,
                                          long long idx_col_stride, int topk, int rows, int* __restrict__ order) {
  __shared__ int bins[kOrderBins];
  __shared__ int warp_sums[kSlotThreads / 32];
  constexpr int PER = kOrderBins / kSlotThreads;
  const int tid = threadIdx.x, lane = tid & 31;
  auto key = [&](int r) {
    const int count = min(max(__ldg(indices + r * idx_row_stride + (long long)topk * idx_col_stride), 0), topk);
    return min((count + 15) / 16, kOrderBins - 1);
  };
  for (int b = tid; b < kOrderBins; b += kSlotThreads) bins[b] = 0;
  __syncthreads();
#pragma unroll 4
  for (int r = tid; r < rows; r += kSlotThreads) atomicAdd(&bins[key(r)], 1);
  __syncthreads();
  // Exclusive scan in descending key order: thread tid owns keys kOrderBins - 1 - (PER tid + i).
  int local[PER], sum = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    local[i] = bins[kOrderBins - 1 - (PER * tid + i)];
    sum += local[i];
  }
  int incl = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_sums[tid >> 5] = incl;
  __syncthreads();
  int run = incl - sum;
  for (int w = 0; w < (tid >> 5); ++w) run += warp_sums[w];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    bins[kOrderBins - 1 - (PER * tid + i)] = run;
    run += local[i];
  }
  __syncthreads();
#pragma unroll 4
  for (int r = tid; r < rows; r += kSlotThreads) order[atomicAdd(&bins[key(r)], 1)] = r;
}

// The slot pass plus the row order: grid = (rows + 1, column blocks); CTA (0, 0) sorts
// (dispatched first, it overlaps the slot CTAs), CTAs (x >= 1, y) resolve row x - 1.
template <int PAGE_SIZE>
__global__ void __launch_bounds__(kSlotThreads) qsa_slots_order(FIJ_QSA_SLOT_PARAMS, int rows,
                                                                int* __restrict__ order) {
  if (blockIdx.x == 0) {
    if (blockIdx.y == 0) row_order(indices, idx_row_stride, idx_col_stride, topk, rows, order);
    return;
  }
  slot_of<PAGE_SIZE>(blockIdx.x - 1, blockIdx.y * kSlotThreads + threadIdx.x, FIJ_QSA_SLOT_ARGS);
}

#undef FIJ_QSA_SLOT_ARGS
#undef FIJ_QSA_SLOT_PARAMS

}  // namespace fij_qsa
