// FP8 paged MQA logits (the DeepSeek sparse-attention indexer):
//
//   out[b*NEXT_N + t, pos] = scale[pos] * sum_h w[b*NEXT_N + t, h] * relu(q[b,t,h,:] . k[pos,:])
//
// Design. A persistent CTA (one per SM) owns a contiguous run of 64-token tiles of the
// request-major tile list (see mqa_logits/util.cuh). (On sm_90a at head_dim 128 the
// dispatcher runs the TMA form instead, mqa_logits/sm90_tma_wgmma.cuh.) Two forms here:
//  - RING (the default): a producer warp streams the tiles into a shared-memory ring
//    with cp.async.bulk + mbarriers and WGS consumer warpgroups take them round-robin
//    (mqa_logits/ring.cuh); the consumers read their K fragments from shared memory.
//  - direct (below): the run is split over WGS warpgroups, each loading its K fragments
//    from global memory straight into registers, STAGES tiles in flight.
// Either way a warpgroup computes S^T = K_tile (64 tokens x DIM) . Q_b^T (DIM x N, N = NEXT_N*HEADS)
// so that tokens are rows and (t, h) pairs are columns: the head sum is then a sum over
// a thread's own accumulator columns plus two quad shuffles.
//
// The MMA A fragment (K) uses a permutation of the head_dim axis: a dot product is
// order-free, so thread `tig` of a quad takes 16 contiguous bytes per 64-byte chunk of a
// token row (16-byte loads, no swizzle, from global or from the ring's plain row-major
// copy of the block) and Q is stored in shared memory in the same permuted order.
//
// MMA: on sm_90a `wgmma.mma_async m64nNk32 e4m3` with A in registers and B = Q in shared
// memory (no-swizzle K-major core matrices). Elsewhere (sm_100a/sm_103a, or PORTABLE) the
// e4m3 fragments are widened to f16 (exact) for `mma.sync m16n8k16`, which is what the
// compiler emits for fp8 mma.sync on those parts anyway. acc f16 uses the f16-accumulator
// form of either instruction.
#pragma once
#include "mqa_logits/ring.cuh"

namespace fij_mqa {

struct Cursor {
  int b, t, nt, seq;
};

template <int NEXT_N, int HEADS, int DIM, int BLOCK, typename OutT, typename EpiT, typename AccT, int WGS, int STAGES,
          bool PORTABLE, bool RING>
__global__ void __maxnreg__(reg_cap(WGS * 128 + (RING ? 32 : 0)))
paged_mqa_logits(const unsigned char* __restrict__ q,       // [B, NEXT_N, HEADS, DIM] e4m3, contiguous
                 const unsigned char* __restrict__ kv,      // [num_blocks, BLOCK * (DIM + 4)] fused pool
                 const float* __restrict__ weights,         // [B * NEXT_N, HEADS], contiguous
                 const int* __restrict__ block_tables, long long bt_stride,
                 const int* __restrict__ seq_lens, long long sl_stride,
                 const int* __restrict__ schedule,          // [gridDim.x + 1, 2] or nullptr
                 OutT* __restrict__ out, long long out_stride, int batch,
                 int flags) {  // bit 0: the ring's KV L2 policy (KvPolicy; the direct form reads plainly);
                               // bit 1: 16-bit logits rounded to bf16 (TileSums::write)
  constexpr int N = NEXT_N * HEADS;
  constexpr int THREADS = WGS * 128 + (RING ? 32 : 0);
  constexpr int WORDS = DIM / 16;  // A-fragment words per token row per thread
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr int ACC_WORDS = F16ACC ? N / 4 : N / 2;
  constexpr long long BLOCK_BYTES = (long long)BLOCK * (DIM + 4);
  static_assert(DIM % 32 == 0 && N % 8 == 0 && N <= 256 && HEADS % 4 == 0, "unsupported geometry");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = !PORTABLE;
#else
  constexpr bool WGMMA = false;
#endif

  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int red[32];
  __shared__ int sched[3];
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  unsigned char* qbuf = smem + wg * (N * DIM);
  float* wbuf = reinterpret_cast<float*>(smem + WGS * N * DIM) + wg * N;

  cta_tiles<THREADS>(schedule, seq_lens, sl_stride, batch, red, sched);
  __syncthreads();
  if constexpr (RING) {
    ring_body<NEXT_N, HEADS, DIM, BLOCK, OutT, EpiT, AccT, WGS, STAGES, WGMMA>(
        smem, sched, q, kv, weights, block_tables, bt_stride, seq_lens, sl_stride, out, out_stride, batch,
        kv_evict_first<OutT>(flags), logits_bf16<OutT>(flags));
    return;
  }
  const int len = sched[2];
  const int skip = (int)((long long)len * wg / WGS);
  int todo = (int)((long long)len * (wg + 1) / WGS) - skip;

  // The load cursor walks this warpgroup's tiles. Dependent loads are fetched one step
  // ahead so no K load waits on them: the block ids of the cursor's tile and the length
  // of the next request.
  Cursor cur;
  int blk[2] = {0, 0};
  cur.b = sched[0];
  cur.t = sched[1] + skip;
  cur.seq = cur.b < batch ? max(0, seq_lens[cur.b * sl_stride]) : 0;
  cur.nt = tiles_of(cur.seq);
  while (cur.b < batch && cur.t >= cur.nt) {
    cur.t -= cur.nt;
    if (++cur.b < batch) cur.seq = max(0, seq_lens[cur.b * sl_stride]);
    cur.nt = cur.b < batch ? tiles_of(cur.seq) : 0;
  }
  int seq_next = cur.b + 1 < batch ? seq_lens[(cur.b + 1) * sl_stride] : 0;
  auto fetch_blocks = [&]() {
    const int rows = (cur.seq + BLOCK - 1) / BLOCK * BLOCK;  // rows past the last block are never read
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tok = cur.t * kTile + warp * 16 + g + 8 * i;
      blk[i] = cur.b < batch && tok < rows ? block_tables[cur.b * bt_stride + tok / BLOCK] : 0;
    }
  };
  fetch_blocks();

