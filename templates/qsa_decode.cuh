// QSA fp8 sparse paged decode: attention of a row's query heads over the KV tokens the
// slot pass resolved, gathered from an e4m3 paged cache (see qsa_slots.cuh).
//
// One CTA per (row, kv head, split). The CTA's share of the row's 16-token chunks is dealt
// round-robin to its warps; each warp runs its own cp.async pipeline (NUM_STAGES chunks in
// flight, no block-wide barrier in the loop) and its own online softmax, and the warps'
// (max, sum, acc) are merged through shared memory at the end. With one split the CTA
// writes the gated bf16 output; with several it writes its unnormalized partial to a
// workspace, and the last split CTA of the (row, kv head) to finish (an atomic counter)
// merges the partials and writes the output: no second kernel.
//
// Tensor cores, m16n8k16 (rows = the group's query heads, zero-padded to 16):
//   S = Q K^T and P V in fp16 (e4m3 -> fp16 is exact; q is scaled per head so bf16 -> fp16
//   is exact too, see the Q fragment comment). P is rounded to fp16 (2^-11 relative): about
//   2e-4 of norm-wise error, a tenth of what the bf16 output rounding itself costs.
// The fragments are arranged so every thread gathers whole 16-byte (D=64: 8-byte) pieces
// of token rows and never needs a byte-wise shared-memory access:
//   * QK: the dot product's dim order is free, so quad lane t of the B fragment for token
//     n takes bytes [64G + 16t, +16) of K row n; k-step (G, u) uses its word u: bytes
//     0,1 are logical k = 2t, 2t+1 and bytes 2,3 are k = 2t+8, 2t+9. Q's A fragment is
//     loaded with the same permutation.
//   * PV: lane (g, t) gathers V bytes [(D/8)g, +D/8) of tokens 2t, 2t+1, 2t+8, 2t+9 (the
//     tokens its score fragment covers) and transposes 4x4 byte blocks with prmt, so n8
//     tile i, column g is dim (D/8)g + i. Thread (g, t) then accumulates the contiguous
//     dims [(D/4)t, (D/4)(t+1)) of heads g and g+8.
// Byte offsets into the cache are 64-bit (a layer's pool can pass 2**31 bytes); the cache
// strides themselves are 32-bit (the host checks), which keeps a token's address at two
// 32x32->64 multiply-adds.
#pragma once
#include "common.cuh"

