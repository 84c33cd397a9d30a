// QSA diagnostics: the decode's gather alone. Two probes, benchmark only, never shipped:
// qsa_gather_probe (below, tools/bench_qsa.py: slots resolved beforehand) and
// qsa_paged_gather_probe (further down, tools/qsa_gather_floor.py: the whole call's bytes).
//
// qsa_gather_probe: reads every byte the decode kernel would read for the resolved slots
// (K and V of every kv head of every attended token) with plain 16-byte loads, UNROLL in
// flight per thread, and does nothing with them but fold them into one word per thread (so they are not dead).
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

// ---------------------------------------------------------------------------------------
// qsa_paged_gather_probe: the measured gather floor of a whole decode call
// (tools/qsa_gather_floor.py). It moves every byte tools/qsa_bench_util.floor_us counts, in
// the call's own pattern and from the call's own arguments (no slots resolved beforehand):
// the selection and its count, the block-table entry of every selected token, that token's K
// and V rows of every kv head, and each row's q and gate in and out back. No math: the K/V
// words fold into one word a warp (the sink), out gets q ^ gate. Built for bandwidth, not
// latency:
// - grid = (token chunks of kGatherTokens, rows, 1 or (SPLIT_HEADS) Hkv), not a persistent
//   grid: each warp takes 32
//   consecutive tokens of one row, so its selection is one coalesced load and the count is
//   the row's, with no (row, token) division per piece; the block scheduler balances the
//   CTAs (those past a row's count only take their share of q, gate and out), and the many
//   waves of them at the byte floors the tool times (>= 50 us) keep the launch's tail small.
//   SPLIT_HEADS gives each kv head its CTAs (each resolves its tokens again, from L2): small
//   calls over several kv heads then have every head's loads in flight at once instead of
//   one head after another; the tool times both layouts and takes the faster.
// - each lane resolves one token (selection -> block table: two dependent trips, paid once
//   per 32 tokens), then the warp streams the tokens' rows head by head with the addresses
//   shuffled from the owning lane: UNIT adjacent lanes on the UNIT adjacent 16-byte pieces
//   of one (token, head)'s K row and then its V row (in the serving layout V follows K:
//   2*HEAD_DIM contiguous bytes), the next UNIT lanes on the next token. Each lane's piece,
//   K or V, is fixed, so a piece's address is two shuffles and two multiply-adds.
// - kGatherUnroll independent 16-byte loads a lane before any is used (ld.global.nc, no L1
//   allocation: nothing is read twice); about 50 registers let 9 CTAs share an SM, so up to
//   144 KB an SM in flight, several times what HBM's latency asks for (4.24 TB/s x ~1 us
//   over 132 SMs: ~32 KB).
constexpr int kGatherWarps = 4;
constexpr int kGatherTokens = 32 * kGatherWarps;  // a lane per token, a CTA per chunk
constexpr int kGatherUnroll = 8;

__device__ __forceinline__ uint4 gather_load(const unsigned char* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int HEAD_DIM, bool SPLIT_HEADS>
__global__ void __launch_bounds__(kGatherTokens)
qsa_paged_gather_probe(const int* __restrict__ indices, long long index_stride, int topk,
                       const int* __restrict__ token_to_req, const int* __restrict__ block_table,
                       long long bt_stride, int page_size, int num_kv_heads,
                       const unsigned char* __restrict__ k_cache, long long k_block, long long k_token, long long k_head,
                       const unsigned char* __restrict__ v_cache, long long v_block, long long v_token, long long v_head,
                       const uint4* __restrict__ q, const uint4* __restrict__ gate, uint4* __restrict__ out,
                       int row_pieces, unsigned* __restrict__ sink) {
  constexpr int PIECES = HEAD_DIM / 16;  // 16-byte pieces of one head's K (or V) row
  constexpr int UNIT = 2 * PIECES;       // lanes on one (token, head): its K row, then V
  constexpr int PER_LOAD = 32 / UNIT;    // tokens one warp-wide load covers
  static_assert(HEAD_DIM % 16 == 0 && 32 % UNIT == 0, "head_dim 16, 32, 64, 128 or 256");
  const int row = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The row's q and gate in, out back (contiguous rows), shared out over the row's CTAs.
  for (int i = blockIdx.x * kGatherTokens + threadIdx.x; blockIdx.z == 0 && i < row_pieces;
       i += gridDim.x * kGatherTokens) {
    const long long at = (long long)row * row_pieces + i;
    const uint4 a = __ldg(q + at), b = __ldg(gate + at);
    out[at] = make_uint4(a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w);
  }
  const int* sel = indices + (long long)row * index_stride;
  const int t0 = (blockIdx.x * kGatherWarps + warp) * 32;
  const int count = min(max(__ldg(sel + topk), 0), topk);  // trip 1, the selection beside it
  const int raw = t0 + lane < topk ? __ldg(sel + t0 + lane) : -1;
  const int req = __ldg(token_to_req + row);
  unsigned acc = 0;
  if (t0 < count) {  // warp-uniform: the shuffles below see every lane
    const int ntok = min(32, count - t0);
    const int idx = lane < ntok ? raw : -1;
    int page = 0, slot = -1;  // slot -1: the token is skipped (past the count, or -1)
    if (idx >= 0) {
      page = __ldg(block_table + (long long)req * bt_stride + idx / page_size);  // trip 2
      slot = idx % page_size;
    }
    const int piece = lane % UNIT, sub = lane / UNIT;
    const bool is_v = piece >= PIECES;
    const long long blk = is_v ? v_block : k_block, tok_stride = is_v ? v_token : k_token;
    const long long head_stride = is_v ? v_head : k_head;
    const unsigned char* lane_base = (is_v ? v_cache : k_cache) + 16 * (piece % PIECES);
    const int head0 = SPLIT_HEADS ? blockIdx.z : 0, head_step = SPLIT_HEADS ? gridDim.z : 1;
    for (int head = head0; head < num_kv_heads; head += head_step) {  // trip 3
      const unsigned char* base = lane_base + head * head_stride;
      for (int t = 0; t < ntok; t += PER_LOAD * kGatherUnroll) {  // warp-uniform trips
        uint4 v[kGatherUnroll];
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) {
          const int tok = t + u * PER_LOAD + sub;
          const int pg = __shfl_sync(~0u, page, tok & 31), sl = __shfl_sync(~0u, slot, tok & 31);
          v[u] = make_uint4(0, 0, 0, 0);
          if (tok < ntok && sl >= 0) v[u] = gather_load(base + pg * blk + sl * tok_stride);
        }
#pragma unroll
        for (int u = 0; u < kGatherUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
      }
    }
  }
  acc = __reduce_xor_sync(~0u, acc);
  const long long cta = ((long long)blockIdx.z * gridDim.y + row) * gridDim.x + blockIdx.x;
  if (lane == 0) sink[cta * kGatherWarps + warp] = acc;
}

}  // namespace fij_qsa
