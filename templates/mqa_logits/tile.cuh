// Per-tile pieces of the paged MQA logits kernels, shared by the direct-load kernel and
// the shared-memory ring kernel: the permuted Q layout, the MMA of one 64-token tile
// (S^T = K . Q^T, tokens as rows) and its epilogue (ReLU, weights, head sum, scale, store).
//
// The K fragment of a tile (`ka[2][DIM/16]`) is what thread (warp, g, tig) of a
// warpgroup holds for token rows warp*16 + g and warp*16 + g + 8: per 64-byte chunk of a
// token row the 16 contiguous bytes [16 tig, 16 tig + 16) (8 bytes [8 tig, 8 tig + 8) of a
// trailing 32-byte chunk). A dot product is order-free, so Q is stored permuted the same
// way (load_q) and the MMA sees a consistent k order.
#pragma once
#include "mqa_logits/util.cuh"
#include "mqa_logits/wgmma.cuh"

namespace fij_mqa {

// Byte offset of Q element (n, logical k) in a warpgroup's Q buffer (N x DIM e4m3): per
// 32-wide k step a block of N x 32 bytes made of 8-row x 16-byte core matrices
// [n/8][k/16]; see load_q for the inverse (physical head_dim byte -> logical k).
template <int N>
__device__ __forceinline__ int q_offset(int n, int s, int half, int byte) {
  return s * (N * 32) + (n >> 3) * 256 + half * 128 + (n & 7) * 16 + byte;
}

// Q[b] (N x DIM, row n = t*HEADS + h) into the buffer, permuted as the K fragments are.
// `rows` Q rows of `dim` bytes (contiguous at src) into a buffer laid out for NQ rows.
template <int NQ>
__device__ __forceinline__ void load_q_rows(const unsigned char* __restrict__ src_bytes, int rows, int dim,
                                            unsigned char* qbuf, int tid) {
  const unsigned* src = reinterpret_cast<const unsigned*>(src_bytes);
  for (int idx = tid; idx < rows * dim / 4; idx += 128) {
    const int n = idx / (dim / 4), pb = (idx % (dim / 4)) * 4;
    const int pair = pb >> 6, r = pb & 63;
    int s, tig, half;
    if (pair * 64 + 64 <= dim) {  // full 64-byte chunk: tig owns bytes [16 tig, 16 tig + 16)
      tig = r >> 4;
      s = 2 * pair + ((r >> 3) & 1);
      half = (r >> 2) & 1;
    } else {  // trailing 32-byte chunk: tig owns bytes [8 tig, 8 tig + 8)
      tig = r >> 3;
      s = 2 * pair;
      half = (r >> 2) & 1;
    }
    *reinterpret_cast<unsigned*>(qbuf + q_offset<NQ>(n, s, half, tig * 4)) = src[idx];
  }
}

template <int N, int DIM>
__device__ __forceinline__ void load_q(const unsigned char* __restrict__ q, int b, unsigned char* qbuf, int tid) {
  load_q_rows<N>(q + (long long)b * N * DIM, N, DIM, qbuf, tid);
}

// wgmma over N columns in chunks of 256/128/.../8 (the widths with generated wrappers).
template <int N, int N0, bool F16ACC, typename T>
__device__ __forceinline__ void wgmma_chunks(T* acc, const unsigned (&a)[4], unsigned long long desc, int scale_d) {
  if constexpr (N0 < N) {
    constexpr int R = N - N0;
    constexpr int C = R >= 256 ? 256 : R >= 128 ? 128 : R >= 64 ? 64 : R >= 32 ? 32 : R >= 16 ? 16 : 8;
    Wgmma<C, F16ACC>::run(acc + (F16ACC ? N0 / 4 : N0 / 2), a, desc + (unsigned long long)((N0 / 8) * 256 >> 4),
                          scale_d);
    wgmma_chunks<N, N0 + C, F16ACC>(acc, a, desc, scale_d);
  }
}

template <bool F16ACC>
__device__ __forceinline__ void mma_16816(unsigned* acc, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (F16ACC) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%0, %1};"
                 : "+r"(acc[0]), "+r"(acc[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// acc_u (N/2 f32 or N/4 half2 words) = the tile's S^T rows of this thread.
template <int N, int DIM, bool F16ACC, bool WGMMA>
__device__ __forceinline__ void tile_mma(const unsigned (&ka)[2][DIM / 16], const unsigned char* qbuf,
                                         unsigned* acc_u, int g, int tig) {
  constexpr int ACC_WORDS = F16ACC ? N / 4 : N / 2;
  float* acc_f = reinterpret_cast<float*>(acc_u);
  if constexpr (WGMMA) {
    const unsigned long long desc0 = (unsigned long long)((smem_u32(qbuf) & 0x3FFFF) >> 4) |
                                     ((unsigned long long)(128 >> 4) << 16) |  // LBO: next 16 k-bytes
                                     ((unsigned long long)(256 >> 4) << 32);   // SBO: next 8 rows
#pragma unroll
    for (int w = 0; w < ACC_WORDS; ++w) acc_u[w] = 0u;
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < DIM / 32; ++s) {
      const unsigned a[4] = {ka[0][2 * s], ka[1][2 * s], ka[0][2 * s + 1], ka[1][2 * s + 1]};
      const unsigned long long desc = desc0 + (unsigned long long)((s * N * 32) >> 4);
      if constexpr (F16ACC)
        wgmma_chunks<N, 0, true>(acc_u, a, desc, s > 0 ? 1 : 0);
      else
        wgmma_chunks<N, 0, false>(acc_f, a, desc, s > 0 ? 1 : 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  } else {
#pragma unroll
    for (int w = 0; w < ACC_WORDS; ++w) acc_u[w] = 0u;
#pragma unroll
    for (int s = 0; s < DIM / 32; ++s) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned r0 = ka[0][2 * s + h], r1 = ka[1][2 * s + h];
        const unsigned a[4] = {e4m3x2_to_h2(r0 & 0xffff), e4m3x2_to_h2(r1 & 0xffff), e4m3x2_to_h2(r0 >> 16),
                               e4m3x2_to_h2(r1 >> 16)};
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
          const unsigned bw =
              *reinterpret_cast<const unsigned*>(qbuf + q_offset<N>(j * 8 + g, s, h, tig * 4));
          mma_16816<F16ACC>(acc_u + (F16ACC ? 2 * j : 4 * j), a, e4m3x2_to_h2(bw & 0xffff),
                            e4m3x2_to_h2(bw >> 16));
        }
      }
    }
  }
}

// The weights a thread's accumulator columns need (columns i*8 + 2 tig + j, j = 0, 1):
// read from the warpgroup's shared buffer per tile, or held in registers (N/4 floats,
// loaded once per request), which saves N/4 shared loads per tile when registers allow.
struct WeightsSmem {
  const float* p;  // the buffer + 2 tig
  __device__ __forceinline__ float2 get2(int i) const { return *reinterpret_cast<const float2*>(p + i * 8); }
};
// The TMA kernel's weight buffers: quad lane tig's N/4 weights (columns i*8 + 2 tig + j) are
// contiguous, so a 16-byte load fetches the pairs of two column groups (half the loads of
// WeightsSmem); rows are padded to 16 bytes plus 16 so the 4 lanes' loads hit distinct banks.
template <int N>
struct LaneWeights {
  static constexpr int kStride = (N / 4 + 3) / 4 * 4 + 4;  // floats per lane row
  static constexpr int kFloats = 4 * kStride;
  static __device__ __forceinline__ int slot(int n) { return ((n >> 1) & 3) * kStride + (n >> 3) * 2 + (n & 1); }
  const float4* p;  // the buffer + tig * kStride
  // Pairs i and i + 1 (i even) come from one load: the second call's load is the first's.
  __device__ __forceinline__ float2 get2(int i) const {
    const float4 v = p[i >> 1];
    return (i & 1) ? make_float2(v.z, v.w) : make_float2(v.x, v.y);
  }
};
// The TMA kernel's weights in registers: column groups [0, WR) held in registers (loaded
// once per request), the rest read from the LaneWeights row per tile (WR = N / 8: all in
// registers). Every group read from shared memory costs the warp a share of a 16-byte load
// each tile; at next_n*heads = 128 with 112 registers 14 of the 16 groups fit (16 spill).
template <int N, int WR>
struct WeightsSplit {
  static_assert((WR % 2 == 0 || WR == N / 8) && WR <= N / 8, "whole 16-byte pairs of column groups in shared memory");
  float v[WR > 0 ? WR : 1][2];
  const float4* p;  // lane tig's LaneWeights row
  __device__ __forceinline__ void load_lane(const float* row) {
#pragma unroll
    for (int i = 0; i < WR; ++i) {
      v[i][0] = row[2 * i];
      v[i][1] = row[2 * i + 1];
    }
    p = reinterpret_cast<const float4*>(row);
  }
  __device__ __forceinline__ float2 get2(int i) const {
    if (i < WR) return make_float2(v[i][0], v[i][1]);
    const float4 q = p[i >> 1];
    return (i & 1) ? make_float2(q.z, q.w) : make_float2(q.x, q.y);
  }
};
template <int N>
struct WeightsReg {
  float v[N / 8][2];
  __device__ __forceinline__ void load(const float* wbuf, int tig) {
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      v[i][0] = wbuf[i * 8 + tig * 2];
      v[i][1] = wbuf[i * 8 + tig * 2 + 1];
    }
  }
  __device__ __forceinline__ float2 get2(int i) const { return make_float2(v[i][0], v[i][1]); }
};

