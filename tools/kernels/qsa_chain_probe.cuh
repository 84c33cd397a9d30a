// QSA diagnostic: the dependent loads of one decode call and nothing else.
// A decode cannot start its K/V reads before it has the selection (logical_indices) and the
// request's block table row, and cannot store before those reads land: three dependent
// trips to memory plus a launch. This kernel makes exactly those trips for the call's
// selected tokens (every K and V row byte, 16-byte loads all in flight at once) and folds
// what it read into one word per (row, kv head). tools/qsa_latency_floor.py times it per call
// in a graph as the latency floor of a call. grid = (rows, kv heads, token slices of
// kChainThreads), one selected token a thread: every trip of every token in flight at once,
// and no reduction across slices (a decode needs one), so no call can be faster. Benchmark
// only, never shipped.
#pragma once

namespace fij_qsa {

constexpr int kChainThreads = 256;

template <int HEAD_DIM>
__global__ void __launch_bounds__(kChainThreads)
qsa_chain_probe(const int* __restrict__ indices, long long index_stride, int topk, const int* __restrict__ token_to_req,
                const int* __restrict__ block_table, long long bt_stride, int page_size,
                const unsigned char* __restrict__ k_cache, long long k_block, long long k_token, long long k_head,
                const unsigned char* __restrict__ v_cache, long long v_block, long long v_token, long long v_head,
                unsigned* __restrict__ sink) {
  constexpr int PIECES = HEAD_DIM / 16;
  __shared__ unsigned folded;
  if (threadIdx.x == 0) folded = 0;
  __syncthreads();
  const int row = blockIdx.x, head = blockIdx.y;
  const int* sel = indices + (long long)row * index_stride;
  const int count = min(max(__ldg(sel + topk), 0), topk);  // trip 1 (with the indices below)
  const int req = __ldg(token_to_req + row);
  unsigned acc = 0;
  const int t = blockIdx.z * kChainThreads + threadIdx.x;
  const int raw = t < topk ? __ldg(sel + t) : -1;  // in flight beside count, not after it
  const int idx = t < count ? raw : -1;
  if (idx >= 0) {
    const long long page = __ldg(block_table + (long long)req * bt_stride + idx / page_size);  // trip 2
    const long long slot = idx % page_size;
    const uint4* k = reinterpret_cast<const uint4*>(k_cache + page * k_block + slot * k_token + head * k_head);
    const uint4* v = reinterpret_cast<const uint4*>(v_cache + page * v_block + slot * v_token + head * v_head);
    uint4 kk[PIECES], vv[PIECES];
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {  // trip 3: the token's K and V rows, all in flight
      kk[p] = __ldg(k + p);
      vv[p] = __ldg(v + p);
    }
#pragma unroll
    for (int p = 0; p < PIECES; ++p) acc ^= kk[p].x ^ kk[p].y ^ kk[p].z ^ kk[p].w ^ vv[p].x ^ vv[p].w;
  }
  atomicXor(&folded, acc);
  __syncthreads();
  if (threadIdx.x == 0) sink[((long long)row * gridDim.y + head) * gridDim.z + blockIdx.z] = folded;
}

}  // namespace fij_qsa
