// FP8 paged MQA logits (the DeepSeek sparse-attention indexer):
//
//   out[b*NEXT_N + t, pos] = scale[pos] * sum_h w[b*NEXT_N + t, h] * relu(q[b,t,h,:] . k[pos,:])
//
// Design. A persistent CTA (one per SM) owns a contiguous run of 64-token tiles of the
// request-major tile list (see mqa_logits_util.cuh) and splits it over WGS warpgroups.
// A warpgroup computes S^T = K_tile (64 tokens x DIM) . Q_b^T (DIM x N, N = NEXT_N*HEADS)
// so that tokens are rows and (t, h) pairs are columns: the head sum is then a sum over
// a thread's own accumulator columns plus two quad shuffles.
//
// K is loaded straight from global memory into the registers of the MMA A fragment -- no
// shared memory, no swizzle -- using a permutation of the head_dim axis: a dot product is
// order-free, so thread `tig` of a quad takes 16 contiguous bytes per 64-byte chunk of a
// token row (coalesced 16-byte loads) and Q is stored in shared memory in the same
// permuted order. STAGES tiles of loads are kept in flight per warpgroup.
//
// MMA: on sm_90a `wgmma.mma_async m64nNk32 e4m3` with A in registers and B = Q in shared
// memory (no-swizzle K-major core matrices). Elsewhere (sm_100a/sm_103a, or PORTABLE) the
// e4m3 fragments are widened to f16 (exact) for `mma.sync m16n8k16`, which is what the
// compiler emits for fp8 mma.sync on those parts anyway. acc f16 uses the f16-accumulator
// form of either instruction.
#pragma once
#include "mqa_logits_util.cuh"
#include "mqa_logits_wgmma.cuh"

