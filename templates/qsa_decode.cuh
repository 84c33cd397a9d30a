// QSA fp8 sparse paged decode: attention of a row's query heads over the KV tokens the
// slot pass resolved, gathered from an e4m3 paged cache (see qsa_slots.cuh).
//
// One CTA per (row, group of HEADS kv heads, split). The CTA's warps are split evenly over
// its kv heads (NUM_WARPS / HEADS warps per head); a head's share of the row's 16-token
// chunks is dealt round-robin to its warps. Each warp runs its own cp.async pipeline
// (NUM_STAGES chunks in flight, no block-wide barrier in the loop) and its own online
// softmax, and each head's warps' (max, sum, acc) are merged through shared memory at the
// end. HEADS > 1 makes one CTA walk the same tokens for several kv heads at once (the
// heads' pieces of a token are requested together, the slot list is read once per CTA);
// HEADS = 1 spreads a row over more, shorter CTAs. With one split the CTA writes the
// gated bf16 output. With several (split-K), either (qsa_decode) each writes its
// unnormalized partial to a workspace and the last split CTA of the (row, head group) to
// finish (an atomic counter) merges them, or (qsa_decode_cluster) the splits form one
// thread block cluster and merge through distributed shared memory, optionally resolving
// their own slots so the call needs no slot pass: one launch, no workspace.
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

