// The pieces of the Hopper TMA logits kernel (mqa_logits/sm90_tma_wgmma.cuh): the tensor
// map and its copies, the panel layout of a tile and its wgmma descriptors, the shared
// memory layout, the Q loads, the MMA of a tile and its epilogue.
#pragma once
#include "mqa_logits/ring.cuh"

namespace fij_mqa {

// A CUtensorMap by value (the driver's opaque 128-byte object, 64-byte aligned). Passed
// as a __grid_constant__ parameter, so the TMA unit reads it from parameter memory.
struct alignas(64) TensorMap {
  unsigned long long words[16];
};

__device__ __forceinline__ void tma_load_rows(unsigned dst, const TensorMap* map, int col, int row, int block,
                                              unsigned bar, KvPolicy kp) {
  const unsigned long long m = reinterpret_cast<unsigned long long>(map);
  if (kp.evict_first)
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, "
        "{%2, %3, %4}], [%5], %6;" ::"r"(dst),
        "l"(m), "r"(col), "r"(row), "r"(block), "r"(bar), "l"(kp.policy)
        : "memory");
  else
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];" ::"r"(dst),
        "l"(m), "r"(col), "r"(row), "r"(block), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all_but_last() {  // every group but the newest
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// A token row of DIM bytes is stored as DIM / PANEL column panels of PANEL bytes: 128 (the
// widest swizzle) where DIM is a multiple of 128, DIM at 64, else 32 (head_dim 32, 96, 160,
// ...: one panel per 32-byte k step). Panel p of a tile holds bytes [p PANEL, (p + 1)
// PANEL) of its rows, PANEL-byte rows in the PANEL-byte swizzle (the TMA's and wgmma's
// SW128 / SW64 / SW32). Mirrored by panel_width in flashinfer_jit/mqa_logits/tma.py.
template <int DIM>
struct Panels {
  static_assert(DIM % 32 == 0, "head_dim must be a multiple of 32");
  static constexpr int kWidth = DIM % 128 == 0 ? 128 : DIM == 64 ? 64 : 32;  // bytes of a panel row
  static constexpr int kCount = DIM / kWidth;
  // The 16-byte chunk c of panel row n lands at chunk c ^ (bits 7.. of the row's offset):
  // the swizzle pattern of width kWidth within its 8-row atom (8 * kWidth bytes).
  static __device__ __forceinline__ int offset(int n, int c) {
    return n * kWidth + ((c ^ ((n * kWidth >> 7) & (kWidth / 16 - 1))) << 4);
  }
  // wgmma descriptor of a K-major e4m3 panel: kWidth-byte rows, 8-row groups 8 * kWidth
  // bytes apart (SBO), the swizzle mode (1: 128, 2: 64, 3: 32 bytes); +2 per 32-byte k step.
  static __device__ __forceinline__ unsigned long long desc(unsigned addr) {
    return (unsigned long long)desc_lo(addr) | ((unsigned long long)kDescHi << 32);
  }
  // The two halves: the low word is linear in the address (shared addresses stay below
  // 2^18), so a stage's is stage 0's plus s times the stage's bytes / 16.
  static constexpr unsigned kDescHi = (8 * kWidth >> 4) | ((kWidth == 128 ? 1u : kWidth == 64 ? 2u : 3u) << 30);
  static __device__ __forceinline__ unsigned desc_lo(unsigned addr) { return ((addr & 0x3FFFF) >> 4) | (1u << 16); }
};

// Shared memory (bytes from a 1024-aligned base): value stages, QBUF Q buffers per consumer
// warpgroup, scales, QBUF weight buffers per warpgroup, tile descriptors, mbarriers. The
// host adds 1024 bytes of slack for the alignment. Mirrored by tma_smem_bytes in
// flashinfer_jit/mqa_logits_tma.py.
template <int N, int DIM, int WGS, int STAGES, int QBUF>
struct TmaLayout {
  static constexpr int kVals = kTile * DIM;
  static constexpr int kQ = STAGES * kVals;
  static constexpr int kScales = kQ + WGS * QBUF * N * DIM;
  static constexpr int kW = kScales + STAGES * kTile * 4;
  static constexpr int kMeta = kW + WGS * QBUF * LaneWeights<N>::kFloats * 4;
  static constexpr int kBars = kMeta + STAGES * 16;
  static constexpr int kBytes = kBars + STAGES * 16;
};

// The TMA kernel's tile copy (see BulkTileCopy): values through the tensor map, one box
// of 64 rows (32 for 32-token blocks) per column panel, scales with a bulk copy.
template <int DIM, int BLOCK>
struct TmaTileCopy {
  using P = Panels<DIM>;
  const TensorMap* map;
  const unsigned char* kv;
  unsigned vals0, scales0;
  KvPolicy policy;
  // The rows [row, row + rows) of KV block blk into rows [at, at + rows) of each panel.
  __device__ __forceinline__ void rows(unsigned vdst, int at, int row, int blk, unsigned bar) const {
#pragma unroll
    for (int p = 0; p < P::kCount; ++p)
      tma_load_rows(vdst + p * (kTile * P::kWidth) + at * P::kWidth, map, p * P::kWidth, row, blk, bar, policy);
  }
  __device__ __forceinline__ void operator()(int s, unsigned bar, int blk0, int blk1, int t, bool two) const {
    constexpr long long kBlockBytes = (long long)BLOCK * (DIM + 4);
    const unsigned vdst = vals0 + s * (kTile * DIM), sdst = scales0 + s * (kTile * 4);
    const unsigned char* scales = kv + (long long)blk0 * kBlockBytes + BLOCK * DIM;
    if constexpr (BLOCK >= kTile) {
      const int part = t % (BLOCK / kTile);
      mbar_arrive_tx(bar, kTile * (DIM + 4));
      rows(vdst, 0, part * kTile, blk0, bar);
      bulk_copy(sdst, scales + part * kTile * 4, kTile * 4, bar, policy);
    } else {
      mbar_arrive_tx(bar, (two ? 2 : 1) * BLOCK * (DIM + 4));
      rows(vdst, 0, 0, blk0, bar);
      bulk_copy(sdst, scales, BLOCK * 4, bar, policy);
      if (two) {
        rows(vdst, BLOCK, 0, blk1, bar);
        bulk_copy(sdst + BLOCK * 4, kv + (long long)blk1 * kBlockBytes + BLOCK * DIM, BLOCK * 4, bar, policy);
      }
    }
  }
};

// Q[b] (N rows of DIM e4m3 bytes) into a Q buffer laid out as a tile is (Panels<DIM>, N
// rows a panel) and its N weights, asynchronously.
template <int N, int DIM>
__device__ __forceinline__ void issue_q(const unsigned char* __restrict__ q, const float* __restrict__ weights,
                                        int b, unsigned qdst, unsigned wdst, int tid) {
  using P = Panels<DIM>;
  constexpr int kChunks = P::kWidth / 16;  // 16-byte chunks of a panel row
  constexpr int kRowChunks = DIM / 16;     // of a Q row
  if constexpr ((kRowChunks & (kRowChunks - 1)) == 0) {  // chunk by chunk
    const unsigned char* src = q + (long long)b * N * DIM;
#pragma unroll
    for (int idx = tid; idx < N * DIM / 16; idx += 128) {
      const int n = idx / kRowChunks, c = idx % kRowChunks;
      cp_async_16(qdst + (c / kChunks) * (N * P::kWidth) + P::offset(n, c % kChunks), src + idx * 16);
    }
  } else {
    // Head dim 96 (6 chunks a row): there the division above kept six addresses live
    // through the consumer loop (28 more registers, spilled at 4 warpgroups). (The order
    // below would serve every dim, but it changes the SASS of the power-of-two dims, which
    // has not been timed: the loop above stays theirs until it is.) Lane c of
    // each group of kLanes threads copies chunk c of rows n0, n0 + kRows, ...: rows kRows
    // apart share their swizzle phase (kRows is a multiple of the 8-row atom), so both
    // addresses are one add per row.
    constexpr int kLanes = kRowChunks <= 8 ? 8 : 16;
    constexpr int kRows = 128 / kLanes;
    static_assert(kRowChunks <= 16, "Q rows per pass");
    const int c = tid % kLanes, n0 = tid / kLanes;
    if (c < kRowChunks) {
      const unsigned dst = qdst + (c / kChunks) * (N * P::kWidth) + P::offset(n0, c % kChunks);
      const unsigned char* src = q + ((long long)b * N + n0) * DIM + c * 16;
#pragma unroll
      for (int j = 0; j < (N + kRows - 1) / kRows; ++j)
        if (N % kRows == 0 || n0 + j * kRows < N) cp_async_16(dst + j * kRows * P::kWidth, src + j * kRows * DIM);
    }
  }
  // 4-byte copies: weights rows need only the alignment of a float.
  for (int n = tid; n < N; n += 128) cp_async_4(wdst + 4 * LaneWeights<N>::slot(n), weights + (long long)b * N + n);
}

// The MMA of Q rows (accumulator columns) [C0, C0 + NC) against the tile at descriptor da,
// Q at db, into their accumulator words: one commit group, not waited for. C0 is a
// multiple of 8 rows (whole swizzle atoms); acc is not cleared (k = 0 does not read it).
template <int N, int C0, int NC, int DIM, bool F16ACC, int ACC_WORDS>
__device__ __forceinline__ void tma_mma_cols(unsigned (&acc)[ACC_WORDS], unsigned long long da,
                                             unsigned long long db) {
  using P = Panels<DIM>;
  constexpr int kSteps = P::kWidth / 32;
#pragma unroll
  for (int k = 0; k < DIM / 32; ++k) {
    // k step k: panel k*32 / kWidth (kTile resp. N rows of kWidth bytes), 32 bytes in.
    const unsigned long long ka = da + (unsigned long long)((k / kSteps) * (kTile * P::kWidth) >> 4) + 2 * (k % kSteps);
    const unsigned long long kb = db + (unsigned long long)(((k / kSteps) * N + C0) * P::kWidth >> 4) + 2 * (k % kSteps);
    if constexpr (F16ACC)
      WgmmaSS<NC, true>::run(acc + C0 / 4, ka, kb, k > 0 ? 1 : 0);
    else
      WgmmaSS<NC, false>::run(reinterpret_cast<float*>(acc) + C0 / 2, ka, kb, k > 0 ? 1 : 0);
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// The same MMA from the descriptors' low words (lean loop): each k step's words are 32-bit
// adds, paired with the constant high word only at the instruction (64-bit adds on
// descriptors cost ptxas two adds and four moves a k step).
__device__ __forceinline__ unsigned long long desc_pack(unsigned lo, unsigned hi) {
  unsigned long long d;
  asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi));
  return d;
}
template <int N, int DIM, bool F16ACC, int ACC_WORDS>
__device__ __forceinline__ void tma_mma_lo(unsigned (&acc)[ACC_WORDS], unsigned da, unsigned db) {
  using P = Panels<DIM>;
  constexpr int kSteps = P::kWidth / 32;
#pragma unroll
  for (int k = 0; k < DIM / 32; ++k) {
    const unsigned ka = da + ((k / kSteps) * (kTile * P::kWidth) >> 4) + 2 * (k % kSteps);
    const unsigned kb = db + ((k / kSteps) * N * P::kWidth >> 4) + 2 * (k % kSteps);
    if constexpr (F16ACC)
      WgmmaSS<N, true>::run(acc, desc_pack(ka, P::kDescHi), desc_pack(kb, P::kDescHi), k > 0 ? 1 : 0);
    else
      WgmmaSS<N, false>::run(reinterpret_cast<float*>(acc), desc_pack(ka, P::kDescHi), desc_pack(kb, P::kDescHi),
                             k > 0 ? 1 : 0);
  }
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Accumulator words [W0, W1) may be read once at most PENDING commit groups are in flight.
template <int PENDING, int W0, int W1, int ACC_WORDS>
__device__ __forceinline__ void tma_mma_wait(unsigned (&acc)[ACC_WORDS]) {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
#pragma unroll
  for (int w = W0; w < W1; ++w) asm volatile("" : "+r"(acc[w])::"memory");  // read after the wait
}

// A tile's epilogue once its MMA is done: the stage (empty barrier empty_bar) is released
// as soon as no MMA reads it, then the sums and the store. (Splitting the MMA in two column
// halves to overlap the first half's sums with the second's MMA was measured slower at
// next_n*heads = 128 and no faster elsewhere: BENCHMARKS.md, MQA round 10.)
template <int NEXT_N, int HEADS, typename OutT, typename EpiT, typename AccT, int ACC_WORDS, typename W>
__device__ __forceinline__ void tma_epilogue(unsigned (&acc)[ACC_WORDS], const W& wts, unsigned empty_bar,
                                             float sc0, float sc1, int4 m, OutT* __restrict__ out,
                                             long long out_stride, int warp, int g, int tig, bool bf16) {
  TileSums<NEXT_N, HEADS, OutT, EpiT, AccT> sums;
  tma_mma_wait<0, 0, ACC_WORDS>(acc);
  release_stage(empty_bar);
  sums.template add<0, NEXT_N * HEADS / 8>(acc, wts, tig);
  sums.store(sc0, sc1, m.x, m.y, m.z, out, out_stride, warp, g, tig, bf16);
}

}  // namespace fij_mqa