namespace fij_qsa {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kChunk = 16;     // tokens per warp step: one k16 step of P V
constexpr int kRedPad = 4;     // floats padding each row of the cross-warp reduction
constexpr int kMaxSplits = 64;  // split-K merge bookkeeping fits the smallest smem layout

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
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

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

// out[0..8) = bf16(a * output_scale / denom * sigmoid(gate)); zeros when denom == 0 (no
// attended token), whatever the gate holds.
__device__ __forceinline__ void store_gated(fij::bf16_t* out, const fij::bf16_t* gate, const float (&a)[8],
                                            float denom, float output_scale) {
  uint4 res = make_uint4(0, 0, 0, 0);
  if (denom > 0.f) {
    const uint4 gv = *reinterpret_cast<const uint4*>(gate);
    const float inv = output_scale / denom;
    unsigned packed[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const unsigned gw = word_of(gv, i);
      const float g0 = fij::bf16_lo(gw), g1 = fij::bf16_hi(gw);
      // sigmoid(x) = 1 / (1 + 2^(-x log2 e)); exp overflow to inf gives 0, as it should.
      const float s0 = 1.f / (1.f + ex2(-1.4426950408889634f * g0));
      const float s1 = 1.f / (1.f + ex2(-1.4426950408889634f * g1));
      packed[i] = pack_bf16x2(a[2 * i] * inv * s0, a[2 * i + 1] * inv * s1);
    }
    res = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
  *reinterpret_cast<uint4*>(out) = res;
}

// Q's fragments live in shared memory for D=256 (registers go to the accumulator) and when
// the launch bound asks for 16+ warps per SM (128 registers a thread: Q's 32 must go).
constexpr bool q_in_smem(int head_dim, int num_warps, int min_ctas) {
  return head_dim > 128 || num_warps * min_ctas >= 16;
}

// Shared memory bytes of qsa_decode<..., HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS> (the
// host computes the same: flashinfer_jit/qsa.py, _decode_smem_bytes).
template <int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS>
struct DecodeSmem {
  static constexpr int kQBytes = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS) ? (HEAD_DIM / 64) * 4 * 32 * 16 : 0;
  static constexpr int kStageBytes = NUM_WARPS * NUM_STAGES * (HEAD_DIM / 16) * 32 * 16;
  static constexpr int kRedBytes = NUM_WARPS * 16 * (HEAD_DIM + kRedPad) * 4 + NUM_WARPS * 16 * 2 * 4;
  static constexpr int kBytes = kQBytes + (kStageBytes > kRedBytes ? kStageBytes : kRedBytes);
};

// MIN_CTAS: the CTAs per SM the register allocation must allow (launch bound; 1 = none).
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS)
qsa_decode(const fij::bf16_t* __restrict__ q, long long q_row, long long q_head,
           const unsigned char* __restrict__ k_cache, unsigned k_block, unsigned k_token, unsigned k_head,
           const unsigned char* __restrict__ v_cache, unsigned v_block, unsigned v_token, unsigned v_head,
           const int* __restrict__ slots, int slot_columns, const int* __restrict__ counts,
           long long count_row_stride, int topk, int offset_bits, int num_kv_heads,
           fij::bf16_t* __restrict__ out, long long out_row, long long out_head,
           const fij::bf16_t* __restrict__ gate, long long gate_row, long long gate_head,
           float score_scale_log2, float output_scale, float* __restrict__ part_acc,
           float* __restrict__ part_ml, unsigned* __restrict__ counters, int num_splits) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim");
  static_assert(GROUP >= 1 && GROUP <= 16, "group size");
  static_assert(NUM_STAGES >= 2 && NUM_STAGES <= 8, "stages (validity ring holds 8)");
  constexpr int NG = HEAD_DIM / 64;       // 64-dim groups of a K row: one 16-B piece per quad lane
  constexpr int KU = 2 * NG;              // K uint4s per thread per stage (2 tokens)
  constexpr int VW = HEAD_DIM / 32;       // V words per token per thread
  constexpr int VG = HEAD_DIM / 128;      // V 16-B pieces per token per thread (D >= 128)
  constexpr int NT = HEAD_DIM / 8;        // n8 tiles of the output
  constexpr int STAGE_U4 = HEAD_DIM / 16; // uint4s per thread per stage
  constexpr bool Q_SMEM = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS);
  constexpr int Q_U4 = Q_SMEM ? NG * 4 * 32 : 0;
  constexpr int RR = HEAD_DIM + kRedPad;
  using Smem = DecodeSmem<HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS>;
  static_assert(Smem::kQBytes == Q_U4 * 16, "smem layout");
  static_assert(Smem::kBytes - Smem::kQBytes >= (2 * kMaxSplits * 16 + 16) * 4, "split-K merge smem");

  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row = blockIdx.x / num_kv_heads;
  const int kvh = blockIdx.x - row * num_kv_heads;
  const int split = blockIdx.y;

  const int count = min(max(__ldg(counts + (long long)row * count_row_stride), 0), topk);
  const int chunks = (count + kChunk - 1) / kChunk;
  const int per_split = (chunks + num_splits - 1) / num_splits;
  const int c_begin = split * per_split;
  const int c_end = min(chunks, c_begin + per_split);

  // ---- Q fragments (rows g, g+8 of the group; padding rows are zero) -------------------
  // QK runs in fp16 so K needs one cvt per two e4m3 bytes. Each head's q is scaled by a
  // power of two that puts its largest |q| in [2^14, 2^15): bf16 -> fp16 is then exact for
  // every component above 2^-28 of that maximum (below it, fp16 subnormals keep 2^-38 of
  // it, far under fp32 accumulation error), and products with |k| <= 448 cannot overflow.
  // The scale is undone in the per-row score factor.
  uint4 qreg[Q_SMEM ? 1 : NG][4];
  float row_scale0, row_scale1;  // score_scale_log2 / (q scale) of rows g and g + 8
  {
    const long long head0 = (long long)row * q_row + (long long)(kvh * GROUP) * q_head;
    uint4 r0[NG][2], r1[NG][2];
    float amax0 = 0.f, amax1 = 0.f;
#pragma unroll
    for (int G = 0; G < NG; ++G) {
      r0[G][0] = r0[G][1] = r1[G][0] = r1[G][1] = make_uint4(0, 0, 0, 0);
      if (g < GROUP) {
        const uint4* p = reinterpret_cast<const uint4*>(q + head0 + g * q_head + 64 * G + 16 * t);
        r0[G][0] = __ldg(p);
        r0[G][1] = __ldg(p + 1);
      }
      if (g + 8 < GROUP) {
        const uint4* p = reinterpret_cast<const uint4*>(q + head0 + (g + 8) * q_head + 64 * G + 16 * t);
        r1[G][0] = __ldg(p);
        r1[G][1] = __ldg(p + 1);
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
    for (int G = 0; G < NG; ++G) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const uint4 f = make_uint4(bf16x2_to_f16x2(word_of(r0[G][u / 2], 2 * (u % 2)), up0),
                                   bf16x2_to_f16x2(word_of(r1[G][u / 2], 2 * (u % 2)), up1),
                                   bf16x2_to_f16x2(word_of(r0[G][u / 2], 2 * (u % 2) + 1), up0),
                                   bf16x2_to_f16x2(word_of(r1[G][u / 2], 2 * (u % 2) + 1), up1));
        if constexpr (Q_SMEM) {
          if (warp == 0) smem[(G * 4 + u) * 32 + lane] = f;
        } else {
          qreg[G][u] = f;
        }
      }
    }
    if constexpr (Q_SMEM) __syncthreads();
  }

  // ---- per-warp pipeline ----------------------------------------------------------------
  uint4* const wbase = smem + Q_U4 + warp * NUM_STAGES * STAGE_U4 * 32;
  const int first = c_begin + warp;
  const int my_n = c_end > first ? (c_end - first + NUM_WARPS - 1) / NUM_WARPS : 0;
  const int* const srow = slots + (long long)row * slot_columns;
  const unsigned char* const kbase = k_cache + (unsigned long long)kvh * k_head + 16 * t;
  const unsigned char* const vbase = v_cache + (unsigned long long)kvh * v_head + (HEAD_DIM / 8) * g;
  const unsigned offset_mask = (1u << offset_bits) - 1u;

  struct ChunkSlots { int k0, k1, v0, v1, v2, v3; };
  auto load_slots = [&](int k) {
    const int* p = srow + (first + k * NUM_WARPS) * kChunk;
    const int2 a = __ldg(reinterpret_cast<const int2*>(p + 2 * t));
    const int2 b = __ldg(reinterpret_cast<const int2*>(p + 8 + 2 * t));
    return ChunkSlots{__ldg(p + g), __ldg(p + 8 + g), a.x, a.y, b.x, b.y};
  };
  // A token's address: the host guarantees 32-bit strides, so two 32x32->64-bit
  // multiply-adds; a masked slot (-1) reads as slot 0, a valid address the zero-byte copy
  // never touches (no branch per token).
  auto token_ptr = [&](const unsigned char* base, int slot, unsigned blk, unsigned tok) {
    const unsigned s = (unsigned)max(slot, 0);
    const unsigned long long off =
        (unsigned long long)(s >> offset_bits) * blk + (unsigned long long)(s & offset_mask) * tok;
    return base + off;
  };
  // Issue chunk k's copies into its stage; returns its 4 V-token validity bits.
  auto issue = [&](int k, const ChunkSlots& s) -> unsigned {
    const unsigned st = smem_u32(wbase + (k % NUM_STAGES) * STAGE_U4 * 32);
    const int ks[2] = {s.k0, s.k1};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool ok = ks[j] >= 0;
      const unsigned char* src = token_ptr(kbase, ks[j], k_block, k_token);
#pragma unroll
      for (int G = 0; G < NG; ++G) cp_async16(st + ((j * NG + G) * 32 + lane) * 16, src + 64 * G, ok);
    }
    const int vs[4] = {s.v0, s.v1, s.v2, s.v3};
    const unsigned vst = st + KU * 32 * 16;
    unsigned bits = 0;
