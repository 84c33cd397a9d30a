// QSA slot pass: translate each row's logical token indices through the page table once,
// for every KV head, into packed physical slots `page << offset_bits | page_offset`.
//
// An entry j of row r is attended when j < min(valid_count, TOPK), the logical index is
// >= 0, its page lies inside the block-table row, the row's request is in
// [0, num_requests), and the physical page is in [0, num_blocks). Every other entry, and
// the padding columns past TOPK (up to slot_columns, a multiple of the decode chunk), is
// written as -1, so the decode kernel needs no other validity information.
//
// grid = (rows [+ 1 with ORDER], ceil(slot_columns / (256 ENTRIES))). A thread resolves
// ENTRIES columns 256 apart (each warp load stays coalesced) with all its loads in flight
// at once: the count, the request and the indices together, then the table lookups, so a
// thread waits for two round trips however many entries it holds. ORDER (the single
// pass): CTA (0, 0) also writes the rows by descending chunk count right after the slots
// (row_order_offset). PAGE_SIZE is a template parameter so the index split is a
// multiply-shift even for non-power-of-two pages. resolve_slot_list is the cluster
// decode's own (fused) resolution under the same rules.
#pragma once
#include "common.cuh"

namespace fij_qsa {

constexpr int kSlotThreads = 256;
constexpr int kOrderBins = 1024;  // chunk-count keys of the row order; longer rows share the last bin

// Programmatic dependent launch (common.cuh): every QSA kernel waits for the preceding
// grid's results before its first global access and then lets its dependents launch.
using fij::grid_dependency_wait;
using fij::grid_dependents_launch;

// A read-only load the compiler may not turn into one predicated on later tests (it would
// otherwise wait for the count before issuing it).
__device__ __forceinline__ int ld_nc_now(const int* p) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// Where the slot pass puts the row order: right after the [rows, slot_columns] slots.
__device__ __forceinline__ long long row_order_offset(int rows, int slot_columns) {
  return (long long)rows * slot_columns;
}

#define FIJ_QSA_SLOT_PARAMS                                                                                    \
  const int *__restrict__ indices, long long idx_row_stride, long long idx_col_stride,                         \
      const int *__restrict__ block_table, long long bt_row_stride, long long bt_col_stride,                   \
      const int *__restrict__ token_to_req, long long t2r_stride, int *__restrict__ slots, int topk,           \
      int slot_columns, int table_width, int num_requests, int num_blocks, int offset_bits

// Slot columns column0 + 256 e (e < ENTRIES) of row `row`.
template <int PAGE_SIZE, int ENTRIES>
__device__ __forceinline__ void slot_entries(long long row, int column0, FIJ_QSA_SLOT_PARAMS) {
  const int* row_indices = indices + row * idx_row_stride;
  int logical[ENTRIES];
#pragma unroll
  for (int e = 0; e < ENTRIES; ++e) {
    const int column = column0 + e * kSlotThreads;
    logical[e] = column < topk ? ld_nc_now(row_indices + (long long)column * idx_col_stride) : -1;
  }
  const int count = min(max(__ldg(row_indices + (long long)topk * idx_col_stride), 0), topk);
  const int request = __ldg(token_to_req + row * t2r_stride);
  const bool request_ok = request >= 0 && request < num_requests;
  int physical[ENTRIES];
#pragma unroll
  for (int e = 0; e < ENTRIES; ++e) {
    if (column0 + e * kSlotThreads >= count || !request_ok) logical[e] = -1;
    const int page = logical[e] / PAGE_SIZE;
    physical[e] = logical[e] >= 0 && page < table_width
                      ? __ldg(block_table + (long long)request * bt_row_stride + (long long)page * bt_col_stride)
                      : -1;
  }
#pragma unroll
  for (int e = 0; e < ENTRIES; ++e) {
    const int column = column0 + e * kSlotThreads;
    const int page = logical[e] / PAGE_SIZE;
    if (column < slot_columns)
      slots[row * slot_columns + column] = physical[e] >= 0 && physical[e] < num_blocks
                                               ? (physical[e] << offset_bits) | (logical[e] - page * PAGE_SIZE)
                                               : -1;
  }
}

// order[0..rows) = the rows by descending chunk count (a counting sort in one CTA), so the
// single pass's CTAs, dispatched in index order, start the longest rows first and the
// grid's last wave is made of short rows (a shorter tail).
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
  const int incl = fij::warp_inclusive_scan(sum);
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

// ORDER: grid.x = rows + 1; CTA (0, 0) sorts (dispatched first, it overlaps the slot CTAs)
// and CTAs (x >= 1, y) resolve row x - 1. Else CTA (x, y) resolves row x.
template <int PAGE_SIZE, bool ORDER, int ENTRIES>
__global__ void __launch_bounds__(kSlotThreads) qsa_slots(FIJ_QSA_SLOT_PARAMS) {
  static_assert(ENTRIES >= 1 && ENTRIES <= 8, "entries per thread");
  grid_dependency_wait();
  grid_dependents_launch();
  long long row = blockIdx.x;
  if constexpr (ORDER) {
    if (row == 0) {
      const int rows = gridDim.x - 1;
      if (blockIdx.y == 0)
        row_order(indices, idx_row_stride, idx_col_stride, topk, rows, slots + row_order_offset(rows, slot_columns));
      return;
    }
    --row;
  }
  slot_entries<PAGE_SIZE, ENTRIES>(row, blockIdx.y * kSlotThreads * ENTRIES + threadIdx.x, indices, idx_row_stride,
                                   idx_col_stride, block_table, bt_row_stride, bt_col_stride, token_to_req,
                                   t2r_stride, slots, topk, slot_columns, table_width, num_requests, num_blocks,
                                   offset_bits);
}

#undef FIJ_QSA_SLOT_PARAMS

// The cluster decode's fused slot resolution (SLOT_CAP > 0, templates/qsa/body.cuh): one
// CTA's entries, same rules as slot_entries, into slot_list. Position i is the CTA's local
// chunk i / 16 (global chunk chunk_of(i / 16), every CLUSTER-th chunk: placed without the
// count), entry i % 16. Each thread resolves up to PER entries, the index loads issued with
// the count and request loads and then all table lookups (two dependent round trips a
// CTA). The host keeps every split's entries within SLOT_CAP for any count up to topk.
template <int THREADS, int SLOT_CAP, typename ChunkOf>
__device__ __forceinline__ void resolve_slot_list(int* slot_list, ChunkOf chunk_of, int count, int topk,
                                                  const int* __restrict__ irow, long long idx_col_stride,
                                                  const int* __restrict__ block_table, long long bt_row_stride,
                                                  long long bt_col_stride, int table_width, int num_requests,
                                                  int request, int num_blocks, int page_size, int offset_bits) {
  constexpr int PER = (SLOT_CAP + THREADS - 1) / THREADS;
  const bool req_ok = request >= 0 && request < num_requests;
  int logical[PER];
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    const int i = u * THREADS + threadIdx.x, j = chunk_of(i / 16) * 16 + i % 16;
    logical[u] = i < SLOT_CAP && j < topk ? ld_nc_now(irow + (long long)j * idx_col_stride) : -1;
    if (j >= count || !req_ok) logical[u] = -1;
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
    if (i < SLOT_CAP)
      slot_list[i] = physical[u] >= 0 && physical[u] < num_blocks ? (physical[u] << offset_bits) | offset : -1;
  }
}

}  // namespace fij_qsa
