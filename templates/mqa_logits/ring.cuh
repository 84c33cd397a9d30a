// The streaming form of the paged MQA logits kernel: a shared-memory ring fed by bulk
// copies, so the bytes in flight per SM no longer depend on registers.
//
// One producer warp walks the CTA's tiles in order and, per 64-token tile, issues
// `cp.async.bulk` copies (plain sm_90 1-D bulk copies completing on an mbarrier; no
// tensor map) of the tile's fp8 values (contiguous token-major rows of a KV block) and
// its fp32 scales into the next ring stage; it also writes the tile's (request, tile,
// readable rows) beside the stage. WGS consumer warpgroups take the tiles round-robin:
// wait on the stage's `full` barrier, read their K fragment rows from shared memory
// (the same permuted fragment as the direct kernel, see mqa_logits/tile.cuh), release
// the stage on its `empty` barrier, then MMA + epilogue. With STAGES stages of 8 KB the
// producer keeps up to ~100 KB of reads outstanding per SM, which HBM needs (~32 KB per
// microsecond of latency per SM at full bandwidth), while consumers stall on Q reloads.
#pragma once
#include "mqa_logits/tile.cuh"

namespace fij_mqa {

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Returns once the barrier phase of parity `parity` has completed (a fresh barrier
// counts as having completed the phase of parity 1).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A consumer warp is done with a stage: after __syncwarp every lane's reads of it are
// complete (ordered before lane 0's release-arrive), so one arrival per warp suffices.
__device__ __forceinline__ void release_stage(unsigned empty_bar) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(empty_bar);
}
// The L2 policy of the KV stream, chosen by the host per call (the kernels' kv_evict_first
// argument). A call reads each KV byte once; marking its lines evict-first keeps in L2 what
// is reused (Q, weights, block tables, the logits the next kernel reads, which are then not
// written back mid-stream). On the H200 that took small calls 5-8 % faster (B=32, L=8192:
// 12.9-13.3 to 11.9-12.4 us per call in a graph of 8) but the L=64K rows 1-4 % slower, so
// the dispatcher asks for it for small calls only (BENCHMARKS.md, MQA round 8).
struct KvPolicy {
  unsigned long long policy;  // an L2::evict_first cache policy, when evict_first
  bool evict_first;
  static __device__ __forceinline__ KvPolicy make(bool evict_first) {
    KvPolicy kp{0ull, evict_first};
    if (evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(kp.policy));
    return kp;
  }
};
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar, KvPolicy kp) {
  if (kp.evict_first)
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(kp.policy)
        : "memory");
  else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Shared memory of the ring kernel (bytes): stages, per-warpgroup Q and weights, per-stage
// tile descriptors (int4) and the 2*STAGES mbarriers. Mirrored by ring_smem_bytes in
// flashinfer_jit/mqa_logits_checks.py.
template <int N, int DIM, int WGS, int STAGES>
struct RingLayout {
  static constexpr int kStage = kTile * DIM + kTile * 4;  // values, then the 64 scales
  static constexpr int kQ = STAGES * kStage;
  static constexpr int kW = kQ + WGS * N * DIM;
  static constexpr int kMeta = kW + WGS * N * 4;
  static constexpr int kBars = kMeta + STAGES * 16;
  static constexpr int kBytes = kBars + STAGES * 16;
};

// True in one lane of the (fully active) warp, which ptxas knows is a single lane.
__device__ __forceinline__ bool elect_one() {
  unsigned one;
  asm volatile("{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}" : "=r"(one));
  return one != 0;
}

// Walks (request, tile) forward past requests without tiles.
__device__ __forceinline__ void skip_empty(int& b, int& t, int& seq, const int* seq_lens, long long sl_stride,
                                           int batch) {
  while (b < batch && t >= tiles_of(seq)) {
    t -= tiles_of(seq);
    ++b;
    seq = b < batch ? max(0, seq_lens[b * sl_stride]) : 0;
  }
}

__device__ __forceinline__ void ring_init(unsigned full0, unsigned empty0, int stages) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(full0 + 8 * s, 1);     // the producer's arrive + the copies' bytes
      mbar_init(empty0 + 8 * s, 4);    // one lane per warp of the consuming warpgroup
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}

