// The QSA decode's body (decode_body), shared by the two decode kernels of qsa/sm89_mma_decode.cuh;
// the design is described there.
#pragma once
#include "qsa/bulk.cuh"
#include "qsa/merge.cuh"
#include "qsa/rows.cuh"
#include "qsa/sm89_slot_pass.cuh"
#include "qsa/tmma.cuh"
#include "qsa/util.cuh"

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
// CLUSTER: 0 (the single pass), or the split count when the splits of a (row, kv head)
//   form one thread block cluster and merge through distributed shared memory.
// SLOT_CAP: 0 (slots come from the slot pass), or the most entries one CTA resolves itself
//   from the raw selection into shared memory (clusters; the slot pass is skipped).
// BULK: each token's K and V rows arrive by one 256-byte cp.async.bulk copy (D = 128; the
//   host checks that V follows K in memory, as in the combined cache) completing on one
//   mbarrier per warp stage; else cp.async gathers of 16-byte pieces.
// The single pass takes its rows in the slot pass's order (longest first), issues its
// prologue without waiting for the row's count and prefetches the gate into L2. A cluster
// deals chunk c to split c % CLUSTER (placed without the count, so its fused index loads
// go out with the count load) and holds the gate in registers when every thread merges at
// most one output piece. (The H200 sweep behind these choices: flashinfer_jit/qsa_kernels.py.)
// TMMA (GROUP <= 8): the MMAs take the chunk's 16 tokens as their rows and the heads as
// the 8 columns (qsa/tmma.cuh): half the MMAs, exponentials and accumulators; Q is a B
// operand held in registers.
// LEAN: the loop's per-thread invariants (stage offsets, slot pointer) are computed once
// and kept in registers (pinned: ptxas otherwise recomputes them from threadIdx in every
// iteration) and the stages advance by counters instead of k % NUM_STAGES.
// PAIR (cp.async, heads as rows): a warp steps two chunks at a time (qsa/rows.cuh), its
// NUM_STAGES stages holding NUM_STAGES / 2 pairs in flight.
// ORDER (the single pass, and a cluster after the slot pass): CTA i (a cluster: blockIdx.x i)
// takes the slot pass's row order[i / Hkv], longest first, so the grid's CTAs start in
// decreasing length as earlier ones finish; false, row i / Hkv (the slot pass then writes no
// order: qsa_decode_short, the clusters that resolve their own slots).
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int CLUSTER, int SLOT_CAP, bool BULK,
          bool TMMA, bool LEAN, bool PAIR = false, bool ORDER = true>