  // ---- per-stage K fragments and the tile each stage holds --------------------------
  unsigned ka[STAGES][2][WORDS];
  float kscale[STAGES][2];
  int st_b[STAGES], st_t[STAGES], st_rows[STAGES];
  int loads_left = todo;

  auto issue = [&](unsigned (&frag)[2][WORDS], float (&sc)[2], int& sb, int& stt, int& rows) {
    sb = cur.b;
    stt = cur.t;
    rows = (cur.seq + BLOCK - 1) / BLOCK * BLOCK;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tok = cur.t * kTile + warp * 16 + g + 8 * i;
      if (cur.b < batch && tok < rows) {
        const unsigned char* base = kv + (long long)blk[i] * BLOCK_BYTES;
        const unsigned char* row = base + (tok % BLOCK) * DIM;
#pragma unroll
        for (int p = 0; p < DIM / 64; ++p) {
          const uint4 v = fij::load_stream_16(row + p * 64 + tig * 16);
          frag[i][4 * p] = v.x; frag[i][4 * p + 1] = v.y; frag[i][4 * p + 2] = v.z; frag[i][4 * p + 3] = v.w;
        }
        if constexpr (DIM % 64 != 0) {
          const uint2 v = load_stream_8(row + (DIM / 64) * 64 + tig * 8);
          frag[i][WORDS - 2] = v.x; frag[i][WORDS - 1] = v.y;
        }
        sc[i] = load_stream_f32(base + BLOCK * DIM + (tok % BLOCK) * 4);
      } else {
#pragma unroll
        for (int w = 0; w < WORDS; ++w) frag[i][w] = 0u;
        sc[i] = 0.f;
      }
    }
    --loads_left;
    ++cur.t;
    while (cur.b < batch && cur.t >= cur.nt) {
      cur.t = 0;
      if (++cur.b < batch) {
        cur.seq = max(0, seq_next);
        seq_next = cur.b + 1 < batch ? seq_lens[(cur.b + 1) * sl_stride] : 0;
      }
      cur.nt = cur.b < batch ? tiles_of(cur.seq) : 0;
    }
    if (loads_left > 0) fetch_blocks();
  };

#pragma unroll
  for (int s = 0; s < STAGES; ++s)
    if (loads_left > 0) issue(ka[s], kscale[s], st_b[s], st_t[s], st_rows[s]);

  int q_b = -1;
  const unsigned bar = 1 + wg;
  for (; todo > 0;) {
#pragma unroll
    for (int st = 0; st < STAGES; ++st) {
      if (todo <= 0) break;
      --todo;
      const int b = st_b[st], tile = st_t[st], rows = st_rows[st];
      const float sc0 = kscale[st][0], sc1 = kscale[st][1];
      if (b != q_b) {  // a new request: its Q and weights into this warpgroup's buffers
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
        load_q<N, DIM>(q, b, qbuf, tid);
        for (int n = tid; n < N; n += 128) wbuf[n] = weights[(long long)b * N + n];
        if constexpr (WGMMA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
        q_b = b;
      }

      unsigned acc_u[ACC_WORDS];
      tile_mma<N, DIM, F16ACC, WGMMA>(ka[st], qbuf, acc_u, g, tig);

      // The fragments are consumed: refill this stage while the epilogue runs.
      if (loads_left > 0) issue(ka[st], kscale[st], st_b[st], st_t[st], st_rows[st]);

      tile_store<NEXT_N, HEADS, OutT, EpiT, AccT>(acc_u, WeightsSmem{wbuf + 2 * tig}, sc0, sc1, b, tile, rows, out,
                                                  out_stride, warp, g, tig, logits_bf16<OutT>(flags));
    }
  }
}

}  // namespace fij_mqa