// How the ring kernels copy one 64-token tile into ring stage s: `cp.async.bulk` of the
// contiguous fp8 rows and the fp32 scales of the tile's KV block(s), completing on `bar`.
// `blk0`/`blk1` are the tile's first/second KV block (32-token blocks), `t` its tile index
// in the request (which half of a 128-token block), `two` whether the second block exists.
struct BulkTileCopy {
  unsigned char* smem;
  const unsigned char* kv;
  int stage_bytes, dim, block;
  KvPolicy policy;
  __device__ __forceinline__ void operator()(int s, unsigned bar, int blk0, int blk1, int t, bool two) const {
    const int kbytes = kTile * dim;
    const long long block_bytes = (long long)block * (dim + 4);
    const unsigned dst = smem_u32(smem + s * stage_bytes);
    const unsigned char* base = kv + (long long)blk0 * block_bytes;
    if (block >= kTile) {
      const int part = t % (block / kTile);  // which 64-token half of a 128-token block
      mbar_arrive_tx(bar, stage_bytes);
      bulk_copy(dst, base + part * kbytes, kbytes, bar, policy);
      bulk_copy(dst + kbytes, base + block * dim + part * kTile * 4, kTile * 4, bar, policy);
    } else {  // 32-token blocks: the second may not exist at the end of a request
      mbar_arrive_tx(bar, two ? stage_bytes : stage_bytes / 2);
      bulk_copy(dst, base, block * dim, bar, policy);
      bulk_copy(dst + kbytes, base + block * dim, block * 4, bar, policy);
      if (two) {
        const unsigned char* base1 = kv + (long long)blk1 * block_bytes;
        bulk_copy(dst + block * dim, base1, block * dim, bar, policy);
        bulk_copy(dst + kbytes + block * 4, base1 + block * dim, block * 4, bar, policy);
      }
    }
  }
};

// Where one of a producer warp's tiles is: request, tile, readable rows, KV block(s).
struct TileWhere {
  int b, t, rows, blk0, blk1;
};

// Lane-parallel lookahead of a producer warp: lane l walks the warp's tiles l, l + 32, ...
// (in the warp's own tile order) and loads their block-table entries one batch of 32 tiles
// before the warp issues them, so no copy waits on a dependent global load. (The walk to
// the next batch starts after a batch's first copy: the first copies go out first.)
struct TileCursor {
  int b, t, seq;
  __device__ __forceinline__ TileWhere where(int block, const int* __restrict__ block_tables, long long bt_stride,
                                             int batch) const {
    const int nblk = (seq + block - 1) / block, first = t * kTile / block;
    TileWhere w{b, t, nblk * block, 0, 0};
    if (b < batch) {
      w.blk0 = first < nblk ? block_tables[b * bt_stride + first] : 0;
      w.blk1 = block < kTile && first + 1 < nblk ? block_tables[b * bt_stride + first + 1] : 0;
    }
    return w;
  }
  __device__ __forceinline__ void advance(int tiles, const int* seq_lens, long long sl_stride, int batch) {
    t += tiles;
    skip_empty(b, t, seq, seq_lens, sl_stride, batch);
  }
};