namespace fij_mqa {

// Byte offset of Q element (n, logical k) in a warpgroup's Q buffer (N x DIM e4m3): per
// 32-wide k step a block of N x 32 bytes made of 8-row x 16-byte core matrices
// [n/8][k/16]; see load_q for the inverse (physical head_dim byte -> logical k).
template <int N>
__device__ __forceinline__ int q_offset(int n, int s, int half, int byte) {
  return s * (N * 32) + (n >> 3) * 256 + half * 128 + (n & 7) * 16 + byte;
}

// Q[b] (N x DIM, row n = t*HEADS + h) into the buffer, permuted as the K fragments are.
template <int N, int DIM>
__device__ __forceinline__ void load_q(const unsigned char* __restrict__ q, int b, unsigned char* qbuf, int tid) {
  const unsigned* src = reinterpret_cast<const unsigned*>(q + (long long)b * N * DIM);
  for (int idx = tid; idx < N * DIM / 4; idx += 128) {
    const int n = idx / (DIM / 4), pb = (idx % (DIM / 4)) * 4;
    const int pair = pb >> 6, r = pb & 63;
    int s, tig, half;
    if (pair * 64 + 64 <= DIM) {  // full 64-byte chunk: tig owns bytes [16 tig, 16 tig + 16)
      tig = r >> 4;
      s = 2 * pair + ((r >> 3) & 1);
      half = (r >> 2) & 1;
    } else {  // trailing 32-byte chunk: tig owns bytes [8 tig, 8 tig + 8)
      tig = r >> 3;
      s = 2 * pair;
      half = (r >> 2) & 1;
    }
    *reinterpret_cast<unsigned*>(qbuf + q_offset<N>(n, s, half, tig * 4)) = src[idx];
  }
}

// wgmma over N columns in chunks of 256/128/.../8 (the widths with generated wrappers).
template <int N, int N0, bool F16ACC, typename T>
__device__ __forceinline__ void wgmma_chunks(T* acc, const unsigned (&a)[4], unsigned long long desc, int scale_d) {
  if constexpr (N0 < N) {
    constexpr int R = N - N0;
    constexpr int C = R >= 256 ? 256 : R >= 128 ? 128 : R >= 64 ? 64 : R >= 32 ? 32 : R >= 16 ? 16 : 8;
    Wgmma<C, F16ACC>::run(acc + (F16ACC ? N0 / 4 : N0 / 2), a, desc + (unsigned long long)((N0 / 8) * 256 >> 4),
                          scale_d);
    wgmma_chunks<N, N0 + C, F16ACC>(acc, a, desc, scale_d);
  }
}

template <bool F16ACC>
__device__ __forceinline__ void mma_16816(unsigned* acc, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (F16ACC) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0, %1}, {%2, %3, %4, %5}, {%6, %7}, {%0, %1};"
                 : "+r"(acc[0]), "+r"(acc[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

struct Cursor {
  int b, t, nt, seq;
};

template <int NEXT_N, int HEADS, int DIM, int BLOCK, typename OutT, typename EpiT, typename AccT, int WGS, int STAGES,
          bool PORTABLE>
__global__ void __launch_bounds__(WGS * 128, 1)
paged_mqa_logits(const unsigned char* __restrict__ q,       // [B, NEXT_N, HEADS, DIM] e4m3, contiguous
                 const unsigned char* __restrict__ kv,      // [num_blocks, BLOCK * (DIM + 4)] fused pool
                 const float* __restrict__ weights,         // [B * NEXT_N, HEADS], contiguous
                 const int* __restrict__ block_tables, long long bt_stride,
                 const int* __restrict__ seq_lens, long long sl_stride,
                 const int* __restrict__ schedule,          // [gridDim.x + 1, 2] or nullptr
                 OutT* __restrict__ out, long long out_stride, int batch) {
  constexpr int N = NEXT_N * HEADS;
  constexpr int THREADS = WGS * 128;
  constexpr int WORDS = DIM / 16;  // A-fragment words per token row per thread
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr bool F16EPI = same_type<EpiT, fij::half_t>::value;
  constexpr bool F16OUT = same_type<OutT, fij::half_t>::value;
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

  // ---- this CTA's run of tiles: from the caller's schedule or derived here ----------
  if (schedule == nullptr) {
    const int total = total_tiles<THREADS>(seq_lens, sl_stride, batch, red);
    const int x0 = split_point(blockIdx.x, gridDim.x, total);
    locate_tile<THREADS>(seq_lens, sl_stride, batch, x0, red, sched);
    if (threadIdx.x == 0) sched[2] = split_point(blockIdx.x + 1, gridDim.x, total) - x0;
  } else if (threadIdx.x < 32) {
    // A stale schedule may be inconsistent: everything below stays within the batch
    // and counts tiles, so it can produce wrong logits but cannot hang.
    const int b0 = schedule[2 * blockIdx.x], t0 = schedule[2 * blockIdx.x + 1];
    const int b1 = min(schedule[2 * blockIdx.x + 2], batch), t1 = schedule[2 * blockIdx.x + 3];
    int sum = 0;
    for (int b = max(b0, 0) + lane; b < b1; b += 32) sum += tiles_of(seq_lens[b * sl_stride]);
    sum = warp_sum(sum);
    if (lane == 0) {
      sched[0] = max(b0, 0);
      sched[1] = t0;
      sched[2] = max(0, sum - t0 + (b1 < batch ? t1 : 0));
    }
  }
  __syncthreads();
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

      // ---- S^T tile = K . Q^T ----------------------------------------------------------
      unsigned acc_u[ACC_WORDS];
      float* acc_f = reinterpret_cast<float*>(acc_u);
      if constexpr (WGMMA) {
        const unsigned long long desc0 = (unsigned long long)((smem_u32(qbuf) & 0x3FFFF) >> 4) |
                                         ((unsigned long long)(128 >> 4) << 16) |  // LBO: next 16 k-bytes
                                         ((unsigned long long)(256 >> 4) << 32);   // SBO: next 8 rows
#pragma unroll
        for (int w = 0; w < ACC_WORDS; ++w) acc_u[w] = 0u;
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int s = 0; s < DIM / 32; ++s) {
          const unsigned a[4] = {ka[st][0][2 * s], ka[st][1][2 * s], ka[st][0][2 * s + 1], ka[st][1][2 * s + 1]};
          const unsigned long long desc = desc0 + (unsigned long long)((s * N * 32) >> 4);
          if constexpr (F16ACC)
            wgmma_chunks<N, 0, true>(acc_u, a, desc, s > 0 ? 1 : 0);
          else
            wgmma_chunks<N, 0, false>(acc_f, a, desc, s > 0 ? 1 : 0);
        }
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      } else {
#pragma unroll
        for (int w = 0; w < ACC_WORDS; ++w) acc_u[w] = 0u;
#pragma unroll
        for (int s = 0; s < DIM / 32; ++s) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const unsigned r0 = ka[st][0][2 * s + h], r1 = ka[st][1][2 * s + h];
            const unsigned a[4] = {e4m3x2_to_h2(r0 & 0xffff), e4m3x2_to_h2(r1 & 0xffff), e4m3x2_to_h2(r0 >> 16),
                                   e4m3x2_to_h2(r1 >> 16)};
#pragma unroll
            for (int j = 0; j < N / 8; ++j) {
              const unsigned bw =
                  *reinterpret_cast<const unsigned*>(qbuf + q_offset<N>(j * 8 + g, s, h, tig * 4));
              mma_16816<F16ACC>(acc_u + (F16ACC ? 2 * j : 4 * j), a, e4m3x2_to_h2(bw & 0xffff),
                                e4m3x2_to_h2(bw >> 16));
            }
          }
        }
      }

