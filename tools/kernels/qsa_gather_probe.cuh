// QSA diagnostic: the decode's gather alone.
// Reads every byte the decode kernel would read for the resolved slots (K and V of every kv
// head of every attended token) with plain 16-byte loads, UNROLL in flight per thread, and
// does nothing with them but fold them into one word per thread (so they are not dead).
// tools/bench_qsa.py times it as the ceiling of this access pattern on the device's memory
// system: the decode cannot gather the same pieces faster than this.
// grid = (rows, token slices), block = kProbeThreads. Benchmark only (tools/bench_qsa.py).
#pragma once

namespace fij_qsa {

constexpr int kProbeThreads = 256;

template <int HEAD_DIM>
__global__ void __launch_bounds__(kProbeThreads)
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
  for (int base = threadIdx.x; base < n; base += kProbeThreads * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int i = base + u * kProbeThreads;
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
  sink[((long long)row * gridDim.y + blockIdx.y) * kProbeThreads + threadIdx.x] = acc;
}

}  // namespace fij_qsa