// A producer warp: streams this CTA's tiles (sched = request, tile, count) into the ring,
// stage i % stages for tile i, with `copy` (BulkTileCopy or the TMA kernel's), and writes
// (request, tile, readable rows) to meta. With `producers` > 1 warps, warp p takes tiles
// p, p + producers, ... (stages % producers == 0 keeps a stage with one warp). Geometry
// arguments are compile-time constants in the specialized kernels (folded after inlining)
// and runtime values in the generic one.
// LEAN: the warp's tile counter and stage warp-uniform (broadcast producer index and count)
// and the copies issued by an elected lane, so ptxas issues them from uniform registers
// without a loop over the lanes' values. PAIR: the tiles go out in pairs, warp p taking
// tiles 2p, 2p + 1, 2p + 2 producers, ... (the TMA kernel's paired consumer loop).
template <bool LEAN = false, bool PAIR = false, typename Copy>
__device__ __forceinline__ void ring_produce(int4* meta, unsigned full0, unsigned empty0, int stages, int block,
                                             const int* sched, const Copy& copy,
                                             const int* __restrict__ block_tables, long long bt_stride,
                                             const int* __restrict__ seq_lens, long long sl_stride, int batch,
                                             int producer = 0, int producers = 1) {
  const int lane = threadIdx.x & 31;
  const int len = LEAN ? __shfl_sync(0xffffffffu, sched[2], 0) : sched[2];
  if constexpr (LEAN) producer = __shfl_sync(0xffffffffu, producer, 0);
  TileCursor cur{sched[0], sched[1], 0};
  cur.seq = cur.b < batch ? max(0, seq_lens[cur.b * sl_stride]) : 0;
  // The warp's o-th tile is producer + o producers on, or paired 2 producer + (o / 2) 2
  // producers + o % 2 (either way 32 tiles on is 32 producers on).
  cur.advance(PAIR ? 2 * producer + (lane >> 1) * 2 * producers + (lane & 1) : producer + lane * producers, seq_lens,
              sl_stride, batch);
  TileWhere now = cur.where(block, block_tables, bt_stride, batch), next = now;
  for (int o = 0, i = PAIR ? 2 * producer : producer; i < len;
       ++o, i += PAIR ? ((o & 1) ? 1 : 2 * producers - 1) : producers) {
    const int j = o & 31;
    if (j == 0 && o > 0) now = next;  // a new batch: its entries arrived meanwhile
    if (j == 1) {  // fetch the next batch's entries (a last batch of one tile needs none)
      cur.advance(32 * producers, seq_lens, sl_stride, batch);
      next = cur.where(block, block_tables, bt_stride, batch);
    }
    const int b = __shfl_sync(0xffffffffu, now.b, j), t = __shfl_sync(0xffffffffu, now.t, j);
    const int rows = __shfl_sync(0xffffffffu, now.rows, j);
    const int blk0 = __shfl_sync(0xffffffffu, now.blk0, j), blk1 = __shfl_sync(0xffffffffu, now.blk1, j);
    const int s = i % stages;
    mbar_wait(empty0 + 8 * s, ((i / stages) & 1) ^ 1);
    if (LEAN ? elect_one() : lane == 0) {
      if (b >= batch) {  // an inconsistent caller schedule: pad with empty tiles, never hang
        meta[s] = make_int4(batch, 0, 0, 0);
        mbar_arrive(full0 + 8 * s);
      } else {
        meta[s] = make_int4(b, t, rows, 0);
        copy(s, full0 + 8 * s, blk0, blk1, t, (t * kTile / block) + 1 < rows / block);
      }
    }
    __syncwarp();
  }
}

template <int NEXT_N, int HEADS, int DIM, int BLOCK, typename OutT, typename EpiT, typename AccT, int WGS, int STAGES,
          bool WGMMA>
