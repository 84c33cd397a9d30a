// Device helpers of the QSA decode (templates/qsa/sm89_mma_decode.cuh): async copies, e4m3/bf16/fp16
// conversions, m16n8k16 MMA, thread-block-cluster access, the gated output store.
#pragma once
#include "common.cuh"
#include "qsa/bulk.cuh"

namespace fij_qsa {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kChunk = 16;     // tokens per warp step: one k16 step of P V
constexpr int kRedPad = 4;     // floats padding each row of the cross-warp reduction

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// A 16/8-byte global -> shared copy; src_bytes = 0 zero-fills (masked tokens).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// x, opaque to the compiler: it stays in a register instead of being recomputed from
// threadIdx where it is used (the decode's LEAN loop).
__device__ __forceinline__ int pinned(int x) {
  asm volatile("" : "+r"(x));
  return x;
}
__device__ __forceinline__ unsigned pinned(unsigned x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ unsigned word_of(const uint4& v, int u) {
  return u == 0 ? v.x : u == 1 ? v.y : u == 2 ? v.z : v.w;
}

// Bytes (0,1) and (2,3) of w as two f16x2 words, exactly.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(unsigned w, unsigned& lo, unsigned& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

// max(|lo|, |hi|) of a bf16x2 word, as a float.
__device__ __forceinline__ float bf16x2_absmax(unsigned w) {
  return fmaxf(fabsf(fij::bf16_lo(w)), fabsf(fij::bf16_hi(w)));
}

// 2^e as a float, for |e| <= 126.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }

// The exponent e with amax * 2^e in [2^14, 2^15), clamped to [-100, 100] (amax = 0 or
// tiny: any scale is exact; inf/NaN q is garbage in either way).
__device__ __forceinline__ int q_scale_exponent(float amax) {
  const int biased = (__float_as_int(amax) >> 23) & 0xff;
  return min(max(141 - biased, -100), 100);
}

// A bf16x2 word times 2^e (exact) rounded to f16x2 (exact in the range q_scale_exponent
// picks, see the Q fragment comment).
__device__ __forceinline__ unsigned bf16x2_to_f16x2(unsigned w, float up) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(fij::bf16_hi(w) * up), "f"(fij::bf16_lo(w) * up));
  return r;
}

__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint4& a, unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// Thread-block-cluster helpers (sm_90+): rank, barrier, and loads from a peer CTA's smem.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The split phase of a cluster barrier: arrive early (no memory ordering), wait much later.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_peer(unsigned addr, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}
__device__ __forceinline__ void st_peer4(unsigned addr, float4 v) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v.x), "f"(v.y), "f"(v.z),
               "f"(v.w)
               : "memory");
}

// The online softmax's running max after a chunk whose max is mx: it moves only when mx
// passes it by more than kLazyLog2 (or none was set), so a chunk's probabilities stay under
// 2^kLazyLog2 (f16 holds them with the same 11 bits as below 1; the sums and accumulators
// are float32) and most chunks leave it, and the accumulators' rescale, alone. Each partial
// keeps (max, sum, acc) consistent, so the merges' weights 2^(max - the largest max) are
// unchanged in meaning. A/B in one call, median over 26 points of every kernel family:
// 1.2-2 % faster (k1 0.988, w1s2 0.983, w2s2 0.982, k2 0.984; H200, QSA round 19).
constexpr float kLazyLog2 = 8.f;
__device__ __forceinline__ float lazy_max(float m, float mx) { return mx > m + kLazyLog2 ? mx : m; }

