// One 16-token chunk of the QSA decode with the chunk's tokens as the MMAs' rows (TMMA in
// templates/qsa/body.cuh, GROUP <= 8): S^T = K Q^T and O^T += V^T P^T, m16n8k16 with the
// group's heads as the 8 columns, so no MMA row is padding (heads as rows pad a group of 8
// to 16: twice the MMAs, exponentials and accumulators). The K and V fragments are the
// heads-as-rows form's registers in A-operand order; P^T reaches B-operand order by two 8x8
// register transposes.
#pragma once
#include "qsa/util.cuh"

namespace fij_qsa {

// The transpose of an 8x8 b16 matrix held in the m16n8k16 C/A fragment layout (thread
// (g, t) holds row g, columns 2t, 2t + 1): the thread then holds row g of the transpose.
__device__ __forceinline__ unsigned transpose8x8(unsigned w) {
  unsigned r;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(w));
  return r;
}

// acc[m]: dims vdim(g, 2m), vdim(g, 2m + 1) (rows g, g + 8 of m16 tile m) of heads 2t, 2t + 1;
// (m0, l0), (m1, l1): the running max and this thread's partial sum of heads 2t, 2t + 1;
// qcol[G][u]: head g's B fragment of k-step (G, u); row_scale0/1: the score scales of heads
// 2t, 2t + 1; bits: whether tokens g (bit 0) and g + 8 (bit 1) are attended. k_of(j, G): the
// 16-byte K piece 4G + t of token row 8j + g; v_of(w, b): V word w's f16x2 pairs b[i][h] =
// dim 4w + i of tokens 2t + 8h, 2t + 8h + 1.
template <int NG, int VW, typename KOf, typename VOf>
__device__ __forceinline__ void tmma_chunk(float (&acc)[2 * VW][4], float& m0, float& m1, float& l0, float& l1,
                                           const uint2 (&qcol)[NG][4], float row_scale0, float row_scale1,
                                           unsigned bits, KOf k_of, VOf v_of) {
  const float neg_inf = __int_as_float(0xff800000);
  // S^T = K Q^T: rows tokens g, g + 8 (the K pieces of rows 8j + g, as A), columns heads.
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    const uint4 k0 = k_of(0, G), k1 = k_of(1, G);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      unsigned lo0, hi0, lo1, hi1;
      e4m3x4_to_f16x2x2(word_of(k0, u), lo0, hi0);
      e4m3x4_to_f16x2x2(word_of(k1, u), lo1, hi1);
      mma_f16(s, make_uint4(lo0, lo1, hi0, hi1), qcol[G][u].x, qcol[G][u].y);
    }
  }
  // s: tokens g (0, 1), g + 8 (2, 3) of heads 2t (0, 2), 2t + 1 (1, 3).
  const bool ok0 = bits & 1u, ok1 = (bits >> 1) & 1u;
  const float x0 = ok0 ? s[0] * row_scale0 : neg_inf, x1 = ok0 ? s[1] * row_scale1 : neg_inf;
  const float x2 = ok1 ? s[2] * row_scale0 : neg_inf, x3 = ok1 ? s[3] * row_scale1 : neg_inf;
  float mx0 = fmaxf(x0, x2), mx1 = fmaxf(x1, x3);
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, o));
    mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, o));
  }
  const float n0 = lazy_max(m0, mx0), n1 = lazy_max(m1, mx1);
  const float b0 = n0 == neg_inf ? 0.f : n0, b1 = n1 == neg_inf ? 0.f : n1;
  const float alpha0 = ex2(m0 - b0), alpha1 = ex2(m1 - b1);
  m0 = n0;
  m1 = n1;
  const float p0 = ex2(x0 - b0), p1 = ex2(x1 - b1), p2 = ex2(x2 - b0), p3 = ex2(x3 - b1);
  l0 = l0 * alpha0 + (p0 + p2);  // this thread's tokens; summed over g after the loop
  l1 = l1 * alpha1 + (p1 + p3);
  if (__any_sync(kFull, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
    for (int m = 0; m < 2 * VW; ++m) {
      acc[m][0] *= alpha0;
      acc[m][1] *= alpha1;
      acc[m][2] *= alpha0;
      acc[m][3] *= alpha1;
    }
  }
  // P^T's B fragment (tokens 2t, 2t + 1 | 2t + 8, 2t + 9 of head g): each 8-token half
  // of the score fragment, transposed.
  const unsigned pb0 = transpose8x8(pack_f16x2(p0, p1)), pb1 = transpose8x8(pack_f16x2(p2, p3));
  // O^T += V^T P^T: m16 tile 2w + c has rows dims (w, 2c) (row g) and (w, 2c + 1) (row g + 8).
#pragma unroll
  for (int w = 0; w < VW; ++w) {
    unsigned b[4][2];
    v_of(w, b);
#pragma unroll
    for (int c = 0; c < 2; ++c)
      mma_f16(acc[2 * w + c], make_uint4(b[2 * c][0], b[2 * c + 1][0], b[2 * c][1], b[2 * c + 1][1]), pb0, pb1);
  }
}

}  // namespace fij_qsa