__device__ __forceinline__ void ring_body(unsigned char* smem, const int* sched, const unsigned char* __restrict__ q,
                                          const unsigned char* __restrict__ kv, const float* __restrict__ weights,
                                          const int* __restrict__ block_tables, long long bt_stride,
                                          const int* __restrict__ seq_lens, long long sl_stride,
                                          OutT* __restrict__ out, long long out_stride, int batch,
                                          bool kv_evict_first, bool out_bf16) {
  constexpr int N = NEXT_N * HEADS;
  constexpr int WORDS = DIM / 16;
  constexpr int KBYTES = kTile * DIM;
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr int ACC_WORDS = F16ACC ? N / 4 : N / 2;
  using L = RingLayout<N, DIM, WGS, STAGES>;
  static_assert(L::kStage % 128 == 0 && L::kMeta % 16 == 0, "ring alignment");
  // Tile i goes to warpgroup i % WGS and stage i % STAGES: with STAGES % WGS == 0 a stage
  // is always consumed by the same warpgroup, which has therefore seen the stage's
  // previous phase complete before it waits on the next parity (a parity wait cannot
  // tell phase r from phase r - 2).
  static_assert(STAGES >= 1 && STAGES % WGS == 0, "ring stages must be a multiple of the consumer warpgroups");
  int4* meta = reinterpret_cast<int4*>(smem + L::kMeta);
  const unsigned full0 = smem_u32(smem + L::kBars), empty0 = full0 + 8 * STAGES;
  ring_init(full0, empty0, STAGES);
  const int len = sched[2];
  const int lane = threadIdx.x & 31;
  if ((int)threadIdx.x >= WGS * 128) {
    const BulkTileCopy copy{smem, kv, L::kStage, DIM, BLOCK, KvPolicy::make(kv_evict_first)};
    ring_produce(meta, full0, empty0, STAGES, BLOCK, sched, copy, block_tables, bt_stride, seq_lens, sl_stride, batch);
    return;
  }

  // ---- consumer warpgroups ------------------------------------------------------------
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const int warp = tid >> 5, g = lane >> 2, tig = lane & 3;
  unsigned char* qbuf = smem + L::kQ + wg * (N * DIM);
  float* wbuf = reinterpret_cast<float*>(smem + L::kW) + wg * N;
  const unsigned bar = 1 + wg;
  // Weights in registers when accumulators + weights + fragments leave room (see WeightsReg).
  constexpr bool WREG = N / 2 + N / 4 + DIM / 8 + 54 <= reg_cap(WGS * 128 + 32);
  WeightsReg<WREG ? N : 8> wreg;
  int q_b = -1;
  if (wg < len) {  // Q of the first request is fetched while the first tile streams in
    int b = sched[0], t = sched[1];
    int seq = b < batch ? max(0, seq_lens[b * sl_stride]) : 0;
    skip_empty(b, t, seq, seq_lens, sl_stride, batch);
    if (b < batch) {
      load_q<N, DIM>(q, b, qbuf, tid);
      for (int n = tid; n < N; n += 128) wbuf[n] = weights[(long long)b * N + n];
      if constexpr (WGMMA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      q_b = b;
    }
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    if constexpr (WREG) wreg.load(wbuf, tig);
  }
  for (int i = wg; i < len; i += WGS) {
    const int s = i % STAGES;
    mbar_wait(full0 + 8 * s, (i / STAGES) & 1);
    const int4 m = meta[s];
    if (m.x >= batch) {  // padding of an inconsistent caller schedule
      release_stage(empty0 + 8 * s);
      continue;
    }
    const unsigned char* stage = smem + s * L::kStage;
    unsigned ka[2][WORDS];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned char* row = stage + (warp * 16 + g + 8 * r) * DIM;
#pragma unroll
      for (int p = 0; p < DIM / 64; ++p) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + p * 64 + tig * 16);
        ka[r][4 * p] = v.x; ka[r][4 * p + 1] = v.y; ka[r][4 * p + 2] = v.z; ka[r][4 * p + 3] = v.w;
      }
      if constexpr (DIM % 64 != 0) {
        const uint2 v = *reinterpret_cast<const uint2*>(row + (DIM / 64) * 64 + tig * 8);
        ka[r][WORDS - 2] = v.x; ka[r][WORDS - 1] = v.y;
      }
    }
    const float* scales = reinterpret_cast<const float*>(stage + KBYTES);
    const float sc0 = scales[warp * 16 + g], sc1 = scales[warp * 16 + g + 8];
    release_stage(empty0 + 8 * s);  // the stage's bytes are in registers now
    if (m.x != q_b) {  // a new request: its Q and weights into this warpgroup's buffers
      asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
      load_q<N, DIM>(q, m.x, qbuf, tid);
      for (int n = tid; n < N; n += 128) wbuf[n] = weights[(long long)m.x * N + n];
      if constexpr (WGMMA) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
      if constexpr (WREG) wreg.load(wbuf, tig);
      q_b = m.x;
    }
    unsigned acc_u[ACC_WORDS];
    tile_mma<N, DIM, F16ACC, WGMMA>(ka, qbuf, acc_u, g, tig);
    if constexpr (WREG)
      tile_store<NEXT_N, HEADS, OutT, EpiT, AccT>(acc_u, wreg, sc0, sc1, m.x, m.y, m.z, out, out_stride, warp, g,
                                                  tig, out_bf16);
    else
      tile_store<NEXT_N, HEADS, OutT, EpiT, AccT>(acc_u, WeightsSmem{wbuf + 2 * tig}, sc0, sc1, m.x, m.y, m.z, out,
                                                  out_stride, warp, g, tig, out_bf16);
  }
}

}  // namespace fij_mqa
