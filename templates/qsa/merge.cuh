// The QSA decode's epilogue (templates/qsa/body.cuh): the warps' partials merged through
// shared memory, then the gated output (the single pass) or, in a cluster split-K, each
// merged piece pushed to the CTA that owns it and merged there (see inbox_items in
// qsa/util.cuh for the ownership and the inbox layout).
#pragma once
#include "qsa/util.cuh"

namespace fij_qsa {

// The float4 whose component k is u's component k ^ x (x < 4): undoes merge_and_store's swz.
__device__ __forceinline__ float4 unswizzle4(const float4& u, int x) {
  const float4 a = (x & 1) ? make_float4(u.y, u.x, u.w, u.z) : u;
  return (x & 2) ? make_float4(a.z, a.w, a.x, a.y) : a;
}

// Combines S partials (max, sum, acc) of one 8-dim piece into a[8] and returns (the largest
// max, the combined sum): each partial weighted by 2^(its max - the largest), an all -inf
// set (nothing attended) by 1, so its zero sums stay zero. ml(s) is partial s's (max, sum),
// piece(s, u, v) loads its 8 accumulators.
template <int S, typename ML, typename Piece>
__device__ __forceinline__ float2 combine_partials(ML ml, Piece piece, float (&a)[8]) {
  const float neg_inf = __int_as_float(0xff800000);
  float mmax = neg_inf;
#pragma unroll
  for (int s = 0; s < S; ++s) mmax = fmaxf(mmax, ml(s).x);
  const float base = mmax == neg_inf ? 0.f : mmax;
  float denom = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = 0.f;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const float2 p = ml(s);
    const float w = ex2(p.x - base);
    denom += p.y * w;
    float4 u, v;
    piece(s, u, v);
    a[0] += u.x * w; a[1] += u.y * w; a[2] += u.z * w; a[3] += u.w * w;
    a[4] += v.x * w; a[5] += v.y * w; a[6] += v.z * w; a[7] += v.w * w;
  }
  return make_float2(mmax, denom);
}

// The output dim of accumulator column i in lane column c (the decode's V span: a lane
// gathers bytes [SPAN c, +SPAN) + 128 p of a V row, SPAN = min(D / 8, 16)): the layout both
// epilogues below read acc in.
template <int HEAD_DIM>
__device__ __forceinline__ int vdim(int c, int i) {
  constexpr int SPAN = HEAD_DIM >= 128 ? 16 : 8;
  return (i / SPAN) * 128 + SPAN * c + i % SPAN;
}

// The single pass at one warp a CTA (the short pass's one-warp configs): nothing to merge,
// so each thread writes the gated output of the dims it accumulated straight from its
// registers, with what merge_and_store computes for one partial (its weight 2^0 = 1: the
// same values) but without the shared-memory round trip, the barrier and the per-piece
// exponential and division. l0, l1: the sums of the two heads the thread holds, already
// summed over the lanes that share them. See merge_and_store for acc's layout.
template <int GROUP, int HEAD_DIM, bool TMMA>
__device__ __forceinline__ void store_direct(const float (&acc)[HEAD_DIM / (TMMA ? 16 : 8)][4], float l0, float l1,
                                             fij::bf16_t* out, long long out_head, const fij::bf16_t* gate,
                                             long long gate_head, float output_scale) {
  constexpr int NT = HEAD_DIM / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = TMMA ? 2 * t + r : g + 8 * r;  // rows g, g + 8 (TMMA: heads 2t, 2t + 1)
    if (h >= GROUP) continue;
    const float denom = r ? l1 : l0;
    // Pieces of 8 dims (i / 8 = ib: dims vdim(c, 8 ib) + [0, 8)); TMMA: one c (= g), acc[m]
    // holding dims 2m, 2m + 1 in components (r, r + 2); else c = 2t, 2t + 1 in components
    // (c - 2t) + 2r.
#pragma unroll
    for (int c = 0; c < (TMMA ? 1 : 2); ++c) {
#pragma unroll
      for (int ib = 0; ib < NT / 8; ++ib) {
        float a[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) a[j] = TMMA ? acc[4 * ib + j / 2][r + 2 * (j & 1)] : acc[8 * ib + j][c + 2 * r];
        const int d = vdim<HEAD_DIM>(TMMA ? g : 2 * t + c, 8 * ib);
        store_gated(out + h * out_head + d, gate + h * gate_head + d, a, denom, output_scale);
      }
    }
  }
}

