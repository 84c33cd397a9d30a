// The generic paged MQA logits kernel: next_n, num_heads, head_dim (<= 256) and
// block_size are runtime arguments, so one cubin per (output, epilogue, accumulator
// dtype) serves every geometry when a specialization cannot be compiled (no NVRTC,
// FLASHINFER_JIT_DISABLE=1 without that specialization in the cache).
//
// It is the ring kernel (mqa_logits/ring.cuh: producer warp + bulk copies + one consumer
// warpgroup) with a 256-row Q buffer: the MMA runs in 64-column chunks up to next_n *
// num_heads (sm_90a: wgmma m64n64k32; elsewhere mma.sync), and the epilogue walks the
// columns keeping one running head sum, flushed whenever the (uniform) slot t changes.
// With fp32 epilogues it sums in the same order as the specialized kernels.
#pragma once
#include "mqa_logits/ring.cuh"

namespace fij_mqa {

constexpr int kGenN = 256, kGenDim = 256, kGenWgs = 1;  // one consumer warpgroup: 255 registers, no spills

template <bool F16ACC, bool WGMMA>
__device__ __forceinline__ void tile_mma_rt(const unsigned (&ka)[2][kGenDim / 16], const unsigned char* qbuf,
                                            unsigned* acc_u, int n, int dim, int g, int tig) {
  constexpr int N = kGenN;
  constexpr int ACC_WORDS = F16ACC ? N / 4 : N / 2;
  float* acc_f = reinterpret_cast<float*>(acc_u);
#pragma unroll
  for (int w = 0; w < ACC_WORDS; ++w) acc_u[w] = 0u;
  if constexpr (WGMMA) {
    const unsigned long long desc0 = (unsigned long long)((smem_u32(qbuf) & 0x3FFFF) >> 4) |
                                     ((unsigned long long)(128 >> 4) << 16) |  // LBO: next 16 k-bytes
                                     ((unsigned long long)(256 >> 4) << 32);   // SBO: next 8 rows
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int s = 0; s < kGenDim / 32; ++s) {
      if (s * 32 < dim) {
        const unsigned a[4] = {ka[0][2 * s], ka[1][2 * s], ka[0][2 * s + 1], ka[1][2 * s + 1]};
        const unsigned long long desc = desc0 + (unsigned long long)((s * N * 32) >> 4);
#pragma unroll
        for (int c = 0; c < N / 64; ++c) {
          if (c * 64 < n) {
            const unsigned long long dc = desc + (unsigned long long)((c * 8 * 256) >> 4);
            if constexpr (F16ACC)
              Wgmma<64, true>::run(acc_u + c * 16, a, dc, s > 0 ? 1 : 0);
            else
              Wgmma<64, false>::run(acc_f + c * 32, a, dc, s > 0 ? 1 : 0);
          }
        }
      }
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  } else {
#pragma unroll
    for (int s = 0; s < kGenDim / 32; ++s) {
      if (s * 32 < dim) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const unsigned r0 = ka[0][2 * s + h], r1 = ka[1][2 * s + h];
          const unsigned a[4] = {e4m3x2_to_h2(r0 & 0xffff), e4m3x2_to_h2(r1 & 0xffff), e4m3x2_to_h2(r0 >> 16),
                                 e4m3x2_to_h2(r1 >> 16)};
#pragma unroll
          for (int j = 0; j < N / 8; ++j) {
            if (j * 8 < n) {
              const unsigned bw =
                  *reinterpret_cast<const unsigned*>(qbuf + q_offset<N>(j * 8 + g, s, h, tig * 4));
              mma_16816<F16ACC>(acc_u + (F16ACC ? 2 * j : 4 * j), a, e4m3x2_to_h2(bw & 0xffff),
                                e4m3x2_to_h2(bw >> 16));
            }
          }
        }
      }
    }
  }
}