#pragma unroll
    for (int tau = 0; tau < 4; ++tau) {
      const bool ok = vs[tau] >= 0;
      bits |= ok ? 1u << tau : 0u;
      const unsigned char* src = token_ptr(vbase, vs[tau], v_block, v_token);
      if constexpr (HEAD_DIM == 64) {
        cp_async8(vst + (tau * 32 + lane) * 8, src, ok);
      } else {
#pragma unroll
        for (int p = 0; p < VG; ++p) cp_async16(vst + ((tau * VG + p) * 32 + lane) * 16, src + 16 * p, ok);
      }
    }
    return bits;
  };

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const float neg_inf = __int_as_float(0xff800000);
  float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;

  // Prologue: slot loads of the first NUM_STAGES - 1 chunks in parallel, then their copies.
  unsigned ring = 0;
  {
    ChunkSlots pre[NUM_STAGES - 1];
#pragma unroll
    for (int k = 0; k < NUM_STAGES - 1; ++k)
      if (k < my_n) pre[k] = load_slots(k);
#pragma unroll
    for (int k = 0; k < NUM_STAGES - 1; ++k) {
      if (k < my_n) ring |= issue(k, pre[k]) << (4 * k);
      cp_async_commit();
    }
  }
  ChunkSlots next{};
  if (NUM_STAGES - 1 < my_n) next = load_slots(NUM_STAGES - 1);

  for (int k = 0; k < my_n; ++k) {
    if (k + NUM_STAGES - 1 < my_n) ring |= issue(k + NUM_STAGES - 1, next) << (4 * (NUM_STAGES - 1));
    cp_async_commit();
    if (k + NUM_STAGES < my_n) next = load_slots(k + NUM_STAGES);
    cp_async_wait<NUM_STAGES - 1>();
    const unsigned bits = ring & 0xfu;
    ring >>= 4;
    const uint4* st = wbase + (k % NUM_STAGES) * STAGE_U4 * 32;

    // S = Q K^T over this chunk's 16 tokens (two n8 tiles).
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int G = 0; G < NG; ++G) {
        const uint4 kk = st[(j * NG + G) * 32 + lane];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          unsigned lo, hi;
          e4m3x4_to_f16x2x2(word_of(kk, u), lo, hi);
          uint4 a;
          if constexpr (Q_SMEM) a = smem[(G * 4 + u) * 32 + lane];
          else a = qreg[G][u];
          mma_f16(s[j], a, lo, hi);
        }
      }
    }

    // Online softmax in base 2; masked tokens are -inf and never produce NaN.
    float x[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const bool ok0 = (bits >> (2 * j)) & 1u, ok1 = (bits >> (2 * j + 1)) & 1u;
      x[j][0] = ok0 ? s[j][0] * row_scale0 : neg_inf;
      x[j][1] = ok1 ? s[j][1] * row_scale0 : neg_inf;
      x[j][2] = ok0 ? s[j][2] * row_scale1 : neg_inf;
      x[j][3] = ok1 ? s[j][3] * row_scale1 : neg_inf;
    }
    float mx0 = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
    float mx1 = fmaxf(fmaxf(x[0][2], x[0][3]), fmaxf(x[1][2], x[1][3]));
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(kFull, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(kFull, mx1, 2));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float b0 = n0 == neg_inf ? 0.f : n0, b1 = n1 == neg_inf ? 0.f : n1;
    const float alpha0 = ex2(m0 - b0), alpha1 = ex2(m1 - b1);
    m0 = n0;
    m1 = n1;
    float p[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      p[j][0] = ex2(x[j][0] - b0);
      p[j][1] = ex2(x[j][1] - b0);
      p[j][2] = ex2(x[j][2] - b1);
      p[j][3] = ex2(x[j][3] - b1);
    }
    l0 = l0 * alpha0 + (p[0][0] + p[0][1]) + (p[1][0] + p[1][1]);
    l1 = l1 * alpha1 + (p[0][2] + p[0][3]) + (p[1][2] + p[1][3]);
    // Once the running max settles alpha is exactly 1: skip the rescale warp-wide.
    if (__any_sync(kFull, alpha0 != 1.f || alpha1 != 1.f)) {
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        acc[i][0] *= alpha0;
        acc[i][1] *= alpha0;
        acc[i][2] *= alpha1;
        acc[i][3] *= alpha1;
      }
    }
    const uint4 pa = make_uint4(pack_f16x2(p[0][0], p[0][1]), pack_f16x2(p[0][2], p[0][3]),
                                pack_f16x2(p[1][0], p[1][1]), pack_f16x2(p[1][2], p[1][3]));

    // O += P V: transpose 4 tokens x 4 dims of e4m3 per word into f16x2 B fragments.
    const uint4* vs = st + KU * 32;