// The owner's merge, after the pushes landed: rank r combines its items from its inbox
// and writes the gated output; out/gate point at the kv head's first query head. GATE_PRE:
// gpre already holds the gate of this thread's only item (loaded at kernel start).
template <int CLUSTER, int GROUP, int HEAD_DIM, int THREADS, bool GATE_PRE>
__device__ __forceinline__ void owner_merge(const float* inbox, fij::bf16_t* out, long long out_head,
                                            const fij::bf16_t* gate, long long gate_head, float output_scale,
                                            const uint4& gpre = uint4{}) {
  constexpr int PIECES = HEAD_DIM / 8, ITEMS = inbox_items<HEAD_DIM, CLUSTER>();
  static_assert(!GATE_PRE || GROUP * PIECES <= CLUSTER * THREADS, "one item a thread");
  const float* const iml = inbox + CLUSTER * ITEMS * 8;
  const int rank = cluster_rank();
  for (int li = threadIdx.x; li * CLUSTER + rank < GROUP * PIECES; li += THREADS) {
    const int item = li * CLUSTER + rank, h = item / PIECES, c = item - h * PIECES;
    float a[8];
    const float denom = combine_partials<CLUSTER>(
        [&](int s) { return reinterpret_cast<const float2*>(iml)[s * 16 + h]; },
        [&](int s, float4& u, float4& v) {
          const float4* src = reinterpret_cast<const float4*>(inbox + (s * ITEMS + li) * 8);
          u = src[0];
          v = src[1];
        },
        a).y;
    if constexpr (GATE_PRE) store_gated_value(out + h * out_head + 8 * c, gpre, a, denom, output_scale);
    else store_gated(out + h * out_head + 8 * c, gate + h * gate_head + 8 * c, a, denom, output_scale);
  }
}