template <typename OutT, typename EpiT, typename AccT>
__device__ __forceinline__ void tile_store_rt(const unsigned* acc_u, const float* wbuf, float sc0, float sc1, int b,
                                              int tile, int rows, OutT* __restrict__ out, long long out_stride,
                                              int next_n, int heads, int warp, int g, int tig) {
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr bool F16EPI = same_type<EpiT, fij::half_t>::value;
  constexpr bool F16OUT = same_type<OutT, fij::half_t>::value;
  constexpr bool BF16OUT = same_type<OutT, fij::bf16_t>::value;
  const float* acc_f = reinterpret_cast<const float*>(acc_u);
  const int n = next_n * heads;
  const int pos0 = tile * kTile + warp * 16 + g;
  float run[2] = {0.f, 0.f};
  unsigned short hrun[2] = {0, 0};
  auto flush = [&](int t) {  // quad-reduce the running sums of slot t and store them
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sc = r ? sc1 : sc0;
      const int pos = pos0 + 8 * r;
      OutT* dst = out + (long long)(b * next_n + t) * out_stride + pos;
      if constexpr (F16EPI) {
        unsigned v = hrun[r];
        v = hadd(v, __shfl_xor_sync(0xffffffffu, v, 1));
        v = hadd(v, __shfl_xor_sync(0xffffffffu, v, 2));
        const unsigned short res = hmul((unsigned short)v, f2h(sc));
        if (tig == 0 && pos < rows) {
          if constexpr (F16OUT) reinterpret_cast<unsigned short*>(dst)[0] = res;
          else if constexpr (BF16OUT) reinterpret_cast<unsigned short*>(dst)[0] = f2bf(h2f(res));
          else *reinterpret_cast<float*>(dst) = h2f(res);
        }
      } else {
        float v = run[r];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        v *= sc;
        if (tig == 0 && pos < rows) {
          if constexpr (F16OUT) reinterpret_cast<unsigned short*>(dst)[0] = f2h(v);
          else if constexpr (BF16OUT) reinterpret_cast<unsigned short*>(dst)[0] = f2bf(v);
          else *reinterpret_cast<float*>(dst) = v;
        }
      }
      run[r] = 0.f;
      hrun[r] = 0;
    }
  };
  int cur = 0;  // the slot t whose heads are being summed (uniform over the warp)
#pragma unroll
  for (int i = 0; i < kGenN / 8; ++i) {
    if (i * 8 >= n) break;
    const int col = i * 8 + tig * 2;  // this thread's column pair (both in one slot: heads % 4 == 0)
    const int t_lo = (i * 8) / heads, t_hi = (i * 8 + 7) / heads, t_own = col / heads;
    if (t_lo != cur) {
      flush(cur);
      cur = t_lo;
    }
    float y[2];
    unsigned short hy[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (F16EPI) {
        const unsigned x = F16ACC ? acc_u[2 * i + r] : pack_h2(acc_f[4 * i + 2 * r], acc_f[4 * i + 2 * r + 1]);
        hy[r] = hsum2(hfma2(hrelu2(x), pack_h2(wbuf[col], wbuf[col + 1]), 0u));
      } else {
        const float x0 = F16ACC ? h2_lo(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r];
        const float x1 = F16ACC ? h2_hi(acc_u[2 * i + r]) : acc_f[4 * i + 2 * r + 1];
        y[r] = fmaf(fmaxf(x0, 0.f), wbuf[col], fmaxf(x1, 0.f) * wbuf[col + 1]);
      }
    }
    const bool mine_lo = t_own == t_lo;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (F16EPI) hrun[r] = hadd(hrun[r], mine_lo ? hy[r] : (unsigned short)0);
      else run[r] += mine_lo ? y[r] : 0.f;
    }
    if (t_hi != t_lo) {  // the chunk ends slot t_lo and starts t_hi
      flush(t_lo);
      cur = t_hi;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (F16EPI) hrun[r] = mine_lo ? (unsigned short)0 : hy[r];
        else run[r] = mine_lo ? 0.f : y[r];
      }
    }
  }
  flush(cur);
}