// Thread-block-cluster helpers (sm_90+): rank, barrier, and loads from a peer CTA's smem.
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned peer_addr(const void* p, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_peer(unsigned addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_peer4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
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

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Shared memory bytes of a decode specialization (the host computes the same:
// flashinfer_jit/qsa.py, _decode_smem_bytes). After Q's fragments (when in smem): the warp
// stages, followed by the fused slot list (SLOT_CAP > 0) while the loop runs; afterwards the
// same space holds the cross-warp reduction, then either the split-K merge's weights or (a
// cluster) this CTA's partial, placed past the reduction so peers can read it.
template <int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int HEADS, int CLUSTER, int SLOT_CAP>
struct DecodeSmem {
  static constexpr int kQHeadU4 = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS) ? (HEAD_DIM / 64) * 4 * 32 : 0;
  static constexpr int kQBytes = HEADS * kQHeadU4 * 16;
  static constexpr int kStageBytes = NUM_WARPS * NUM_STAGES * (HEAD_DIM / 16) * 32 * 16;
  static constexpr int kRedBytes = NUM_WARPS * 16 * (HEAD_DIM + kRedPad) * 4 + NUM_WARPS * 16 * 2 * 4;
  static constexpr int kMergeBytes = (2 * kMaxSplits * 16 + 16) * HEADS * 4;
  static constexpr int kPartBytes = CLUSTER > 0 ? HEADS * 16 * (HEAD_DIM + 2) * 4 : 0;
  static constexpr int kBytes =
      kQBytes + cmax(kStageBytes + SLOT_CAP * 4, cmax(kRedBytes + kPartBytes, kMergeBytes));
};

// The decode's arguments. The last group is for fused slot resolution only (SLOT_CAP > 0):
// the raw selection, page table and row -> request map the slot pass would read.
#define FIJ_QSA_DECODE_PARAMS                                                                              \
  const fij::bf16_t *__restrict__ q, long long q_row, long long q_head,                                     \
      const unsigned char *__restrict__ k_cache, unsigned k_block, unsigned k_token, unsigned k_head,       \
      const unsigned char *__restrict__ v_cache, unsigned v_block, unsigned v_token, unsigned v_head,       \
      const int *__restrict__ slots, int slot_columns, const int *__restrict__ counts,                      \
      long long count_row_stride, int topk, int offset_bits, int num_kv_heads, fij::bf16_t *__restrict__ out, \
      long long out_row, long long out_head, const fij::bf16_t *__restrict__ gate, long long gate_row,      \
      long long gate_head, float score_scale_log2, float output_scale, float *__restrict__ part_acc,         \
      float *__restrict__ part_ml, unsigned *__restrict__ counters, int num_splits,                         \
      const int *__restrict__ indices, long long idx_col_stride, const int *__restrict__ block_table,       \
      long long bt_row_stride, long long bt_col_stride, int table_width, int num_requests,                  \
      const int *__restrict__ token_to_req, long long t2r_stride, int num_blocks, int page_size
#define FIJ_QSA_DECODE_ARGS                                                                                 \
  q, q_row, q_head, k_cache, k_block, k_token, k_head, v_cache, v_block, v_token, v_head, slots,            \
      slot_columns, counts, count_row_stride, topk, offset_bits, num_kv_heads, out, out_row, out_head, gate, \
      gate_row, gate_head, score_scale_log2, output_scale, part_acc, part_ml, counters, num_splits, indices, \
      idx_col_stride, block_table, bt_row_stride, bt_col_stride, table_width, num_requests, token_to_req,   \
      t2r_stride, num_blocks, page_size

// MIN_CTAS: the CTAs per SM the register allocation must allow (launch bound; 1 = none).
// HEADS: kv heads per CTA (the host guarantees num_kv_heads % HEADS == 0).
// CLUSTER: 0, or the split count when the splits of a (row, head group) form one thread
//   block cluster and merge through distributed shared memory (no workspace, no counters).
// SLOT_CAP: 0 (slots come from the slot pass), or the most entries one CTA resolves itself
//   from the raw selection into shared memory (the slot pass is skipped).
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int HEADS, int CLUSTER,
          int SLOT_CAP>
__device__ __forceinline__ void decode_body(FIJ_QSA_DECODE_PARAMS) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim");
  static_assert(GROUP >= 1 && GROUP <= 16, "group size");
  static_assert(NUM_STAGES >= 2 && NUM_STAGES <= 8, "stages (validity ring holds 8)");
  static_assert(HEADS >= 1 && NUM_WARPS % HEADS == 0, "warps split evenly over the CTA's heads");
  constexpr int WPH = NUM_WARPS / HEADS;  // warps per kv head
  constexpr int NG = HEAD_DIM / 64;       // 64-dim groups of a K row: one 16-B piece per quad lane
  constexpr int KU = 2 * NG;              // K uint4s per thread per stage (2 tokens)
  constexpr int VW = HEAD_DIM / 32;       // V words per token per thread
  constexpr int VG = HEAD_DIM / 128;      // V 16-B pieces per token per thread (D >= 128)
  constexpr int NT = HEAD_DIM / 8;        // n8 tiles of the output
  constexpr int STAGE_U4 = HEAD_DIM / 16; // uint4s per thread per stage
  constexpr bool Q_SMEM = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS);
  constexpr int QH_U4 = Q_SMEM ? NG * 4 * 32 : 0;  // one head's Q fragments
  constexpr int Q_U4 = HEADS * QH_U4;
  constexpr int RR = HEAD_DIM + kRedPad;
  using Smem = DecodeSmem<HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, HEADS, CLUSTER, SLOT_CAP>;
  static_assert(Smem::kQBytes == Q_U4 * 16, "smem layout");

  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int head_groups = num_kv_heads / HEADS;
  const int row = blockIdx.x / head_groups;
  const int hl = warp / WPH, wih = warp - hl * WPH;  // this warp's head in the CTA, rank in it
  const int kvh = (blockIdx.x - row * head_groups) * HEADS + hl;
  const int split = blockIdx.y;
  uint4* const qsm = smem + hl * QH_U4;  // this warp's head's Q fragments (Q_SMEM)

  const int count = min(max(__ldg(counts + (long long)row * count_row_stride), 0), topk);
  const int chunks = (count + kChunk - 1) / kChunk;
  const int per_split = (chunks + num_splits - 1) / num_splits;
  const int c_begin = split * per_split;
  const int c_end = min(chunks, c_begin + per_split);

  // ---- fused slot resolution: this CTA's entries, once, into shared memory ---------------
  // Same rules as the slot pass (qsa_slots.cuh); the host keeps (c_end - c_begin) * kChunk
  // <= SLOT_CAP.
  int* const slot_list = reinterpret_cast<int*>(smem + Q_U4 + NUM_WARPS * NUM_STAGES * STAGE_U4 * 32);
  if constexpr (SLOT_CAP > 0) {
    const int request = __ldg(token_to_req + (long long)row * t2r_stride);
    const bool req_ok = request >= 0 && request < num_requests;
    const int n_tok = max(c_end - c_begin, 0) * kChunk;
    const int* const irow = indices + (long long)row * count_row_stride;
    for (int i = threadIdx.x; i < n_tok; i += NUM_WARPS * 32) {
      const int j = c_begin * kChunk + i;
      int slot = -1;
      if (j < count && req_ok) {
        const int logical = __ldg(irow + (long long)j * idx_col_stride);
        const int page = logical / page_size;
        if (logical >= 0 && page < table_width) {
          const int physical =
              __ldg(block_table + (long long)request * bt_row_stride + (long long)page * bt_col_stride);
          if (physical >= 0 && physical < num_blocks) slot = (physical << offset_bits) | (logical - page * page_size);
        }
      }
      slot_list[i] = slot;
    }
    __syncthreads();
  }

  // ---- per-warp pipeline (its first copies go out before Q is loaded: they overlap) ----
  uint4* const wbase = smem + Q_U4 + warp * NUM_STAGES * STAGE_U4 * 32;
  const int first = c_begin + wih;
  const int my_n = c_end > first ? (c_end - first + WPH - 1) / WPH : 0;
  const int* const srow = slots + (long long)row * slot_columns;
  const unsigned char* const kbase = k_cache + (unsigned long long)kvh * k_head + 16 * t;
  const unsigned char* const vbase = v_cache + (unsigned long long)kvh * v_head + (HEAD_DIM / 8) * g;
  const unsigned offset_mask = (1u << offset_bits) - 1u;

  struct ChunkSlots { int k0, k1, v0, v1, v2, v3; };
  auto load_slots = [&](int k) {
    if constexpr (SLOT_CAP > 0) {
      const int* p = slot_list + (first + k * WPH - c_begin) * kChunk;
      const int2 a = *reinterpret_cast<const int2*>(p + 2 * t);
      const int2 b = *reinterpret_cast<const int2*>(p + 8 + 2 * t);
      return ChunkSlots{p[g], p[8 + g], a.x, a.y, b.x, b.y};
    } else {
      const int* p = srow + (first + k * WPH) * kChunk;
      const int2 a = __ldg(reinterpret_cast<const int2*>(p + 2 * t));
      const int2 b = __ldg(reinterpret_cast<const int2*>(p + 8 + 2 * t));
      return ChunkSlots{__ldg(p + g), __ldg(p + 8 + g), a.x, a.y, b.x, b.y};
    }
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
          if (wih == 0) qsm[(G * 4 + u) * 32 + lane] = f;
        } else {
          qreg[G][u] = f;
        }
      }
    }
    if constexpr (Q_SMEM) __syncthreads();
  }

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
          if constexpr (Q_SMEM) a = qsm[(G * 4 + u) * 32 + lane];
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
  // A cluster's partials: [HEADS * GROUP][HEAD_DIM] then (max, sum) pairs, past the reduction.
  float* const cpart = red + NUM_WARPS * 16 * RR + NUM_WARPS * 16 * 2;
  float* const cml = cpart + HEADS * GROUP * HEAD_DIM;
  const int cta_head0 = (blockIdx.x - row * head_groups) * HEADS * GROUP;  // first query head
  for (int item = threadIdx.x; item < HEADS * GROUP * PIECES; item += NUM_WARPS * 32) {
    const int hh = item / PIECES, c = item - hh * PIECES;  // hh: query head within the CTA
    const int h = hh % GROUP, w0 = (hh / GROUP) * WPH;     // its kv head's first warp
    float mmax = neg_inf;
#pragma unroll
    for (int w = w0; w < w0 + WPH; ++w) mmax = fmaxf(mmax, red_ml[(w * 16 + h) * 2]);
    const float base = mmax == neg_inf ? 0.f : mmax;
    float denom = 0.f, a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = w0; w < w0 + WPH; ++w) {
      const float sc = ex2(red_ml[(w * 16 + h) * 2] - base);
      denom += red_ml[(w * 16 + h) * 2 + 1] * sc;
      const float4* src = reinterpret_cast<const float4*>(red + (w * 16 + h) * RR + 8 * c);
      const float4 u = src[0], v = src[1];
      a[0] += u.x * sc; a[1] += u.y * sc; a[2] += u.z * sc; a[3] += u.w * sc;
      a[4] += v.x * sc; a[5] += v.y * sc; a[6] += v.z * sc; a[7] += v.w * sc;
    }
    const long long head = cta_head0 + hh;
    if constexpr (CLUSTER > 0) {
      float* const dst = cpart + hh * HEAD_DIM + 8 * c;
      reinterpret_cast<float4*>(dst)[0] = make_float4(a[0], a[1], a[2], a[3]);
      reinterpret_cast<float4*>(dst)[1] = make_float4(a[4], a[5], a[6], a[7]);
      if (c == 0) {
        cml[hh * 2] = mmax;
        cml[hh * 2 + 1] = denom;
      }
    } else if (num_splits == 1) {
      store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                  a, denom, output_scale);
    } else {
      // Partials are laid out [row, kv head, split, query head of the group].
      const long long part = (((long long)blockIdx.x * HEADS + hh / GROUP) * num_splits + split) * GROUP + h;
      float4* dst = reinterpret_cast<float4*>(part_acc + part * HEAD_DIM + 8 * c);
      dst[0] = make_float4(a[0], a[1], a[2], a[3]);
      dst[1] = make_float4(a[4], a[5], a[6], a[7]);
      if (c == 0) {
        part_ml[part * 2] = mmax;
        part_ml[part * 2 + 1] = denom;
      }
    }
  }
  if constexpr (CLUSTER > 0) {
    // ---- cluster split-K: every split's partial is in its CTA's shared memory; rank r
    // merges every CLUSTER-th item from all of them and writes the gated output.
    cluster_sync();
    for (int item = cluster_rank() * NUM_WARPS * 32 + threadIdx.x; item < HEADS * GROUP * PIECES;
         item += CLUSTER * NUM_WARPS * 32) {
      const int hh = item / PIECES, c = item - hh * PIECES;
      float ms[CLUSTER];
      float mmax = neg_inf;
#pragma unroll
      for (int s = 0; s < CLUSTER; ++s) {
        ms[s] = ld_peer(peer_addr(cml + hh * 2, s));
        mmax = fmaxf(mmax, ms[s]);
      }
      const float base = mmax == neg_inf ? 0.f : mmax;
      float denom = 0.f, a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < CLUSTER; ++s) {
        const float w = ex2(ms[s] - base);
        denom += ld_peer(peer_addr(cml + hh * 2 + 1, s)) * w;
        const unsigned src = peer_addr(cpart + hh * HEAD_DIM + 8 * c, s);
        const float4 u = ld_peer4(src), v = ld_peer4(src + 16);
        a[0] += u.x * w; a[1] += u.y * w; a[2] += u.z * w; a[3] += u.w * w;
        a[4] += v.x * w; a[5] += v.y * w; a[6] += v.z * w; a[7] += v.w * w;
      }
      const long long head = cta_head0 + hh;
      store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                  a, denom, output_scale);
    }
    cluster_sync();  // no CTA leaves while a peer may still read its shared memory
    return;
  }
  if (num_splits == 1) return;

  // ---- split-K: the last CTA of this (row, head group) to finish merges all the splits ---
  // counters[blockIdx.x] is zeroed by the slot pass of the same call (stream-ordered, so
  // graph replays and concurrent streams with their own workspaces are safe).
  __shared__ int is_last;
  __threadfence();  // this CTA's partial is visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counters + blockIdx.x, 1u) == (unsigned)num_splits - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // This CTA's partials: [kv head of the CTA][split][query head of the group], contiguous.
  const long long part0 = (long long)blockIdx.x * HEADS * num_splits * GROUP;
  const int n_parts = HEADS * num_splits * GROUP;
  float* const weight = reinterpret_cast<float*>(smem + Q_U4);  // 2^(m - max) per partial
  float* const sums = weight + n_parts;                           // l per partial
  float* const denoms = sums + n_parts;                           // [HEADS * GROUP]
  for (int i = threadIdx.x; i < n_parts; i += NUM_WARPS * 32) {
    weight[i] = __ldcg(part_ml + (part0 + i) * 2);
    sums[i] = __ldcg(part_ml + (part0 + i) * 2 + 1);
  }
  __syncthreads();
  if (threadIdx.x < HEADS * GROUP) {
    const int hh = threadIdx.x, h = hh % GROUP;
    const int b = (hh / GROUP) * num_splits * GROUP + h;  // partial of split 0
    float mmax = neg_inf;
    for (int s = 0; s < num_splits; ++s) mmax = fmaxf(mmax, weight[b + s * GROUP]);
    const float base = mmax == neg_inf ? 0.f : mmax;
    float denom = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = ex2(weight[b + s * GROUP] - base);
      weight[b + s * GROUP] = w;
      denom += sums[b + s * GROUP] * w;
    }
    denoms[hh] = denom;
  }
  __syncthreads();
  // Every thread streams its items' partials from L2 with several loads in flight.
  for (int item = threadIdx.x; item < HEADS * GROUP * PIECES; item += NUM_WARPS * 32) {
    const int hh = item / PIECES, c = item - hh * PIECES, h = hh % GROUP;
    const int b = (hh / GROUP) * num_splits * GROUP + h;
    float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    const float4* src = reinterpret_cast<const float4*>(part_acc + (part0 + b) * HEAD_DIM + 8 * c);
    const long long step = (long long)GROUP * HEAD_DIM / 4;  // float4s between splits
#pragma unroll 8
    for (int s = 0; s < num_splits; ++s) {
      const float w = weight[b + s * GROUP];
      const float4 u = __ldcg(src + s * step), v = __ldcg(src + s * step + 1);
      a[0] += u.x * w; a[1] += u.y * w; a[2] += u.z * w; a[3] += u.w * w;
      a[4] += v.x * w; a[5] += v.y * w; a[6] += v.z * w; a[7] += v.w * w;
    }
    const long long head = cta_head0 + hh;
    store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                a, denoms[hh], output_scale);
  }
}

// The decode kernel: slots from the slot pass; split-K (num_splits > 1) merges through a
// workspace and a completion counter.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int HEADS>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) qsa_decode(FIJ_QSA_DECODE_PARAMS) {
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, HEADS, 0, 0>(FIJ_QSA_DECODE_ARGS);
}

// The small-batch kernel: CLUSTER splits per (row, head group) in one thread block cluster
// (grid.y = CLUSTER), merged through distributed shared memory; SLOT_CAP > 0 also resolves
// the slots in the kernel, so a call is this one launch.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int HEADS, int CLUSTER,
          int SLOT_CAP>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__(NUM_WARPS * 32, MIN_CTAS)
    qsa_decode_cluster(FIJ_QSA_DECODE_PARAMS) {
  static_assert(CLUSTER >= 2 && CLUSTER <= 8, "portable cluster sizes");
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, HEADS, CLUSTER, SLOT_CAP>(FIJ_QSA_DECODE_ARGS);
}

#undef FIJ_QSA_DECODE_ARGS
#undef FIJ_QSA_DECODE_PARAMS

}  // namespace fij_qsa