// The CTA's epilogue, after its warps' loops (and a __syncthreads): the warps' (max, sum,
// acc) of heads g, g + 8 go to shared memory at `red` ([NUM_WARPS][16][HEAD_DIM + pad],
// then the (max, sum) pairs) and are merged per 8-dim piece; the single pass then writes
// the gated output, a cluster pushes its pieces to their owners. acc[i] holds dims
// vdim(2t, i), vdim(2t + 1, i) (see the decode's PV comment) of heads g, g + 8; TMMA
// (tokens as the MMA's rows, GROUP <= 8): acc[m] holds dims vdim(g, 2m), vdim(g, 2m + 1)
// of heads 2t, 2t + 1, and (m0, l0), (m1, l1) are those two heads'. out/gate point at the
// kv head's first query head of the row.
// A cluster (which arrived on its barrier at kernel start, cluster_arrive_relaxed) pushes
// each merged piece to its owner's `inbox` (owner_merge) and the owners write the output
// after one barrier phase: no CTA reads a peer, so none waits for its peers before leaving.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int CLUSTER, bool GATE_PRE, bool TMMA>
__device__ __forceinline__ void merge_and_store(float* red, float* inbox,
                                                const float (&acc)[HEAD_DIM / (TMMA ? 16 : 8)][4], float m0,
                                                float m1, float l0, float l1, fij::bf16_t* out, long long out_head,
                                                const fij::bf16_t* gate, long long gate_head, float output_scale,
                                                const uint4& gate_pre) {
  constexpr int RR = HEAD_DIM + kRedPad, NT = HEAD_DIM / 8, PIECES = HEAD_DIM / 8, THREADS = NUM_WARPS * 32;
  // Dim d of a row sits at d ^ ((d >> 5) & 3): heads-as-rows stores then spread a warp's 32
  // lanes over 32 banks (unswizzled, lanes t = 0..3 of a row hit one bank: 4-way conflicts).
  // It permutes within aligned groups of 4 floats, so the merge's float4 reads stay whole.
  auto swz = [](int d) { return d ^ ((d >> 5) & 3); };
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  float* const red_ml = red + NUM_WARPS * 16 * RR;
  {
    float* const mine = red + warp * 16 * RR;
    if constexpr (TMMA) {
#pragma unroll
      for (int m = 0; m < NT / 2; ++m) {
        const int d0 = swz(vdim<HEAD_DIM>(g, 2 * m)), d1 = swz(vdim<HEAD_DIM>(g, 2 * m + 1));
        mine[2 * t * RR + d0] = acc[m][0];
        mine[(2 * t + 1) * RR + d0] = acc[m][1];
        mine[2 * t * RR + d1] = acc[m][2];
        mine[(2 * t + 1) * RR + d1] = acc[m][3];
      }
    } else {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        const int d0 = swz(vdim<HEAD_DIM>(2 * t, i)), d1 = swz(vdim<HEAD_DIM>(2 * t + 1, i));
        mine[g * RR + d0] = acc[i][0];
        mine[g * RR + d1] = acc[i][1];
        mine[(g + 8) * RR + d0] = acc[i][2];
        mine[(g + 8) * RR + d1] = acc[i][3];
      }
    }
    // the (max, sum) of the two heads this thread holds: rows g, g + 8 (TMMA: 2t, 2t + 1)
    const int h0 = TMMA ? 2 * t : g, h1 = TMMA ? 2 * t + 1 : g + 8;
    if ((TMMA ? g : t) == 0) {
      red_ml[(warp * 16 + h0) * 2] = m0;
      red_ml[(warp * 16 + h0) * 2 + 1] = l0;
      red_ml[(warp * 16 + h1) * 2] = m1;
      red_ml[(warp * 16 + h1) * 2 + 1] = l1;
    }
  }
  __syncthreads();
  constexpr int ITEMS = CLUSTER > 0 ? inbox_items<HEAD_DIM, CLUSTER>() : 0;
  const unsigned rank = CLUSTER > 0 ? cluster_rank() : 0;
  // Every peer has started (its inbox may be written): the wait of the start's arrival.
  if constexpr (CLUSTER > 0) cluster_wait();
  for (int item = threadIdx.x; item < GROUP * PIECES; item += THREADS) {
    const int h = item / PIECES, c = item - h * PIECES;
    float a[8];
    const float2 md = combine_partials<NUM_WARPS>(
        [&](int w) { return reinterpret_cast<const float2*>(red_ml)[w * 16 + h]; },
        [&](int w, float4& u, float4& v) {
          const float4* src = reinterpret_cast<const float4*>(red + (w * 16 + h) * RR + 8 * c);
          u = unswizzle4(src[0], (c >> 2) & 3);
          v = unswizzle4(src[1], (c >> 2) & 3);
        },
        a);
    const float mmax = md.x, denom = md.y;
    if constexpr (CLUSTER > 0) {
      const unsigned owner = item % CLUSTER;
      const unsigned dst = peer_addr(inbox + (rank * ITEMS + item / CLUSTER) * 8, owner);
      st_peer4(dst, make_float4(a[0], a[1], a[2], a[3]));
      st_peer4(dst + 16, make_float4(a[4], a[5], a[6], a[7]));
      if (c < CLUSTER) {  // the head's (max, sum) to owner c (PIECES >= 8 >= CLUSTER pieces)
        const unsigned ml = peer_addr(inbox + CLUSTER * ITEMS * 8 + (rank * 16 + h) * 2, c);
        st_peer(ml, mmax);
        st_peer(ml + 4, denom);
      }
    } else {
      store_gated(out + h * out_head + 8 * c, gate + h * gate_head + 8 * c, a, denom, output_scale);
    }
  }
  if constexpr (CLUSTER > 0) {
    cluster_sync();  // every push has landed (release / acquire)
    owner_merge<CLUSTER, GROUP, HEAD_DIM, THREADS, GATE_PRE>(inbox, out, out_head, gate, gate_head, output_scale,
                                                             gate_pre);
  }
}

}  // namespace fij_qsa
