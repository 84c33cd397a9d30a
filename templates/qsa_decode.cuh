// QSA fp8 sparse paged decode: attention of a row's query heads over the KV tokens the
// slot pass resolved, gathered from an e4m3 paged cache (see qsa_slots.cuh).
//
// One CTA per (row, kv head, split); a row's 16-token chunks are dealt round-robin to the
// CTA's warps. Each warp runs its own cp.async pipeline (NUM_STAGES chunks in flight, no
// block-wide barrier in the loop) and its own online softmax; the warps' (max, sum, acc)
// are merged through shared memory at the end. Split-K (small batches, qsa_decode_cluster):
// the CLUSTER splits of a (row, kv head) form one thread block cluster and merge through
// distributed shared memory, optionally resolving their own slots (SLOT_CAP > 0) so a call
// is one launch with no workspace.
// Tensor cores, m16n8k16 (rows = the group's query heads, zero-padded to 16):
//   S = Q K^T and P V in fp16 (e4m3 -> fp16 is exact; q is scaled per head so bf16 -> fp16
//   is exact too, see the Q fragment comment). P is rounded to fp16 (2^-11 relative): about
//   2e-4 of norm-wise error, a tenth of what the bf16 output rounding itself costs.
// The fragments are arranged so every thread gathers whole 16-byte (D=64: 8-byte) pieces
// of token rows and never needs a byte-wise shared-memory access:
//   * QK: the dot product's dim order is free, so quad lane t of the B fragment for token
//     n takes bytes [64G + 16t, +16) of K row n; k-step (G, u) uses its word u: bytes
//     0,1 are logical k = 2t, 2t+1 and bytes 2,3 are k = 2t+8, 2t+9. Q's A fragment is
//     loaded with the same permutation. K is copied by whole rows (see issue()) into a
//     swizzled [16 tokens][D] stage, so every copy instruction reads whole 128-byte lines.
//   * PV: lane (g, t) gathers D/8 bytes of V, [S g, +S) + 128 p (S = min(D/8, 16)), of
//     tokens 2t, 2t+1, 2t+8, 2t+9 (the tokens its score fragment covers) and transposes
//     4x4 byte blocks with prmt, so n8 tile i, column g is dim vdim(g, i) ((D/8)g + i for
//     D <= 128). Thread (g, t) then accumulates dims vdim(2t, i), vdim(2t+1, i) of heads
//     g and g+8.
// Byte offsets into the cache are 64-bit (a layer's pool can pass 2**31 bytes); the cache
// strides themselves are 32-bit (the host checks), which keeps a token's address at two
// 32x32->64 multiply-adds.
#pragma once
#include "qsa_util.cuh"