__device__ __forceinline__ void decode_body(FIJ_QSA_DECODE_PARAMS) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "head dim");
  static_assert(GROUP >= 1 && GROUP <= 16, "group size");
  static_assert(NUM_STAGES >= 2 && NUM_STAGES <= 8, "stages (validity ring holds 8)");
  static_assert(!BULK || HEAD_DIM == 128, "bulk stages are laid out for D = 128");
  static_assert(SLOT_CAP == 0 || CLUSTER > 0, "in-kernel slots: clusters only");
  static_assert(!TMMA || GROUP <= 8, "tokens as MMA rows: the heads fill 8 columns");
  static_assert(!PAIR || (!BULK && !TMMA && !LEAN && NUM_STAGES % 2 == 0 && NUM_STAGES >= 4), "pairs");
  static_assert(!ORDER || SLOT_CAP == 0, "the row order comes with the slot pass");
  constexpr bool SINGLE = CLUSTER == 0;
  constexpr int NS = SINGLE ? 1 : CLUSTER;  // splits of a (row, kv head)
  constexpr int NG = HEAD_DIM / 64;       // 64-dim groups of a K row: one 16-B piece per quad lane
  constexpr int KU = 2 * NG;              // K uint4s per thread per stage (2 tokens)
  constexpr int VW = HEAD_DIM / 32;       // V words per token per thread
  constexpr int VG = HEAD_DIM / 128;      // V 16-B pieces per token per thread (D >= 128)
  // V span: a lane gathers bytes [SPAN g, +SPAN) + 128 p of a V row (p < VG), so 8 lanes
  // read whole 128-byte lines; n8 tile i, column c then holds dim (i / SPAN) 128 + SPAN c +
  // i % SPAN (vdim in qsa/merge.cuh).
  constexpr int SPAN = HEAD_DIM >= 128 ? 16 : 8;
  constexpr int NT = HEAD_DIM / 8;        // n8 tiles of the output
  constexpr int STAGE_U4 = HEAD_DIM / 16; // uint4s per thread per stage (cp.async stages)
  constexpr int KP = HEAD_DIM / 16;       // 16-byte pieces of a K row
  // K smem swizzle: D >= 128 rows are whole bank sweeps, so odd rows flip piece bit 2.
  auto kswz = [](int r) { return HEAD_DIM >= 128 ? (r & 1) << 2 : 0; };
  // (TMMA keeps Q's 16 B-operand registers: its accumulator is half as large.)
  constexpr bool Q_SMEM = !TMMA && q_in_smem(HEAD_DIM, NUM_WARPS, MIN_CTAS);
  // The head's Q fragments; the area is laid out whenever q_in_smem (TMMA leaves it unused).
  constexpr int Q_U4 = Q_SMEM ? NG * 4 * 32 : 0;
  constexpr int THREADS = NUM_WARPS * 32, PIECES = HEAD_DIM / 8;
  constexpr int SB = stage_bytes(HEAD_DIM, BULK);
  using Smem = DecodeSmem<HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, CLUSTER, SLOT_CAP, BULK>;
  constexpr int Q_AREA = Smem::kQBytes / 16;
  static_assert(Smem::kQBytes == Q_U4 * 16 || (TMMA && Q_U4 == 0), "smem layout");

  extern __shared__ uint4 smem[];
  unsigned char* const smem_bytes = reinterpret_cast<unsigned char*>(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  uint4* const qsm = smem;  // Q fragments (Q_SMEM)
  uint4* const wbase = smem + Q_AREA + warp * NUM_STAGES * STAGE_U4 * 32;
  const int warp_stage0 = Smem::kQBytes + warp * NUM_STAGES * SB;  // byte offset of this warp's stage 0
  const unsigned wstage = smem_u32(smem_bytes + warp_stage0);
  float* const inbox = reinterpret_cast<float*>(smem_bytes + Smem::kQBytes + Smem::kMainBytes);  // clusters
  const unsigned bars =
      smem_u32(smem_bytes + Smem::kQBytes + Smem::kMainBytes + Smem::kInboxBytes) + warp * NUM_STAGES * 8;
  if constexpr (BULK) {
    // Bulk copies skip masked tokens, whose rows keep stale bytes: zero the stages once so
    // those bytes are finite (P V multiplies them by p = 0).
    for (int i = threadIdx.x; i < Smem::kStageBytes / 16; i += THREADS) smem[Smem::kQBytes / 16 + i] = uint4{};
    if (lane == 0)
      for (int s = 0; s < NUM_STAGES; ++s) mbar_init(bars + 8 * s);
    fence_async_smem();
    __syncthreads();
  }
  // A cluster's first barrier phase: this CTA has started, so peers may push into its inbox
  // once they have waited for it (merge_and_store).
  if constexpr (CLUSTER > 0) cluster_arrive_relaxed();
  // Everything above touches shared memory only: with a programmatic dependent launch it
  // overlaps the preceding grid.
  grid_dependency_wait();
  grid_dependents_launch();

  const int pair_row = blockIdx.x / num_kv_heads;
  const int kvh = blockIdx.x - pair_row * num_kv_heads;
  int row = pair_row;  // the single pass: CTA i takes row order[i / Hkv] of the slot pass
  if constexpr (ORDER)
    row = __ldg(slots + row_order_offset(gridDim.x / num_kv_heads, slot_columns) + pair_row);
  const int split = SINGLE ? 0 : blockIdx.y;
  const long long head0 = (long long)kvh * GROUP;  // first query head of the kv head

  // This thread's gate pieces of the epilogue, fetched now: into registers (a cluster whose
  // merge gives every thread at most one piece), else into L2.
  constexpr bool GATE_REG = !SINGLE && GROUP * PIECES <= CLUSTER * THREADS;
  uint4 gate_pre = make_uint4(0, 0, 0, 0);
  {
    const fij::bf16_t* const grow = gate + row * gate_row + head0 * gate_head;
    // the items this thread stores: li * NS + rank for li = threadIdx.x + k THREADS (owner_merge)
    const int rank = SINGLE ? 0 : (int)cluster_rank();
    if constexpr (GATE_REG) {
      const int item0 = threadIdx.x * NS + rank;
      if (item0 < GROUP * PIECES)
        gate_pre = __ldg(reinterpret_cast<const uint4*>(grow + (item0 / PIECES) * gate_head + 8 * (item0 % PIECES)));
    } else {
      for (int item = threadIdx.x * NS + rank; item < GROUP * PIECES; item += NS * THREADS)
        if (SINGLE ? item % 8 == 0 : true) prefetch_l2(grow + (item / PIECES) * gate_head + 8 * (item % PIECES));
    }
  }

  // q goes out now, with the count (and a cluster's slot lookups), into this warp's last
  // stage: free until the loop's first copies (see q_copy).
  const unsigned q_stage = wstage + (NUM_STAGES - 1) * SB;
  q_copy<GROUP, HEAD_DIM>(q_stage, q + (long long)row * q_row + head0 * q_head, q_head, lane);
  const int count = min(max(__ldg(counts + (long long)row * count_row_stride), 0), topk);
  const int chunks = (count + kChunk - 1) / kChunk;
  // This split's chunks: local index m is chunk split + NS m (the single pass: chunk m).
  const int n_local = chunks > split ? (chunks - split + NS - 1) / NS : 0;
  auto chunk_of = [&](int m) { return split + NS * m; };

  // ---- fused slot resolution: this CTA's entries, once, into shared memory ---------------
  int* const slot_list = reinterpret_cast<int*>(smem_bytes + Smem::kQBytes + Smem::kStageBytes);
  if constexpr (SLOT_CAP > 0) {
    resolve_slot_list<THREADS, SLOT_CAP>(slot_list, chunk_of, count, topk, indices + (long long)row * count_row_stride,
                                         idx_col_stride, block_table, bt_row_stride, bt_col_stride, table_width,
                                         num_requests, __ldg(token_to_req + (long long)row * t2r_stride), num_blocks,
                                         page_size, offset_bits);
    __syncthreads();
  }

  // ---- per-warp pipeline (q is already on its way: see q_copy) ------------------------
  const int my_n = n_local > warp ? (n_local - warp + NUM_WARPS - 1) / NUM_WARPS : 0;
  const int* const srow = slots + (long long)row * slot_columns;
  auto keep = [](int x) { return LEAN ? pinned(x) : x; };
  // LEAN: this lane's slot entry of the warp's first chunk; chunk k is kSlotStride further.
  constexpr int kSlotStride = NS * NUM_WARPS * kChunk;
  const int* const slot0 = srow + keep(chunk_of(warp) * kChunk + (lane & 15));
  const unsigned char* const kbase = k_cache + (unsigned long long)kvh * k_head;
  const unsigned char* const vrow0 = v_cache + (unsigned long long)kvh * v_head;
  const unsigned char* const vbase = vrow0 + SPAN * g;
  const unsigned offset_mask = (1u << offset_bits) - 1u;

  // A chunk's 16 slots: one load a warp (lane L holds entry L % 16); issue() hands them
  // out with shuffles (one L2 request a chunk instead of one per fragment row).
  auto load_slots = [&](int k) -> int {
    const int m = warp + k * NUM_WARPS;
    if constexpr (SLOT_CAP > 0) {
      return slot_list[m * kChunk + (lane & 15)];
    } else if constexpr (LEAN) {
      return __ldg(slot0 + k * kSlotStride);
    } else {
      return __ldg(srow + chunk_of(m) * kChunk + (lane & 15));
    }
  };
  // Whether the prologue loads chunk k's slots: a cluster while k < my_n; the single pass
  // whenever they exist in the slot pass's output, without waiting for the count (entries
  // past it are -1 there, so those chunks copy nothing and are never waited for).
  auto pre_ok = [&](int k) {
    if constexpr (SINGLE) return chunk_of(warp + k * NUM_WARPS) < slot_columns / kChunk;
    else return k < my_n;
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
  // The validity bits of the tokens whose scores this thread holds: 2t, 2t+1, 2t+8, 2t+9
  // of a 16-token ballot (TMMA: tokens g, g + 8).
  const int bit_shift = keep(TMMA ? g : 2 * t);  // this thread's first token of the chunk
  auto score_bits = [&](unsigned vm) -> unsigned {
    vm >>= bit_shift;
    if constexpr (TMMA) return (vm & 1u) | ((vm >> 7) & 2u);
    else return (vm & 3u) | ((vm >> 6) & 0xcu);
  };
  // Issue a chunk's copies into stage s; returns its score_bits.
  // K: instruction i copies 16-byte piece (32i + lane) % KP of token row (32i + lane) / KP,
  // so a warp instruction reads whole 128-byte lines (D >= 128; reading 64 of a row's 128
  // bytes per instruction, as before, doubled the L2 requests). Rows land in shared memory at
  // piece ^ kswz(row): the fragment reads of rows 2m and 2m+1 then hit disjoint banks.
  // (The half-line reads were the likely reason for ncu's 87% L2 busy at 51% DRAM.)
  // BULK: lanes 0-15 copy their token's K and V rows (256 bytes, V right after K) with one
  // cp.async.bulk each; the stage's mbarrier expects the valid tokens' bytes.
  const unsigned copy_dst = keep(wstage + bulk_row(lane & 15));  // BULK: this lane's row of stage 0
  auto issue = [&](int s, int sl) -> unsigned {
    if constexpr (BULK) {
      const unsigned bar = bars + 8 * s;
      const bool ok = sl >= 0;
      const unsigned vm = __ballot_sync(kFull, ok) & 0xffffu;  // also: every lane is done with the stage
      if (lane == 0) mbar_arrive_expect(bar, __popc(vm) * 2 * HEAD_DIM);
      if (lane < 16 && ok) bulk_copy(copy_dst + s * SB, token_ptr(kbase, sl, k_block, k_token), 2 * HEAD_DIM, bar);
      return score_bits(vm);
    } else {
      const unsigned st = smem_u32(wbase + s * STAGE_U4 * 32);
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
      if constexpr (TMMA) return score_bits(__ballot_sync(kFull, sl >= 0) & 0xffffu);
      else return bits;
    }
  };

  constexpr int NACC = TMMA ? NT / 2 : NT;  // accumulator tiles: n8 (heads as rows) or m16 (TMMA)
  float acc[NACC][4];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  const float neg_inf = __int_as_float(0xff800000);
  float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;

  // Prologue: slot loads of the first PS - 1 steps' chunks in parallel, then their copies
  // (a step: one chunk, PAIR two; chunk c goes to stage c).
  constexpr int CPS = PAIR ? 2 : 1;                // chunks per step
  constexpr int PS = NUM_STAGES / CPS;             // steps the stages hold
  unsigned ring = 0;
  {
    int pre[CPS * (PS - 1)];
#pragma unroll
    for (int c = 0; c < CPS * (PS - 1); ++c)
      if (pre_ok(c)) pre[c] = load_slots(c);
#pragma unroll
    for (int k = 0; k < PS - 1; ++k) {
#pragma unroll
      for (int c = CPS * k; c < CPS * (k + 1); ++c)
        if (pre_ok(c)) ring |= issue(c, pre[c]) << (4 * c);
      if constexpr (!BULK) cp_async_commit();
    }
  }
  // The slots of the chunk(s) issued at the top of the next step (loaded one step before
  // their copies are issued).
  int next = pre_ok(CPS * (PS - 1)) ? load_slots(CPS * (PS - 1)) : -1;
  int next2 = PAIR && pre_ok(CPS * (PS - 1) + 1) ? load_slots(CPS * (PS - 1) + 1) : -1;

  // ---- Q fragments (rows g, g+8 of the group; padding rows are zero) -------------------
  // QK runs in fp16 so K needs one cvt per two e4m3 bytes (see q_fragments for exactness).
  uint4 qreg[NG][4];
  float row_scale0, row_scale1;  // score_scale_log2 / (q scale) of rows g and g + 8
  // q's group is the oldest: waiting it out leaves the prologue's PS - 1 in flight.
  cp_async_wait<BULK ? 0 : PS - 1>();
  __syncwarp();
  q_fragments<GROUP, HEAD_DIM>(smem_bytes + warp_stage0 + (NUM_STAGES - 1) * SB, g, t, score_scale_log2, qreg,
                               row_scale0, row_scale1);
  if constexpr (BULK) {
    // The stage is a bulk stage again: its masked rows must read as zeros (see the top).
    __syncwarp();
    uint4* const last = reinterpret_cast<uint4*>(smem_bytes + warp_stage0 + (NUM_STAGES - 1) * SB);
    for (int i = lane; i < SB / 16; i += 32) last[i] = uint4{};
    fence_async_smem();
    __syncwarp();
  }
  // TMMA: the B fragments of head g (rows g + 8 are padding) and the scales of the score
  // columns, heads 2t and 2t + 1.
  uint2 qcol[NG][4];
#pragma unroll
  for (int G = 0; G < NG; ++G)
#pragma unroll
    for (int u = 0; u < 4; ++u) qcol[G][u] = make_uint2(qreg[G][u].x, qreg[G][u].z);
  if constexpr (TMMA) {
    const float head_scale = row_scale0;
    row_scale0 = __shfl_sync(kFull, head_scale, 8 * t);
    row_scale1 = __shfl_sync(kFull, head_scale, 8 * t + 4);
  }
  if constexpr (Q_SMEM) {
    if (warp == 0) {
#pragma unroll
      for (int G = 0; G < NG; ++G)
#pragma unroll
        for (int u = 0; u < 4; ++u) qsm[(G * 4 + u) * 32 + lane] = qreg[G][u];
    }
    __syncthreads();
  }
  // Bulk stages (D = 128): this thread's K rows g, 8 + g (piece t) and V rows 2t + c (+8).
  const int krow = keep(BULK ? bulk_row(g) + 16 * t : 0);
  const int vrow[2] = {keep(BULK ? bulk_row(2 * t) + HEAD_DIM + 16 * g : 0),
                       keep(BULK ? bulk_row(2 * t + 1) + HEAD_DIM + 16 * g : 0)};

  // The 16-byte K piece 4G + t of token row 8j + g in a stage (see issue).
  auto k_piece = [&](const uint4* st, const unsigned char* bst, int j, int G) -> uint4 {
    const int r = 8 * j + g;
    if constexpr (BULK) return *reinterpret_cast<const uint4*>(bst + krow + 512 * j + 64 * G);
    else return st[r * KP + ((4 * G + t) ^ kswz(r))];
  };
  // V word w (dims 4w..4w+3 of this lane's span) of tokens 2t, 2t+1, 2t+8, 2t+9, transposed
  // with prmt into f16x2 pairs: b[i][h] = dim 4w + i of tokens 2t + 8h, 2t + 8h + 1.
  auto v_frags = [&](const uint4* st, const unsigned char* bst, int w, unsigned (&b)[4][2]) {
    const uint4* vs = st + KU * 32;
    unsigned tw[4];
#pragma unroll
    for (int tau = 0; tau < 4; ++tau) {
      if constexpr (BULK) {
        tw[tau] = word_of(*reinterpret_cast<const uint4*>(bst + vrow[tau & 1] + 512 * (tau >> 1)), w);
      } else if constexpr (HEAD_DIM == 64) {
        const uint2 v = reinterpret_cast<const uint2*>(vs)[tau * 32 + lane];
        tw[tau] = w == 0 ? v.x : v.y;
      } else {
        tw[tau] = word_of(vs[(tau * VG + w / 4) * 32 + lane], w % 4);
      }
    }
    const unsigned x0 = prmt(tw[0], tw[1], 0x5140), x1 = prmt(tw[0], tw[1], 0x7362);
    const unsigned y0 = prmt(tw[2], tw[3], 0x5140), y1 = prmt(tw[2], tw[3], 0x7362);
    e4m3x4_to_f16x2x2(x0, b[0][0], b[1][0]);
    e4m3x4_to_f16x2x2(x1, b[2][0], b[3][0]);
    e4m3x4_to_f16x2x2(y0, b[0][1], b[1][1]);
    e4m3x4_to_f16x2x2(y1, b[2][1], b[3][1]);
  };

  // Q's A fragment of k-step (G, u), heads as rows.
  auto q_of = [&](int G, int u) -> uint4 {
    if constexpr (Q_SMEM) return qsm[(G * 4 + u) * 32 + lane];
    else return qreg[G][u];
  };
  if constexpr (PAIR) {
    // Step k / 2 takes chunks k and k + 1 (the last may be single) from stages 2s, 2s + 1.
    for (int k = 0; k < my_n; k += 2) {
      const int s_read = (k / 2) % PS, s_issue = (k / 2 + PS - 1) % PS;
      const int c = k + 2 * (PS - 1);  // the first chunk issued now
      if (c < my_n) ring |= issue(2 * s_issue, next) << (4 * (2 * PS - 2));
      if (c + 1 < my_n) ring |= issue(2 * s_issue + 1, next2) << (4 * (2 * PS - 1));
      cp_async_commit();
      if (c + 2 < my_n) next = load_slots(c + 2);
      if (c + 3 < my_n) next2 = load_slots(c + 3);
      cp_async_wait<PS - 1>();
      const unsigned bits[2] = {ring & 0xfu, (ring >> 4) & 0xfu};
      ring >>= 8;
      const uint4* const st0 = wbase + 2 * s_read * STAGE_U4 * 32;
      const uint4* const st1 = st0 + STAGE_U4 * 32;
      auto k_of = [&](int h, int j, int G) { return k_piece(h ? st1 : st0, nullptr, j, G); };
      auto v_of = [&](int h, int w, unsigned (&b)[4][2]) { v_frags(h ? st1 : st0, nullptr, w, b); };
      if (k + 1 < my_n) {
        rows_chunks<2, NG, VW>(acc, m0, m1, l0, l1, row_scale0, row_scale1, bits, q_of, k_of, v_of);
      } else {
        const unsigned one[1] = {bits[0]};
        rows_chunks<1, NG, VW>(acc, m0, m1, l0, l1, row_scale0, row_scale1, one, q_of, k_of, v_of);
      }
    }
  }
  const int warp_stages = keep(warp_stage0);
  // LEAN: chunk k's stage and its mbarrier phase parity, advanced by the loop.
  int stage = 0;
  unsigned parity = 0;
  for (int k = 0; k < (PAIR ? 0 : my_n); ++k) {
    const int s_read = LEAN ? stage : k % NUM_STAGES;
    const int s_issue = LEAN ? (stage == 0 ? NUM_STAGES - 1 : stage - 1) : (k + NUM_STAGES - 1) % NUM_STAGES;
    if (k + NUM_STAGES - 1 < my_n) ring |= issue(s_issue, next) << (4 * (NUM_STAGES - 1));
    if constexpr (!BULK) cp_async_commit();
    if (k + NUM_STAGES < my_n) next = load_slots(k + NUM_STAGES);
    if constexpr (BULK) mbar_wait(bars + 8 * s_read, LEAN ? parity : (k / NUM_STAGES) & 1);
    else cp_async_wait<NUM_STAGES - 1>();
    if (LEAN && ++stage == NUM_STAGES) {
      stage = 0;
      parity ^= 1u;
    }
    const unsigned bits = ring & 0xfu;
    ring >>= 4;
    const uint4* st = wbase + s_read * STAGE_U4 * 32;
    const unsigned char* const bst = smem_bytes + warp_stages + s_read * SB;

    if constexpr (TMMA) {
      auto k_of = [&](int j, int G) { return k_piece(st, bst, j, G); };
      auto v_of = [&](int w, unsigned (&b)[4][2]) { v_frags(st, bst, w, b); };
      tmma_chunk<NG, VW>(acc, m0, m1, l0, l1, qcol, row_scale0, row_scale1, bits, k_of, v_of);
    } else {
      const unsigned one[1] = {bits};
      auto k_of = [&](int, int j, int G) { return k_piece(st, bst, j, G); };
      auto v_of = [&](int, int w, unsigned (&b)[4][2]) { v_frags(st, bst, w, b); };
      rows_chunks<1, NG, VW>(acc, m0, m1, l0, l1, row_scale0, row_scale1, one, q_of, k_of, v_of);
    }
  }

  // ---- merge the warps -----------------------------------------------------------------
  // the sums over the lanes holding the same heads: t (heads as rows), g (TMMA)
#pragma unroll
  for (int o = TMMA ? 4 : 1; o < (TMMA ? 32 : 4); o <<= 1) {
    l0 += __shfl_xor_sync(kFull, l0, o);
    l1 += __shfl_xor_sync(kFull, l1, o);
  }
  // (bulk: every copy was waited for; the single pass's prologue copies nothing past the count)
  if constexpr (!BULK) cp_async_wait<0>();
  if constexpr (SINGLE && NUM_WARPS == 1) {  // one warp: no partials to merge
    store_direct<GROUP, HEAD_DIM, TMMA>(acc, l0, l1, out + row * out_row + head0 * out_head, out_head,
                                        gate + row * gate_row + head0 * gate_head, gate_head, output_scale);
    return;
  }
  __syncthreads();  // every warp is done with its stages: reuse them
  merge_and_store<GROUP, HEAD_DIM, NUM_WARPS, CLUSTER, GATE_REG, TMMA>(
      reinterpret_cast<float*>(smem + Q_AREA), inbox, acc, m0, m1, l0, l1, out + row * out_row + head0 * out_head,
      out_head, gate + row * gate_row + head0 * gate_head, gate_head, output_scale, gate_pre);
}

}  // namespace fij_qsa