// bf16(a * inv * sigmoid(gate)) of 8 dims, gv holding their 8 bf16 gate values.
__device__ __forceinline__ uint4 gate_scaled(const uint4& gv, const float (&a)[8], float inv) {
  unsigned packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned gw = word_of(gv, i);
    const float g0 = fij::bf16_lo(gw), g1 = fij::bf16_hi(gw);
    // sigmoid(x) = 1 / (1 + 2^(-x log2 e)); exp overflow to inf gives 0, as it should. The
    // reciprocal is the approximate one (MUFU.RCP, ~1 ulp of float32, far under the bf16
    // output's rounding): an IEEE division per gate value was ~10 instructions and a
    // slow-path call, the largest part of a one-warp row's epilogue.
    const float s0 = __fdividef(1.f, 1.f + ex2(-1.4426950408889634f * g0));
    const float s1 = __fdividef(1.f, 1.f + ex2(-1.4426950408889634f * g1));
    packed[i] = pack_bf16x2(a[2 * i] * inv * s0, a[2 * i + 1] * inv * s1);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// out[0..8) = bf16(a * output_scale / denom * sigmoid(gate)); zeros when denom == 0 (no
// attended token), whatever the gate holds.
__device__ __forceinline__ void store_gated(fij::bf16_t* out, const fij::bf16_t* gate, const float (&a)[8],
                                            float denom, float output_scale) {
  // One 16-byte load (read through a plain dereference under the branch it was four 4-byte
  // loads), issued whether or not the row attended anything: the gate is a valid argument.
  const uint4 gv = __ldg(reinterpret_cast<const uint4*>(gate));
  *reinterpret_cast<uint4*>(out) = denom > 0.f ? gate_scaled(gv, a, output_scale / denom) : make_uint4(0, 0, 0, 0);
}

// store_gated with the gate values already loaded (a cluster's gate held in registers).
__device__ __forceinline__ void store_gated_value(fij::bf16_t* out, const uint4& gv, const float (&a)[8], float denom,
                                                  float output_scale) {
  *reinterpret_cast<uint4*>(out) = denom > 0.f ? gate_scaled(gv, a, output_scale / denom) : make_uint4(0, 0, 0, 0);
}

// A group's q as loaded (rows g and g + 8, 16-byte pieces 2t, 2t + 1 of each 64-dim group;
// rows past GROUP are zero). Loaded apart from q_fragments so the loads go out with the
// kernel's first global loads instead of behind its K/V gathers (one DRAM trip fewer on the
// critical path of a short call).
template <int NG>
struct QRaw {
  uint4 r0[NG][2], r1[NG][2];
};

// A group's q (GROUP rows of HEAD_DIM bf16) copied into a warp's shared-memory area at
// `dst` (row h at 2 HEAD_DIM h bytes) as one cp.async group. Issued with the kernel's first
// global loads, so the copy overlaps them instead of queueing behind the K/V gathers (one
// DRAM trip off the critical path of a short call), and it holds no registers meanwhile.
// (GROUP <= 16 rows of 2 HEAD_DIM bytes fit a warp stage, at least 32 HEAD_DIM bytes.)
template <int GROUP, int HEAD_DIM>
__device__ __forceinline__ void q_copy(unsigned dst, const fij::bf16_t* q, long long q_head, int lane) {
  constexpr int PIECES = HEAD_DIM / 8;  // 16-byte pieces of a row
#pragma unroll
  for (int i = lane; i < GROUP * PIECES; i += 32) {
    const int h = i / PIECES, c = i % PIECES;
    cp_async16(dst + 16 * i, q + h * q_head + 8 * c, true);
  }
  cp_async_commit();
}

// The A fragments of the group's q (copied to `qs` by q_copy; rows g and g + 8, rows past
// GROUP are zero) for k-step (G, u), in the K fragments' dim permutation, as fp16: each row
// is scaled by the power of two that puts its largest |q| in [2^14, 2^15), so bf16 -> fp16
// is exact for every component above 2^-28 of that maximum (below it, fp16 subnormals keep
// 2^-38 of it, far under fp32 accumulation error) and products with |k| <= 448 cannot
// overflow. The scale is undone in row_scale0/1 (score_scale_log2 / the row's scale).
template <int GROUP, int HEAD_DIM>
__device__ __forceinline__ void q_fragments(const unsigned char* qs, int g, int t, float score_scale_log2,
                                            uint4 (&frag)[HEAD_DIM / 64][4], float& row_scale0,
                                            float& row_scale1) {
  constexpr int NG = HEAD_DIM / 64;
  uint4 r0[NG][2], r1[NG][2];
  float amax0 = 0.f, amax1 = 0.f;
#pragma unroll
  for (int G = 0; G < NG; ++G) {
    r0[G][0] = r0[G][1] = r1[G][0] = r1[G][1] = make_uint4(0, 0, 0, 0);
    if (g < GROUP) {
      const uint4* p = reinterpret_cast<const uint4*>(qs + 2 * (g * HEAD_DIM + 64 * G + 16 * t));
      r0[G][0] = p[0];
      r0[G][1] = p[1];
    }
    if (g + 8 < GROUP) {
      const uint4* p = reinterpret_cast<const uint4*>(qs + 2 * ((g + 8) * HEAD_DIM + 64 * G + 16 * t));
      r1[G][0] = p[0];
      r1[G][1] = p[1];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      amax0 = fmaxf(amax0, bf16x2_absmax(word_of(r0[G][u / 4], u % 4)));
      amax1 = fmaxf(amax1, bf16x2_absmax(word_of(r1[G][u / 4], u % 4)));
    }
  }
  amax0 = fmaxf(amax0, __shfl_xor_sync(kFull, amax0, 1));
  amax0 = fmaxf(amax0, __shfl_xor_sync(kFull, amax0, 2));
  amax1 = fmaxf(amax1, __shfl_xor_sync(kFull, amax1, 1));
  amax1 = fmaxf(amax1, __shfl_xor_sync(kFull, amax1, 2));
  const int e0 = q_scale_exponent(amax0), e1 = q_scale_exponent(amax1);
  const float up0 = pow2(e0), up1 = pow2(e1);
  row_scale0 = score_scale_log2 * pow2(-e0);
  row_scale1 = score_scale_log2 * pow2(-e1);
#pragma unroll
  for (int G = 0; G < NG; ++G)
#pragma unroll
    for (int u = 0; u < 4; ++u)
      frag[G][u] = make_uint4(bf16x2_to_f16x2(word_of(r0[G][u / 2], 2 * (u % 2)), up0),
                              bf16x2_to_f16x2(word_of(r1[G][u / 2], 2 * (u % 2)), up1),
                              bf16x2_to_f16x2(word_of(r0[G][u / 2], 2 * (u % 2) + 1), up0),
                              bf16x2_to_f16x2(word_of(r1[G][u / 2], 2 * (u % 2) + 1), up1));
}

// Q's fragments live in shared memory for D=256 (registers go to the accumulator) and when
// the launch bound asks for 16+ warps per SM (128 registers a thread: Q's 32 must go).
constexpr bool q_in_smem(int head_dim, int num_warps, int min_ctas) {
  return head_dim > 128 || num_warps * min_ctas >= 16;
}

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Bytes of one warp stage: 16 tokens of K and V, as cp.async gathers them or (BULK) as
// bulk copies place them (qsa/bulk.cuh, bulk_row).
constexpr int stage_bytes(int head_dim, bool bulk) { return bulk ? kBulkStageBytes : (head_dim / 16) * 32 * 16; }

// Cluster split-K: item i (head i / PIECES, 8-dim piece i % PIECES) belongs to rank
// i % CLUSTER, at local index i / CLUSTER. Each rank pushes its partial of every item into
// the owner's inbox (shared memory past everything else, so a peer still in its loop is
// not disturbed): [CLUSTER sources][inbox_items(CLUSTER)][8] unnormalized accumulators,
// then [CLUSTER sources][16 heads] (max, sum) pairs.
template <int HEAD_DIM, int CLUSTER>
constexpr int inbox_items() {  // 0 for the single pass (CLUSTER 0), which has no inbox
  return CLUSTER > 0 ? (16 * (HEAD_DIM / 8) + CLUSTER - 1) / (CLUSTER > 0 ? CLUSTER : 1) : 0;
}
template <int HEAD_DIM, int CLUSTER>
constexpr int inbox_bytes() {
  return CLUSTER > 0 ? CLUSTER * (inbox_items<HEAD_DIM, CLUSTER>() * 8 + 16 * 2) * 4 : 0;
}

// Shared memory bytes of a decode specialization (the host computes the same:
// flashinfer_jit/qsa_kernels.py, decode_smem_bytes). After Q's fragments (when in smem):
// the warp stages, followed by the fused slot list (SLOT_CAP > 0) while the loop runs;
// afterwards the same space holds the cross-warp reduction. A cluster's inbox follows (its
// own space: peers write it while this CTA may still be in its loop), then the bulk
// copies' mbarriers, one per warp stage.
template <int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int CLUSTER, int SLOT_CAP, bool BULK>
struct DecodeSmem {
  static constexpr int kQBytes = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS) ? (HEAD_DIM / 64) * 4 * 32 * 16 : 0;
  static constexpr int kStageBytes = NUM_WARPS * NUM_STAGES * stage_bytes(HEAD_DIM, BULK);
  static constexpr int kRedBytes = NUM_WARPS * 16 * (HEAD_DIM + kRedPad) * 4 + NUM_WARPS * 16 * 2 * 4;
  static constexpr int kMainBytes = cmax(kStageBytes + SLOT_CAP * 4, kRedBytes);
  static constexpr int kInboxBytes = inbox_bytes<HEAD_DIM, CLUSTER>();
  static constexpr int kBarBytes = BULK ? NUM_WARPS * NUM_STAGES * 8 : 0;
  static constexpr int kBytes = kQBytes + kMainBytes + kInboxBytes + kBarBytes;
};

}  // namespace fij_qsa