// Sums each item v[i] over the 4 lanes of a quad and leaves item i in lane i % 4 (items
// pair up across lanes 1 apart, then the pair sums across lanes 2 apart: the same
// (a + b) + (c + d) tree as two full butterflies, so the sums are bitwise the same). With
// V/2 odd the last item is summed whole in every lane. res[m] holds item 4m + lane
// (m < V/4) or the last item (m == V/4).
template <int V, typename T, typename Add>
__device__ __forceinline__ void quad_reduce_scatter(const T (&v)[V], T (&res)[(V + 2) / 4], int tig, Add add) {
  static_assert(V % 2 == 0, "items come in (row, row + 8) pairs");
  constexpr int H = V / 2;
  const bool b0 = tig & 1, b1 = tig & 2;
  T h[H];
#pragma unroll
  for (int k = 0; k < H; ++k) {  // h[k] = item 2k + b0, over lanes 1 apart
    const T send = b0 ? v[2 * k] : v[2 * k + 1];
    h[k] = add(b0 ? v[2 * k + 1] : v[2 * k], __shfl_xor_sync(0xffffffffu, send, 1));
  }
#pragma unroll
  for (int m = 0; m < H / 2; ++m) {  // res[m] = item 4m + 2 b1 + b0, over lanes 2 apart
    const T send = b1 ? h[2 * m] : h[2 * m + 1];
    res[m] = add(b1 ? h[2 * m + 1] : h[2 * m], __shfl_xor_sync(0xffffffffu, send, 2));
  }
  if constexpr (H % 2) res[H / 2] = add(h[H - 1], __shfl_xor_sync(0xffffffffu, h[H - 1], 2));
}