namespace fij_qsa {

// The decode's arguments. The last group is for fused slot resolution only (SLOT_CAP > 0):
// the raw selection, page table and row -> request map the slot pass would read.
#define FIJ_QSA_DECODE_PARAMS                                                                                \
  const fij::bf16_t *__restrict__ q, long long q_row, long long q_head, const unsigned char *__restrict__ k_cache, \
      unsigned k_block, unsigned k_token, unsigned k_head, const unsigned char *__restrict__ v_cache,           \
      unsigned v_block, unsigned v_token, unsigned v_head, const int *__restrict__ slots, int slot_columns,    \
      const int *__restrict__ counts, long long count_row_stride, int topk, int offset_bits, int num_kv_heads, \
      fij::bf16_t *__restrict__ out, long long out_row, long long out_head, const fij::bf16_t *__restrict__ gate, \
      long long gate_row, long long gate_head, float score_scale_log2, float output_scale,                     \
      const int *__restrict__ indices, long long idx_col_stride, const int *__restrict__ block_table,         \
      long long bt_row_stride, long long bt_col_stride, int table_width, int num_requests,                    \
      const int *__restrict__ token_to_req, long long t2r_stride, int num_blocks, int page_size
#define FIJ_QSA_DECODE_ARGS                                                                                   \
  q, q_row, q_head, k_cache, k_block, k_token, k_head, v_cache, v_block, v_token, v_head, slots, slot_columns, \
      counts, count_row_stride, topk, offset_bits, num_kv_heads, out, out_row, out_head, gate, gate_row,       \
      gate_head, score_scale_log2, output_scale, indices, idx_col_stride, block_table, bt_row_stride,         \
      bt_col_stride, table_width, num_requests, token_to_req, t2r_stride, num_blocks, page_size

// MIN_CTAS: the CTAs per SM the register allocation must allow (launch bound; 1 = none).
// CLUSTER: 0, or the split count when the splits of a (row, kv head) form one thread
//   block cluster and merge through distributed shared memory.
// SLOT_CAP: 0 (slots come from the slot pass), or the most entries one CTA resolves itself
//   from the raw selection into shared memory (the slot pass is skipped).
// SLOT_AHEAD: how many loop iterations before its copies are issued a chunk's slot load
//   goes out (1: the shipped design; 2..4 keep more independent slot loads in flight so
//   an L2 round trip under load never holds up the next chunk's copies).
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int CLUSTER, int SLOT_CAP,
          int SLOT_AHEAD = 1>
__device__ __forceinline__ void decode_body(FIJ_QSA_DECODE_PARAMS) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim");
  static_assert(GROUP >= 1 && GROUP <= 16, "group size");
  static_assert(NUM_STAGES >= 2 && NUM_STAGES <= 8, "stages (validity ring holds 8)");
  static_assert(SLOT_AHEAD >= 1 && SLOT_AHEAD <= 4, "slot lookahead");
  constexpr int NG = HEAD_DIM / 64;       // 64-dim groups of a K row: one 16-B piece per quad lane
  constexpr int KU = 2 * NG;              // K uint4s per thread per stage (2 tokens)
  constexpr int VW = HEAD_DIM / 32;       // V words per token per thread
  constexpr int VG = HEAD_DIM / 128;      // V 16-B pieces per token per thread (D >= 128)
  // V span: a lane gathers bytes [SPAN g, +SPAN) + 128 p of a V row (p < VG), so 8 lanes
  // read whole 128-byte lines; n8 tile i, column c then holds dim (i / SPAN) 128 + SPAN c +
  // i % SPAN (vdim).
  constexpr int SPAN = HEAD_DIM >= 128 ? 16 : 8;
  auto vdim = [](int c, int i) { return (i / SPAN) * 128 + SPAN * c + i % SPAN; };
  constexpr int NT = HEAD_DIM / 8;        // n8 tiles of the output
  constexpr int STAGE_U4 = HEAD_DIM / 16; // uint4s per thread per stage
  constexpr int KP = HEAD_DIM / 16;       // 16-byte pieces of a K row
  // K smem swizzle: D >= 128 rows are whole bank sweeps, so odd rows flip piece bit 2.
  auto kswz = [](int r) { return HEAD_DIM >= 128 ? (r & 1) << 2 : 0; };
  constexpr bool Q_SMEM = q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS);
  constexpr int Q_U4 = Q_SMEM ? NG * 4 * 32 : 0;  // the head's Q fragments
  constexpr int RR = HEAD_DIM + kRedPad;
  using Smem = DecodeSmem<HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, CLUSTER, SLOT_CAP>;
  static_assert(Smem::kQBytes == Q_U4 * 16, "smem layout");

  extern __shared__ uint4 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row = blockIdx.x / num_kv_heads;
  const int kvh = blockIdx.x - row * num_kv_heads;
  const int split = blockIdx.y, num_splits = CLUSTER > 0 ? CLUSTER : 1;
  uint4* const qsm = smem;  // Q fragments (Q_SMEM)

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
    // Each thread resolves up to PER entries, all index loads first and then all table
    // lookups (two dependent round trips a CTA, not two per entry).
    constexpr int THREADS = NUM_WARPS * 32, PER = (SLOT_CAP + THREADS - 1) / THREADS;
    const int request = __ldg(token_to_req + (long long)row * t2r_stride);
    const bool req_ok = request >= 0 && request < num_requests;
    const int n_tok = max(c_end - c_begin, 0) * kChunk;
    const int* const irow = indices + (long long)row * count_row_stride;
    int logical[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = u * THREADS + threadIdx.x, j = c_begin * kChunk + i;
      logical[u] = i < n_tok && j < count && req_ok ? __ldg(irow + (long long)j * idx_col_stride) : -1;
    }
    int physical[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int page = logical[u] / page_size;
      physical[u] = logical[u] >= 0 && page < table_width
                        ? __ldg(block_table + (long long)request * bt_row_stride + (long long)page * bt_col_stride)
                        : -1;
    }