      // The fragments are consumed: refill this stage while the epilogue runs.
      if (loads_left > 0) issue(ka[st], kscale[st], st_b[st], st_t[st], st_rows[st]);

      // ---- epilogue: relu, weights, head sum (per t), scale, store --------------------
      float part[NEXT_N][2];
      unsigned short hpart[NEXT_N][2];
#pragma unroll
      for (int t = 0; t < NEXT_N; ++t) {
        part[t][0] = part[t][1] = 0.f;
        hpart[t][0] = hpart[t][1] = 0;
      }
#pragma unroll
      for (int i = 0; i < N / 8; ++i) {
        const int t_lo = (i * 8) / HEADS, t_hi = (i * 8 + 7) / HEADS;
        const bool low = (i * 8 + tig * 2) < (t_lo + 1) * HEADS;  // which t this thread's pair is in
        const int col = i * 8 + tig * 2;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if constexpr (F16EPI) {
            const unsigned x = F16ACC ? acc_u[2 * i + r] : pack_h2(acc_f[4 * i + 2 * r], acc_f[4 * i + 2 * r + 1]);
            const unsigned w2 = pack_h2(wbuf[col], wbuf[col + 1]);
            const unsigned short y = hsum2(hfma2(hrelu2(x), w2, 0u));
            if (t_lo == t_hi || low)
              hpart[t_lo][r] = hadd(hpart[t_lo][r], y);
            else
              hpart[t_hi][r] = hadd(hpart[t_hi][r], y);
          } else {
            const float x0 = F16ACC ? h2_lo(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r];
            const float x1 = F16ACC ? h2_hi(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r + 1];
            const float y = fmaf(fmaxf(x0, 0.f), wbuf[col], fmaxf(x1, 0.f) * wbuf[col + 1]);
            if (t_lo == t_hi) {
              part[t_lo][r] += y;
            } else {
              part[t_lo][r] += low ? y : 0.f;
              part[t_hi][r] += low ? 0.f : y;
            }
          }
        }
      }
      const int pos0 = tile * kTile + warp * 16 + g;
#pragma unroll
      for (int t = 0; t < NEXT_N; ++t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float sc = r ? sc1 : sc0;
          const int pos = pos0 + 8 * r;
          OutT* dst = out + (long long)(b * NEXT_N + t) * out_stride + pos;
          if constexpr (F16EPI) {
            unsigned v = hpart[t][r];
            v = hadd(v, __shfl_xor_sync(0xffffffffu, v, 1));
            v = hadd(v, __shfl_xor_sync(0xffffffffu, v, 2));
            const unsigned short res = hmul((unsigned short)v, f2h(sc));
            if (((t * 2 + r) & 3) == tig && pos < rows) {
              if constexpr (F16OUT) reinterpret_cast<unsigned short*>(dst)[0] = res;
              else *reinterpret_cast<float*>(dst) = h2f(res);
            }
          } else {
            float v = part[t][r];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            v *= sc;
            if (((t * 2 + r) & 3) == tig && pos < rows) {
              if constexpr (F16OUT) reinterpret_cast<unsigned short*>(dst)[0] = f2h(v);
              else *reinterpret_cast<float*>(dst) = v;
            }
          }
        }
      }
    }
  }
}

}  // namespace fij_mqa