// The logits kernels' flags argument (the host's mqa_logits/ring.py logits_flags): bit 0 the
// KV stream's evict-first L2 policy, bit 1 bfloat16 rounding of 16-bit logits. A float32
// specialization is never launched with bit 1, so it reads the word whole as before bit 1
// existed (its consumer loop's SASS is unchanged; the producer's policy test lost a compare).
template <typename OutT>
__device__ __forceinline__ bool kv_evict_first(int flags) {
  return sizeof(OutT) == 2 ? (flags & 1) != 0 : flags != 0;
}
template <typename OutT>
__device__ __forceinline__ bool logits_bf16(int flags) {
  return sizeof(OutT) == 2 && (flags & 2) != 0;
}

// One tile's epilogue for one thread: ReLU, weights and the in-thread head sums over the
// accumulator's 8-column groups (add, in any split of [0, N/8) in order: the TMA kernel
// adds the first half while the MMA of the second half runs), then the quad reduction,
// scale and store (store).
template <int NEXT_N, int HEADS, typename OutT, typename EpiT, typename AccT>
struct TileSums {
  static constexpr int N = NEXT_N * HEADS;
  static constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  static constexpr bool F16EPI = same_type<EpiT, fij::half_t>::value;
  // 16-bit logits (OutT half_t) are rounded to float16 or, with ``bf16``, to bfloat16 at
  // the store: one specialization serves both (a run-time choice of one conversion).
  static constexpr bool OUT16 = sizeof(OutT) == 2;
  // f32 epilogue: two independent FMA chains per (t, row), summed at the end (ILP).
  float part[NEXT_N][2], part_b[NEXT_N][2];
  // f16 epilogue: per (t, row) one half2 chain over the column pairs (a fused multiply-add
  // of both columns per instruction), its halves added at the end.
  unsigned hacc[NEXT_N][2];