#pragma unroll
    for (int u = 0; u < PER; ++u) {
      const int i = u * THREADS + threadIdx.x;
      const int offset = logical[u] - (logical[u] / page_size) * page_size;
      if (i < n_tok)
        slot_list[i] = physical[u] >= 0 && physical[u] < num_blocks ? (physical[u] << offset_bits) | offset : -1;
    }
    __syncthreads();
  }

  // ---- per-warp pipeline (its first copies go out before Q is loaded: they overlap) ----
  uint4* const wbase = smem + Q_U4 + warp * NUM_STAGES * STAGE_U4 * 32;
  const int first = c_begin + warp;
  const int my_n = c_end > first ? (c_end - first + NUM_WARPS - 1) / NUM_WARPS : 0;
  const int* const srow = slots + (long long)row * slot_columns;
  const unsigned char* const kbase = k_cache + (unsigned long long)kvh * k_head;
  const unsigned char* const vbase = v_cache + (unsigned long long)kvh * v_head + SPAN * g;
  const unsigned offset_mask = (1u << offset_bits) - 1u;

  // A chunk's 16 slots: one load a warp (lane L holds entry L % 16); issue() hands them
  // out with shuffles (one L2 request a chunk instead of one per fragment row).
  auto load_slots = [&](int k) -> int {
    if constexpr (SLOT_CAP > 0) {
      return slot_list[(first + k * NUM_WARPS - c_begin) * kChunk + (lane & 15)];
    } else {
      return __ldg(srow + (first + k * NUM_WARPS) * kChunk + (lane & 15));
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
  // K: instruction i copies 16-byte piece (32i + lane) % KP of token row (32i + lane) / KP,
  // so a warp instruction reads whole 128-byte lines (D >= 128; reading 64 of a row's 128
  // bytes per instruction, as before, doubled the L2 requests). Rows land in shared memory at
  // piece ^ kswz(row): the fragment reads of rows 2m and 2m+1 then hit disjoint banks.
  // (The half-line reads were the likely reason for ncu's 87% L2 busy at 51% DRAM.)
  auto issue = [&](int k, int sl) -> unsigned {
    const unsigned st = smem_u32(wbase + (k % NUM_STAGES) * STAGE_U4 * 32);
#pragma unroll
    for (int i = 0; i < KU; ++i) {
      const int flat = 32 * i + lane, r = flat / KP, piece = flat % KP;
      const int slot = __shfl_sync(kFull, sl, r);
      const unsigned char* src = token_ptr(kbase, slot, k_block, k_token) + 16 * piece;
      cp_async16(st + (r * KP + (piece ^ kswz(r))) * 16, src, slot >= 0);
    }
    const unsigned vst = st + KU * 32 * 16;
    unsigned bits = 0;
#pragma unroll
    for (int tau = 0; tau < 4; ++tau) {
      const int slot = __shfl_sync(kFull, sl, 2 * t + (tau & 1) + 8 * (tau >> 1));
      const bool ok = slot >= 0;
      bits |= ok ? 1u << tau : 0u;
      const unsigned char* src = token_ptr(vbase, slot, v_block, v_token);
      if constexpr (HEAD_DIM == 64) {
        cp_async8(vst + (tau * 32 + lane) * 8, src, ok);
      } else {
#pragma unroll
        for (int p = 0; p < VG; ++p) cp_async16(vst + ((tau * VG + p) * 32 + lane) * 16, src + 128 * p, ok);
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
    int pre[NUM_STAGES - 1];
#pragma unroll
    for (int k = 0; k < NUM_STAGES - 1; ++k)
      if (k < my_n) pre[k] = load_slots(k);
#pragma unroll
    for (int k = 0; k < NUM_STAGES - 1; ++k) {
      if (k < my_n) ring |= issue(k, pre[k]) << (4 * k);
      cp_async_commit();
    }
  }
  // ahead[a]: the slots of chunk k + NUM_STAGES - 1 + a at the top of iteration k.
  int ahead[SLOT_AHEAD];
#pragma unroll
  for (int a = 0; a < SLOT_AHEAD; ++a) ahead[a] = NUM_STAGES - 1 + a < my_n ? load_slots(NUM_STAGES - 1 + a) : -1;

  // ---- Q fragments (rows g, g+8 of the group; padding rows are zero) -------------------
  // QK runs in fp16 so K needs one cvt per two e4m3 bytes (see q_fragments for exactness).
  uint4 qreg[NG][4];
  float row_scale0, row_scale1;  // score_scale_log2 / (q scale) of rows g and g + 8
  q_fragments<GROUP, NG>(q + (long long)row * q_row + (long long)(kvh * GROUP) * q_head, q_head, g, t,
                         score_scale_log2, qreg, row_scale0, row_scale1);
  if constexpr (Q_SMEM) {
    if (warp == 0) {
#pragma unroll
      for (int G = 0; G < NG; ++G)
#pragma unroll
        for (int u = 0; u < 4; ++u) qsm[(G * 4 + u) * 32 + lane] = qreg[G][u];
    }
    __syncthreads();
  }

  for (int k = 0; k < my_n; ++k) {
    if (k + NUM_STAGES - 1 < my_n) ring |= issue(k + NUM_STAGES - 1, ahead[0]) << (4 * (NUM_STAGES - 1));
    cp_async_commit();
#pragma unroll
    for (int a = 0; a + 1 < SLOT_AHEAD; ++a) ahead[a] = ahead[a + 1];
    if (k + NUM_STAGES - 1 + SLOT_AHEAD < my_n) ahead[SLOT_AHEAD - 1] = load_slots(k + NUM_STAGES - 1 + SLOT_AHEAD);
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
        const int r = 8 * j + g;  // token row; piece 4G + t (see issue)
        const uint4 kk = st[r * KP + ((4 * G + t) ^ kswz(r))];
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
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int d0 = vdim(2 * t, i), d1 = vdim(2 * t + 1, i);
      mine[g * RR + d0] = acc[i][0];
      mine[g * RR + d1] = acc[i][1];
      mine[(g + 8) * RR + d0] = acc[i][2];
      mine[(g + 8) * RR + d1] = acc[i][3];
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
  // A cluster's partials: [GROUP][HEAD_DIM] then (max, sum) pairs, past the reduction.
  float* const cpart = red + NUM_WARPS * 16 * RR + NUM_WARPS * 16 * 2;
  float* const cml = cpart + GROUP * HEAD_DIM;
  const long long head0 = (long long)kvh * GROUP;  // first query head of the kv head
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
    if constexpr (CLUSTER > 0) {
      float* const dst = cpart + h * HEAD_DIM + 8 * c;
      reinterpret_cast<float4*>(dst)[0] = make_float4(a[0], a[1], a[2], a[3]);
      reinterpret_cast<float4*>(dst)[1] = make_float4(a[4], a[5], a[6], a[7]);
      if (c == 0) {
        cml[h * 2] = mmax;
        cml[h * 2 + 1] = denom;
      }
    } else {
      const long long head = head0 + h;
      store_gated(out + row * out_row + head * out_head + 8 * c, gate + row * gate_row + head * gate_head + 8 * c,
                  a, denom, output_scale);
    }
  }
  if constexpr (CLUSTER > 0) {
    // ---- cluster split-K: every split's partial is in its CTA's shared memory.
    cluster_sync();
    cluster_merge<CLUSTER, GROUP, HEAD_DIM, NUM_WARPS * 32>(cpart, cml, out + row * out_row + head0 * out_head,
                                                           out_head, gate + row * gate_row + head0 * gate_head,
                                                           gate_head, output_scale);
    cluster_sync();  // no CTA leaves while a peer may still read its shared memory
  }
}

// The large-batch kernel: one CTA per (row, kv head), slots from the slot pass.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int SLOT_AHEAD>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) qsa_decode(FIJ_QSA_DECODE_PARAMS) {
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, 0, 0, SLOT_AHEAD>(FIJ_QSA_DECODE_ARGS);
}

// The small-batch kernel: CLUSTER splits per (row, kv head) in one thread block cluster
// (grid.y = CLUSTER), merged through distributed shared memory; SLOT_CAP > 0 also resolves
// the slots in the kernel, so a call is this one launch.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int CLUSTER, int SLOT_CAP>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__(NUM_WARPS * 32, MIN_CTAS)
    qsa_decode_cluster(FIJ_QSA_DECODE_PARAMS) {
  static_assert(CLUSTER >= 2 && CLUSTER <= 8, "portable cluster sizes");
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, CLUSTER, SLOT_CAP>(FIJ_QSA_DECODE_ARGS);
}

#undef FIJ_QSA_DECODE_ARGS
#undef FIJ_QSA_DECODE_PARAMS

}  // namespace fij_qsa
