// NCH 16-token chunks of the QSA decode with the group's heads as the MMAs' rows (the
// group zero-padded to 16; templates/qsa_body.cuh): S = Q K^T, one online-softmax step over
// all NCH x 16 tokens, O += P V. NCH > 1 (STEP in qsa_body.cuh) hands the tensor cores
// NCH chunks' independent QK chains at once and takes one softmax step for all: a warp with
// a few chunks (a small batch's cluster split) waits on latencies, not on issue slots.
// NCH = 1 is the one-chunk step, the same operations in the same order as before STEP.
#pragma once
#include "qsa_util.cuh"

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
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
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
  // Once the running max settles alpha is exactly 1: skip the rescale warp-wide.
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

// The decode loop of STEP > 1 chunks a step (qsa_body.cuh, cp.async stages, heads as rows),
// after its prologue put PS - 1 steps in flight: step k / STEP takes chunks k .. k + STEP - 1
// from stages STEP s .. STEP s + STEP - 1 (s = its step's slot of PS); a last, shorter step
// takes its chunks one at a time. ring: 4 score bits per chunk in flight, the current one
// lowest; nxt: the slots of the chunks issued at the top of the next step. issue(stage,
// slots) returns a chunk's score bits; load_slots(chunk); stage s of the warp starts at
// stages + STAGE s; k_piece(stage, bulk stage, j, G) and v_frags(stage, bulk stage, w, b)
// read a stage.
template <int STEP, int PS, int NG, int VW, int STAGE, typename Issue, typename LoadSlots, typename KPiece,
          typename VFrags, typename QOf>
__device__ __forceinline__ void step_loop(int my_n, unsigned ring, int (&nxt)[STEP], Issue issue, LoadSlots load_slots,
                                          const uint4* stages, KPiece k_piece, VFrags v_frags, QOf q_of,
                                          float (&acc)[4 * VW][4], float& m0, float& m1, float& l0, float& l1,
                                          float row_scale0, float row_scale1) {
  for (int k = 0; k < my_n; k += STEP) {
    const int s_read = (k / STEP) % PS, s_issue = (k / STEP + PS - 1) % PS;
    const int c = k + STEP * (PS - 1);  // the first chunk issued now
#pragma unroll
    for (int h = 0; h < STEP; ++h)
      if (c + h < my_n) ring |= issue(STEP * s_issue + h, nxt[h]) << (4 * (STEP * (PS - 1) + h));
    cp_async_commit();
#pragma unroll
    for (int h = 0; h < STEP; ++h)
      if (c + STEP + h < my_n) nxt[h] = load_slots(c + STEP + h);
    cp_async_wait<PS - 1>();
    const unsigned step_bits = ring;  // chunk h's 4 bits at 4 h
    ring >>= 4 * STEP;
    const uint4* const st = stages + STEP * s_read * STAGE;
    auto k_of = [&](int h, int j, int G) { return k_piece(st + h * STAGE, nullptr, j, G); };
    auto v_of = [&](int h, int w, unsigned (&b)[4][2]) { v_frags(st + h * STAGE, nullptr, w, b); };
    if (k + STEP <= my_n) {
      unsigned bits[STEP];
#pragma unroll
      for (int h = 0; h < STEP; ++h) bits[h] = (step_bits >> (4 * h)) & 0xfu;
      rows_chunks<STEP, NG, VW>(acc, m0, m1, l0, l1, row_scale0, row_scale1, bits, q_of, k_of, v_of);
    } else {
      for (int h = 0; h < my_n - k; ++h) {
        const unsigned one[1] = {(step_bits >> (4 * h)) & 0xfu};
        auto k_h = [&](int, int j, int G) { return k_of(h, j, G); };
        auto v_h = [&](int, int w, unsigned (&b)[4][2]) { v_of(h, w, b); };
        rows_chunks<1, NG, VW>(acc, m0, m1, l0, l1, row_scale0, row_scale1, one, q_of, k_h, v_h);
      }
    }
  }
}

}  // namespace fij_qsa