  __device__ __forceinline__ TileSums() {
#pragma unroll
    for (int t = 0; t < NEXT_N; ++t) {
      part[t][0] = part[t][1] = part_b[t][0] = part_b[t][1] = 0.f;
      hacc[t][0] = hacc[t][1] = 0u;
    }
  }

  // Column groups [I0, I1) of the accumulator (acc_u: all N/2 f32 or N/4 half2 words).
  template <int I0, int I1, typename W>
  __device__ __forceinline__ void add(const unsigned* acc_u, const W& wts, int tig) {
    const float* acc_f = reinterpret_cast<const float*>(acc_u);
#pragma unroll
    for (int i = I0; i < I1; ++i) {
      const int t_lo = (i * 8) / HEADS, t_hi = (i * 8 + 7) / HEADS;
      const bool low = (i * 8 + tig * 2) < (t_lo + 1) * HEADS;  // which t this thread's pair is in
      const float2 w = wts.get2(i);
      const unsigned w2 = F16EPI ? pack_h2(w.x, w.y) : 0u;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (F16EPI) {
          const unsigned x = F16ACC ? acc_u[2 * i + r] : pack_h2(acc_f[4 * i + 2 * r], acc_f[4 * i + 2 * r + 1]);
          if (t_lo == t_hi || low)
            hacc[t_lo][r] = hfma2(hrelu2(x), w2, hacc[t_lo][r]);
          else
            hacc[t_hi][r] = hfma2(hrelu2(x), w2, hacc[t_hi][r]);
        } else {
          const float x0 = F16ACC ? h2_lo(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r];
          const float x1 = F16ACC ? h2_hi(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r + 1];
          if (t_lo == t_hi) {
            part[t_lo][r] = fmaf(fmaxf(x0, 0.f), w.x, part[t_lo][r]);
            part_b[t_lo][r] = fmaf(fmaxf(x1, 0.f), w.y, part_b[t_lo][r]);
          } else {  // a pair never straddles two t (HEADS % 4 == 0): it is all t_lo or all t_hi
            const float y = fmaf(fmaxf(x0, 0.f), w.x, fmaxf(x1, 0.f) * w.y);
            part[t_lo][r] += low ? y : 0.f;
            part[t_hi][r] += low ? 0.f : y;
          }
        }
      }
    }
  }

  // Each (t, row) sum is spread over the 4 lanes of a quad; reduce-scatter them so every
  // lane ends with whole sums (item 2t + r in lane (2t + r) % 4) and stores at most two:
  // 1-2 stores a lane instead of one predicated store per item, and a lane's items all
  // lie in row r = tig & 1 of its pair (one scale, one position).
  static constexpr int V = 2 * NEXT_N;
  static constexpr int M = (V + 2) / 4;  // items a lane holds after the reduction
  using Item = typename conditional<F16EPI, unsigned, float>::type;  // f16 bits or f32
  // The lane's m-th reduced item (quad_reduce_scatter's order): item 2t + r is row t, row r.
  static __device__ __forceinline__ int item(int m, int tig) { return m < V / 4 ? 4 * m + tig : V - 2 + (tig & 1); }
  // Whether the lane stores its m-th item (the shared tail item: lanes 0-1 write it).
  static __device__ __forceinline__ bool stores(int m, int tig) { return !(m == V / 4 && (tig & 2)); }
  static __device__ __forceinline__ void write(OutT* dst, Item value, bool bf16) {
    if constexpr (OUT16) {
      unsigned short bits;
      if (bf16)  // rounded once from the epilogue's value
        bits = F16EPI ? f2bf(h2f((unsigned short)value)) : f2bf(value);
      else
        bits = F16EPI ? (unsigned short)value : f2h(value);
      reinterpret_cast<unsigned short*>(dst)[0] = bits;
    } else {
      if constexpr (F16EPI) *reinterpret_cast<float*>(dst) = h2f((unsigned short)value);
      else *reinterpret_cast<float*>(dst) = value;
    }
  }
  // The lane's items, scaled: res[m] (see item).
  __device__ __forceinline__ void reduce(float sc0, float sc1, int tig, Item (&res)[M]) const {
    const float sc = (tig & 1) ? sc1 : sc0;
    if constexpr (F16EPI) {
      unsigned v[V], r[M];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = hsum2(hacc[i >> 1][i & 1]);
      quad_reduce_scatter<V>(v, r, tig, [](unsigned x, unsigned y) {
        return (unsigned)hadd((unsigned short)x, (unsigned short)y);
      });
      const unsigned short hsc = f2h(sc);
#pragma unroll
      for (int m = 0; m < M; ++m) res[m] = hmul((unsigned short)r[m], hsc);
    } else {
      float v[V], r[M];
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = part[i >> 1][i & 1] + part_b[i >> 1][i & 1];
      quad_reduce_scatter<V>(v, r, tig, [](float x, float y) { return x + y; });
#pragma unroll
      for (int m = 0; m < M; ++m) res[m] = r[m] * sc;
    }
  }
  __device__ __forceinline__ void store(float sc0, float sc1, int b, int tile, int rows, OutT* __restrict__ out,
                                        long long out_stride, int warp, int g, int tig, bool bf16) const {
    const int pos = tile * kTile + warp * 16 + g + 8 * (tig & 1);
    Item res[M];
    reduce(sc0, sc1, tig, res);
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (pos < rows && stores(m, tig))
        write(out + (long long)(b * NEXT_N + (item(m, tig) >> 1)) * out_stride + pos, res[m], bf16);
  }
};

