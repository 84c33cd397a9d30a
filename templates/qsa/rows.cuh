// NCH 16-token chunks of the QSA decode with the group's heads as the MMAs' rows (the
// group zero-padded to 16; templates/qsa/body.cuh): S = Q K^T, one online-softmax step over
// all NCH x 16 tokens, O += P V. NCH = 2 (PAIR in qsa/body.cuh) hands the tensor cores two
// chunks' independent QK chains at once and takes one softmax step for both: a warp with a
// few chunks (a small batch's cluster split) waits on latencies, not on issue slots.
// NCH = 1 is the one-chunk step, the same operations in the same order as before PAIR.
#pragma once
#include "qsa/util.cuh"

namespace fij_qsa {

// acc[i]: n8 tile i of the output (heads g, g + 8 as rows); (m0, l0), (m1, l1): the running
// max and this thread's partial sum of heads g and g + 8; row_scale0/1: their score scales;
// bits[h]: whether tokens 2t, 2t+1, 2t+8, 2t+9 of chunk h are attended (bits 0-3).
// q_of(G, u): Q's A fragment of k-step (G, u); k_of(h, j, G): the 16-byte K piece 4G + t of
// token row 8j + g of chunk h; v_of(h, w, b): chunk h's V word w as f16x2 B fragments.
template <int NCH, int NG, int VW, typename QOf, typename KOf, typename VOf>
__device__ __forceinline__ void rows_chunks(float (&acc)[4 * VW][4], float& m0, float& m1, float& l0, float& l1,
                                            float row_scale0, float row_scale1, const unsigned (&bits)[NCH], QOf q_of,
                                            KOf k_of, VOf v_of) {
  const float neg_inf = __int_as_float(0xff800000);
  // S over each chunk's two n8 token tiles: NCH x 2 independent chains of NG x 4 MMAs.
  float s[NCH][2][4];
#pragma unroll
  for (int h = 0; h < NCH; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) s[h][j][0] = s[h][j][1] = s[h][j][2] = s[h][j][3] = 0.f;
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    uint4 kk[NCH][2];
#pragma unroll
    for (int h = 0; h < NCH; ++h)
#pragma unroll
      for (int j = 0; j < 2; ++j) kk[h][j] = k_of(h, j, G);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint4 a = q_of(G, u);
#pragma unroll
      for (int h = 0; h < NCH; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          unsigned lo, hi;
          e4m3x4_to_f16x2x2(word_of(kk[h][j], u), lo, hi);
          mma_f16(s[h][j], a, lo, hi);
        }
    }
  }
  // Online softmax in base 2; masked tokens are -inf and never produce NaN.
  float x[NCH][2][4];
#pragma unroll
  for (int h = 0; h < NCH; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool ok0 = (bits[h] >> (2 * j)) & 1u, ok1 = (bits[h] >> (2 * j + 1)) & 1u;
      x[h][j][0] = ok0 ? s[h][j][0] * row_scale0 : neg_inf;
      x[h][j][1] = ok1 ? s[h][j][1] * row_scale0 : neg_inf;
      x[h][j][2] = ok0 ? s[h][j][2] * row_scale1 : neg_inf;
      x[h][j][3] = ok1 ? s[h][j][3] * row_scale1 : neg_inf;
    }
  float mx0 = neg_inf, mx1 = neg_inf;
#pragma unroll
  for (int h = 0; h < NCH; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mx0 = fmaxf(mx0, fmaxf(x[h][j][0], x[h][j][1]));
      mx1 = fmaxf(mx1, fmaxf(x[h][j][2], x[h][j][3]));
    }
  mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, 2));
  const float n0 = lazy_max(m0, mx0), n1 = lazy_max(m1, mx1);
  const float b0 = n0 == neg_inf ? 0.f : n0, b1 = n1 == neg_inf ? 0.f : n1;
  const float alpha0 = ex2(m0 - b0), alpha1 = ex2(m1 - b1);
  m0 = n0;
  m1 = n1;
  float p[NCH][2][4];
  float sum0 = l0 * alpha0, sum1 = l1 * alpha1;
#pragma unroll
  for (int h = 0; h < NCH; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      p[h][j][0] = ex2(x[h][j][0] - b0);
      p[h][j][1] = ex2(x[h][j][1] - b0);
      p[h][j][2] = ex2(x[h][j][2] - b1);
      p[h][j][3] = ex2(x[h][j][3] - b1);
      sum0 += p[h][j][0] + p[h][j][1];
      sum1 += p[h][j][2] + p[h][j][3];
    }
  l0 = sum0;
  l1 = sum1;
  // Where no head's max moved (lazy_max) alpha is exactly 1: skip the rescale warp-wide.
  if (__any_sync(kFull, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
    for (int i = 0; i < 4 * VW; ++i) {
      acc[i][0] *= alpha0;
      acc[i][1] *= alpha0;
      acc[i][2] *= alpha1;
      acc[i][3] *= alpha1;
    }
  }
  // O += P V: transpose 4 tokens x 4 dims of e4m3 per word into f16x2 B fragments.
#pragma unroll
  for (int h = 0; h < NCH; ++h) {
    const uint4 pa = make_uint4(pack_f16x2(p[h][0][0], p[h][0][1]), pack_f16x2(p[h][0][2], p[h][0][3]),
                                pack_f16x2(p[h][1][0], p[h][1][1]), pack_f16x2(p[h][1][2], p[h][1][3]));
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      unsigned b[4][2];
      v_of(h, w, b);
#pragma unroll
      for (int i = 0; i < 4; ++i) mma_f16(acc[4 * w + i], pa, b[i][0], b[i][1]);
    }
  }
}

}  // namespace fij_qsa