template <typename OutT, typename EpiT, typename AccT>
__global__ void __maxnreg__(reg_cap(kGenWgs * 128 + 32))
paged_mqa_logits_generic(const unsigned char* __restrict__ q, const unsigned char* __restrict__ kv,
                         const float* __restrict__ weights, const int* __restrict__ block_tables,
                         long long bt_stride, const int* __restrict__ seq_lens, long long sl_stride,
                         const int* __restrict__ schedule, OutT* __restrict__ out, long long out_stride, int batch,
                         int kv_evict_first,  // the KV stream's L2 policy (KvPolicy)
                         int next_n, int heads, int dim, int block, int stages) {
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr int ACC_WORDS = F16ACC ? kGenN / 4 : kGenN / 2;
  constexpr int WORDS = kGenDim / 16;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr bool WGMMA = true;
#else
  constexpr bool WGMMA = false;
#endif
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int red[32];
  __shared__ int sched[3];
  cta_tiles<kGenWgs * 128 + 32>(schedule, seq_lens, sl_stride, batch, red, sched);
  // The RingLayout of the specialized kernel with runtime sizes and a 256-row Q.
  const int n = next_n * heads;
  const int stage_bytes = kTile * dim + kTile * 4;
  unsigned char* qbase = smem + stages * stage_bytes;
  float* wbase = reinterpret_cast<float*>(qbase + kGenWgs * kGenN * dim);
  int4* meta = reinterpret_cast<int4*>(wbase + kGenWgs * kGenN);
  const unsigned full0 = smem_u32(meta + stages), empty0 = full0 + 8 * stages;
  ring_init(full0, empty0, stages);  // (synchronizes the block: sched is visible)
  const int len = sched[2];
  if ((int)threadIdx.x >= kGenWgs * 128) {
    const BulkTileCopy copy{smem, kv, stage_bytes, dim, block, KvPolicy::make(kv_evict_first != 0)};
    ring_produce(meta, full0, empty0, stages, block, sched, copy, block_tables, bt_stride, seq_lens, sl_stride, batch);
    return;
  }
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
  unsigned char* qbuf = qbase + wg * (kGenN * dim);
  float* wbuf = wbase + wg * kGenN;
  const unsigned bar = 1 + wg;
  int q_b = -1;
  for (int i = wg; i < len; i += kGenWgs) {
    const int s = i % stages;
    mbar_wait(full0 + 8 * s, (i / stages) & 1);
    const int4 m = meta[s];
    if (m.x >= batch) {  // padding of an inconsistent caller schedule
      release_stage(empty0 + 8 * s);
      continue;
    }
    const unsigned char* stage = smem + s * stage_bytes;
    unsigned ka[2][WORDS];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned char* row = stage + (warp * 16 + g + 8 * r) * dim;
#pragma unroll
      for (int p = 0; p < kGenDim / 64; ++p) {
        if (p * 64 + 64 <= dim) {
          const uint4 v = *reinterpret_cast<const uint4*>(row + p * 64 + tig * 16);
          ka[r][4 * p] = v.x; ka[r][4 * p + 1] = v.y; ka[r][4 * p + 2] = v.z; ka[r][4 * p + 3] = v.w;
        } else if (p * 64 < dim) {  // the trailing 32-byte chunk
          const uint2 v = *reinterpret_cast<const uint2*>(row + p * 64 + tig * 8);
          ka[r][4 * p] = v.x; ka[r][4 * p + 1] = v.y;
        }
      }
    }
    const float* scales = reinterpret_cast<const float*>(stage + kTile * dim);
    const float sc0 = scales[warp * 16 + g], sc1 = scales[warp * 16 + g + 8];
    release_stage(empty0 + 8 * s);
    if (m.x != q_b) {
      asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
      load_q_rows<kGenN>(q + (long long)m.x * n * dim, n, dim, qbuf, tid);
      for (int c = tid; c < n; c += 128) wbuf[c] = weights[(long long)m.x * n + c];
      if constexpr (WGMMA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
      q_b = m.x;
    }
    unsigned acc_u[ACC_WORDS];
    tile_mma_rt<F16ACC, WGMMA>(ka, qbuf, acc_u, n, dim, g, tig);
    tile_store_rt<OutT, EpiT, AccT>(acc_u, wbuf, sc0, sc1, m.x, m.y, m.z, out, out_stride, next_n, heads, warp, g,
                                    tig);
  }
}

}  // namespace fij_mqa