// Where a lane's reduced items of one request go (TileSums::reduce's res[m]): each item's
// output row at the lane's position in tile 0, set once per request, so a tile's store is
// one add and one compare.
template <typename Sums, typename OutT>
struct LaneRows {
  OutT* row[Sums::M];
  int pos0;   // the lane's token row in a tile
  bool bf16;  // 16-bit logits rounded to bfloat16 (TileSums::write)
  __device__ __forceinline__ LaneRows(int warp, int g, int tig, bool bf16_)
      : pos0(warp * 16 + g + 8 * (tig & 1)), bf16(bf16_) {}
  __device__ __forceinline__ void point(OutT* __restrict__ out, long long out_stride, int b, int tig) {
#pragma unroll
    for (int m = 0; m < Sums::M; ++m)
      row[m] = out + (long long)(b * (Sums::V / 2) + (Sums::item(m, tig) >> 1)) * out_stride + pos0;
  }
  __device__ __forceinline__ void put(const typename Sums::Item (&res)[Sums::M], int tile, int rows, int tig) const {
    const bool in = tile * kTile + pos0 < rows;
#pragma unroll
    for (int m = 0; m < Sums::M; ++m)
      if (in && Sums::stores(m, tig)) Sums::write(row[m] + tile * kTile, res[m], bf16);
  }
};

template <int NEXT_N, int HEADS, typename OutT, typename EpiT, typename AccT, typename W>
__device__ __forceinline__ void tile_store(const unsigned* acc_u, const W& wts, float sc0, float sc1, int b,
                                           int tile, int rows, OutT* __restrict__ out, long long out_stride,
                                           int warp, int g, int tig, bool bf16) {
  TileSums<NEXT_N, HEADS, OutT, EpiT, AccT> sums;
  sums.template add<0, NEXT_N * HEADS / 8>(acc_u, wts, tig);
  sums.store(sc0, sc1, b, tile, rows, out, out_stride, warp, g, tig, bf16);
}

}  // namespace fij_mqa