#pragma unroll
    for (int w = 0; w < VW; ++w) {
      unsigned tw[4];
#pragma unroll
      for (int tau = 0; tau < 4; ++tau) {
        if constexpr (HEAD_DIM == 64) {
          const uint2 v = reinterpret_cast<const uint2*>(vs)[tau * 32 + lane];
          tw[tau] = w == 0 ? v.x : v.y;
        } else {
          tw[tau] = word_of(vs[(tau * VG + w / 4) * 32 + lane], w % 4);
        }
      }
      const unsigned x0 = prmt(tw[0], tw[1], 0x5140), x1 = prmt(tw[0], tw[1], 0x7362);
      const unsigned y0 = prmt(tw[2], tw[3], 0x5140), y1 = prmt(tw[2], tw[3], 0x7362);
      unsigned b[4][2];
      e4m3x4_to_f16x2x2(x0, b[0][0], b[1][0]);
      e4m3x4_to_f16x2x2(x1, b[2][0], b[3][0]);
      e4m3x4_to_f16x2x2(y0, b[0][1], b[1][1]);
      e4m3x4_to_f16x2x2(y1, b[2][1], b[3][1]);
#pragma unroll
      for (int i = 0; i < 4; ++i) mma_f16(acc[4 * w + i], pa, b[i][0], b[i][1]);
    }
  }

  // ---- merge the warps -----------------------------------------------------------------
  l0 += __shfl_xor_sync(kFull, l0, 1);
  l0 += __shfl_xor_sync(kFull, l0, 2);
  l1 += __shfl_xor_sync(kFull, l1, 1);
  l1 += __shfl_xor_sync(kFull, l1, 2);
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with its stages: reuse them
  float* const red = reinterpret_cast<float*>(smem + Q_U4);
  float* const red_ml = red + NUM_WARPS * 16 * RR;
  {
    float* const mine = red + warp * 16 * RR;
    const int d0 = (HEAD_DIM / 8) * (2 * t), d1 = (HEAD_DIM / 8) * (2 * t + 1);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      mine[g * RR + d0 + i] = acc[i][0];
      mine[g * RR + d1 + i] = acc[i][1];
      mine[(g + 8) * RR + d0 + i] = acc[i][2];
      mine[(g + 8) * RR + d1 + i] = acc[i][3];
    }
    if (t == 0) {
      red_ml[(warp * 16 + g) * 2] = m0;
      red_ml[(warp * 16 + g) * 2 + 1] = l0;
      red_ml[(warp * 16 + g + 8) * 2] = m1;
      red_ml[(warp * 16 + g + 8) * 2 + 1] = l1;
    }
  }
  __syncthreads();
  constexpr int PIECES = HEAD_DIM / 8;
  for (int item = threadIdx.x; item < GROUP * PIECES; item += NUM_WARPS * 32) {
    const int h = item / PIECES, c = item - h * PIECES;
    float mmax = neg_inf;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) mmax = fmaxf(mmax, red_ml[(w * 16 + h) * 2]);
    const float base = mmax == neg_inf ? 0.f : mmax;
    float denom = 0.f, a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float sc = ex2(red_ml[(w * 16 + h) * 2] - base);
      denom += red_ml[(w * 16 + h) * 2 + 1] * sc;
      const float4* src = reinterpret_cast<const float4*>(red + (w * 16 + h) * RR + 8 * c);
      const float4 u = src[0], v = src[1];
      a[0] += u.x * sc; a[1] += u.y * sc; a[2] += u.z * sc; a[3] += u.w * sc;
      a[4] += v.x * sc; a[5] += v.y * sc; a[6] += v.z * sc; a[7] += v.w * sc;
    }
    const long long head = (long long)kvh * GROUP + h;
    if (num_splits == 1) {
      store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                  a, denom, output_scale);
    } else {
      const long long part = ((long long)blockIdx.x * num_splits + split) * GROUP + h;
      float4* dst = reinterpret_cast<float4*>(part_acc + part * HEAD_DIM + 8 * c);
      dst[0] = make_float4(a[0], a[1], a[2], a[3]);
      dst[1] = make_float4(a[4], a[5], a[6], a[7]);
      if (c == 0) {
        part_ml[part * 2] = mmax;
        part_ml[part * 2 + 1] = denom;
      }
    }
  }
  if (num_splits == 1) return;

  // ---- split-K: the last CTA of this (row, kv head) to finish merges all the splits ------
  // counters[blockIdx.x] is zeroed by the slot pass of the same call (stream-ordered, so
  // graph replays and concurrent streams with their own workspaces are safe).
  __shared__ int is_last;
  __threadfence();  // this CTA's partial is visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counters + blockIdx.x, 1u) == (unsigned)num_splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const long long part0 = (long long)blockIdx.x * num_splits * GROUP;
  const int n_parts = num_splits * GROUP;
  float* const weight = reinterpret_cast<float*>(smem + Q_U4);  // [split][head]: 2^(m - max)
  float* const sums = weight + n_parts;                           // [split][head]: l
  float* const denoms = sums + n_parts;                        // [head]
  for (int i = threadIdx.x; i < n_parts; i += NUM_WARPS * 32) {
    weight[i] = __ldcg(part_ml + (part0 + i) * 2);
    sums[i] = __ldcg(part_ml + (part0 + i) * 2 + 1);
  }
  __syncthreads();
  if (threadIdx.x < GROUP) {
    const int h = threadIdx.x;
    float mmax = neg_inf;
    for (int s = 0; s < num_splits; ++s) mmax = fmaxf(mmax, weight[s * GROUP + h]);
    const float base = mmax == neg_inf ? 0.f : mmax;
    float denom = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = ex2(weight[s * GROUP + h] - base);
      weight[s * GROUP + h] = w;
      denom += sums[s * GROUP + h] * w;
    }
    denoms[h] = denom;
  }
  __syncthreads();
  // Every thread streams its items' partials from L2 with several loads in flight.
  for (int item = threadIdx.x; item < GROUP * PIECES; item += NUM_WARPS * 32) {
    const int h = item / PIECES, c = item - h * PIECES;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float4* src = reinterpret_cast<const float4*>(part_acc + (part0 + h) * HEAD_DIM + 8 * c);
    const long long step = (long long)GROUP * HEAD_DIM / 4;  // float4s between splits
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float w = weight[s * GROUP + h];
      const float4 u = __ldcg(src + s * step), v = __ldcg(src + s * step + 1);
      a[0] += u.x * w; a[1] += u.y * w; a[2] += u.z * w; a[3] += u.w * w;
      a[4] += v.x * w; a[5] += v.y * w; a[6] += v.z * w; a[7] += v.w * w;
    }
    const long long head = (long long)kvh * GROUP + h;
    store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                a, denoms[h], output_scale);
  }
}

}  // namespace fij_qsa
