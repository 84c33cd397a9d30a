// The Hopper form of the paged MQA logits kernel (sm_90a; head_dim 32, 64, 96, 128, 256,
// see Panels): both wgmma
// operands come straight from shared memory, so a consumer warpgroup spends its issue
// slots on the epilogue, not on moving K into registers.
//
//   * K: producer warps (one per consumer warpgroup, each feeding its tiles) stream each
//     64-token tile into a ring stage with the tensor memory accelerator
//     (cp.async.bulk.tensor through a host-built tensor map over the fused pool viewed as
//     [num_blocks][block_size][head_dim] bytes, one box per column panel in the panel's
//     swizzle), which lays the rows out as wgmma's K-major swizzled operand (SW128 at
//     head_dim >= 128, SW64 / SW32 at 64 / 32); the tile's fp32 scales follow with a
//     plain bulk copy.
//     Same ring, barriers and tile order as mqa_logits/ring.cuh.
//   * Q: each consumer warpgroup keeps QBUF swizzled Q buffers (+ weights). With two, it
//     loads its first request's Q and the next request's at the start, and whenever it
//     moves on to a request prefetches the one after it (cp.async) into the buffer just
//     left, so a request change costs a barrier, not a global-memory round trip. (At the
//     start every SM fills its ring: a load issued then waits behind that burst for
//     microseconds, so the second request's Q must not wait for the first tile.) With one
//     buffer (large next_n*num_heads, where shared memory is better spent on ring stages)
//     it loads Q when the request changes.
//   * Per tile: S^T = K_tile . Q^T with one wgmma m64nNk32 per k step (A and B descriptors), then the
//     epilogue of mqa_logits/tile.cuh (ReLU, weights, head sum in-thread, scale, store).
//   * The kernel waits for the preceding grid (griddepcontrol.wait) before its first global
//     read, so the host may launch it as a programmatic dependent launch.
#pragma once
#include "mqa_logits/sm90_tma_parts.cuh"

namespace fij_mqa {

template <int NEXT_N, int HEADS, int DIM, int BLOCK, typename OutT, typename EpiT, typename AccT, int WGS, int STAGES,
          int PRODUCERS, int QBUF, int LEAN, int PAIR, int REGS>
__global__ void __maxnreg__(reg_cap(WGS * 128 + 32 * PRODUCERS))
paged_mqa_logits_tma(const unsigned char* __restrict__ q,       // [B, NEXT_N, HEADS, DIM] e4m3, contiguous
                     const unsigned char* __restrict__ kv,      // [num_blocks, BLOCK * (DIM + 4)] fused pool
                     const float* __restrict__ weights,         // [B * NEXT_N, HEADS], contiguous
                     const int* __restrict__ block_tables, long long bt_stride,
                     const int* __restrict__ seq_lens, long long sl_stride,
                     const int* __restrict__ schedule,          // [gridDim.x + 1, 2] or nullptr
                     OutT* __restrict__ out, long long out_stride, int batch,
                     int flags,  // bit 0: the KV stream's L2 policy (KvPolicy); bit 1: 16-bit logits as bf16
                     int table_cols,  // block-table columns to prefetch into L2 (prefetch_table; 0: none)
                     const __grid_constant__ TensorMap kv_map) {  // the pool's fp8 values, see above
  constexpr int N = NEXT_N * HEADS;
  constexpr bool F16ACC = same_type<AccT, fij::half_t>::value;
  constexpr int ACC_WORDS = F16ACC ? N / 4 : N / 2;
  using L = TmaLayout<N, DIM, WGS, STAGES, QBUF>;
  using P = Panels<DIM>;
  static_assert(QBUF == 1 || QBUF == 2, "one or two Q buffers per warpgroup");
  static_assert(N % 8 == 0 && N <= 256 && HEADS % 4 == 0, "unsupported geometry");
  static_assert(BLOCK == 32 || BLOCK == 64 || BLOCK == 128, "block size");
  static_assert(STAGES >= 1 && STAGES % WGS == 0 && STAGES % PRODUCERS == 0,
                "ring stages must be a multiple of the consumer warpgroups and of the producer warps");
  static_assert(!PAIR || (LEAN && STAGES % (2 * WGS) == 0 && STAGES % (2 * PRODUCERS) == 0),
                "paired tiles: the lean loop, and whole pairs of stages per warpgroup and per producer");
  // REGS: setmaxnreg gives each consumer thread REGS registers and the producer warpgroup
  // (PRODUCERS == 4: whole) what is left of the block's launch allocation (a raise past
  // what the others give back waits forever: 120 at 4 warpgroups hung the H200).
  constexpr int kProducerRegs = (reg_cap(WGS * 128 + 32 * PRODUCERS) * (WGS + 1) - WGS * REGS) / 8 * 8;
  static_assert(REGS == 0 || (PRODUCERS == 4 && REGS % 8 == 0 && kProducerRegs >= 24 && REGS <= 248),
                "setmaxnreg: four producer warps, and registers that fit");

  extern __shared__ unsigned char smem_raw[];
  __shared__ int red[32];
  __shared__ int sched[3];
  const unsigned base = (smem_u32(smem_raw) + 1023) & ~1023u;  // swizzle atoms: up to 1024-byte alignment
  unsigned char* smem = smem_raw + (base - smem_u32(smem_raw));
  int4* meta = reinterpret_cast<int4*>(smem + L::kMeta);
  const unsigned full0 = base + L::kBars, empty0 = full0 + 8 * STAGES;
  if (threadIdx.x == WGS * 128)
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<unsigned long long>(&kv_map)) : "memory");

  ring_init(full0, empty0, STAGES);
  fij::grid_dependency_wait();  // everything above touches parameters and shared memory only
  fij::grid_dependents_launch();
  // (Not at N = 192: with it the 128 registers before setmaxnreg spilled 12 bytes, next_n=3.)
  if (N <= 128 && table_cols > 0 && threadIdx.x >= WGS * 128 && threadIdx.x < WGS * 128 + 32)  // producer warp 0
    prefetch_table(block_tables, bt_stride, batch, (int)min((long long)table_cols, out_stride / BLOCK + 1),
                   threadIdx.x & 31);
  // (The setmaxnreg kernels keep the block-wide derivation: at next_n=3 the warp's code
  // before the loop spilled 8 bytes of it.)
  cta_tiles<WGS * 128 + 32 * PRODUCERS, REGS == 0>(schedule, seq_lens, sl_stride, batch, red, sched);
  __syncthreads();  // sched is visible
  const int len = sched[2];
  if ((int)threadIdx.x >= WGS * 128) {
    if constexpr (REGS > 0) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const TmaTileCopy<DIM, BLOCK> copy{&kv_map, kv, base, base + L::kScales, KvPolicy::make(kv_evict_first<OutT>(flags))};
    ring_produce<LEAN != 0, PAIR != 0>(meta, full0, empty0, STAGES, BLOCK, sched, copy, block_tables, bt_stride, seq_lens,
                            sl_stride, batch, (threadIdx.x - WGS * 128) >> 5, PRODUCERS);
    return;
  }

  // ---- consumer warpgroups: tile i of the run goes to warpgroup i % WGS ---------------
  // (PAIR: tiles 2j and 2j + 1 to warpgroup j % WGS)
  const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
  const bool out_bf16 = logits_bf16<OutT>(flags);
  constexpr int T = PAIR ? 2 : 1;  // tiles a warpgroup takes at a time
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, tig = lane & 3;
  const unsigned bar_id = 1 + wg;
  constexpr int kWBytes = LaneWeights<N>::kFloats * 4;  // one weight buffer
  const unsigned qaddr0 = base + L::kQ + wg * QBUF * (N * DIM), waddr0 = base + L::kW + wg * QBUF * kWBytes;
  if constexpr (REGS > 0) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
  // Weights: as many column groups in registers as the accumulators and ~20 (setmaxnreg)
  // or ~48 registers of loop state leave room for, the rest read per tile (WeightsSplit).
  // At n = 128 and 112 registers that is 14 of 16 groups (16 spill): against all 16 read
  // per tile, 6-8 % faster at next_n=2 L=64K, 3-5 % at B=256 (MQA round 16); 12 groups
  // measured no better than 14 and 6 % slower at head_dim 32. (At n = 192 and 160, ~24:
  // 22 of 24 groups spill, 20 do not.)
  constexpr int kLoopRegs = REGS == 0 ? 48 : N > 128 ? 24 : 20;
  constexpr int kWBudget = (REGS > 0 ? REGS : reg_cap(WGS * 128 + 32 * PRODUCERS)) - kLoopRegs - N / 2;
  constexpr int WR = kWBudget >= N / 4 ? N / 8 : kWBudget > 0 ? kWBudget / 4 * 2 : 0;
  constexpr bool WREG = WR > 0;
  WeightsSplit<N, WR> wreg;
  // The current request and buffer; pf_b: the request whose Q is in (or on its way into)
  // buffer cur ^ 1; early_b (two buffers, until the first switch): the request after the
  // first, on its way into buffer cur, in the newest cp.async group, or kNoPrefetch where
  // the CTA's run of tiles never leaves its first request (the CTAs streaming one long
  // request): then nobody loads the next request's Q, at the start or at the first switch.
  // (In a skewed batch ~100 CTAs of 3 warpgroups loaded an 8 KB Q each that they never
  // used, beside the first KV burst: B=32, 4K + one 64K, 12.9 -> 11.8 us, H200, MQA round
  // 19. A flag of its own instead of this value spilled at n = 128 without setmaxnreg.)
  constexpr int kNoPrefetch = -2;
  int q_b = -1, pf_b = -1, early_b = -1, cur = QBUF - 1;

  // Make request b current: its Q (prefetched, or loaded now) in the next buffer, then with
  // two buffers prefetch the next request into the buffer just left.
  auto switch_to = [&](int b) {
    const int nxt = QBUF == 2 ? cur ^ 1 : 0;
    if (b != pf_b) {
      cp_async_wait_all();  // a stale prefetch may still be landing in that buffer
      // One buffer: every warp must be done with the previous request's weights first.
      if constexpr (QBUF == 1) asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
      issue_q<N, DIM>(q, weights, b, qaddr0 + nxt * (N * DIM), waddr0 + nxt * kWBytes, tid);
      cp_async_wait_all();
    } else if (early_b >= 0) {
      cp_async_wait_all_but_last();  // the early prefetch may still be landing
    } else {
      cp_async_wait_all();
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async writes -> wgmma reads
    asm volatile("bar.sync %0, 128;" ::"r"(bar_id) : "memory");
    cur = nxt;
    q_b = b;
    const float* wbuf = reinterpret_cast<const float*>(smem + L::kW) + (wg * QBUF + cur) * LaneWeights<N>::kFloats;
    if constexpr (WREG) wreg.load_lane(wbuf + tig * LaneWeights<N>::kStride);
    if constexpr (QBUF == 1) return;
    if (early_b >= 0 || early_b == kNoPrefetch) {  // already on its way into buffer cur ^ 1, or none
      pf_b = early_b >= 0 ? early_b : -1;
      early_b = -1;
      return;
    }
    // Request b + 1, empty or not: checking its length would put a global load on this
    // warpgroup's critical path. (After an empty request the next switch loads Q itself.)
    pf_b = b + 1 < batch ? b + 1 : -1;
    if (pf_b >= 0) issue_q<N, DIM>(q, weights, pf_b, qaddr0 + (cur ^ 1) * (N * DIM), waddr0 + (cur ^ 1) * kWBytes, tid);
  };

  if (T * wg < len) {  // the first tile's Q loads while its KV streams in
    int b = sched[0], t = sched[1] + T * wg;
    int seq = b < batch ? max(0, seq_lens[b * sl_stride]) : 0;
    const bool crosses = sched[1] + len > tiles_of(seq);  // (an empty first request: crossed)
    skip_empty(b, t, seq, seq_lens, sl_stride, batch);
    if (b < batch) {
      issue_q<N, DIM>(q, weights, b, qaddr0, waddr0, tid);
      pf_b = b;
      if (QBUF == 2 && b + 1 < batch && !crosses) {
        early_b = kNoPrefetch;
      } else if (QBUF == 2 && b + 1 < batch) {  // the next request's Q into buffer cur (unused yet)
        cp_async_commit();
        issue_q<N, DIM>(q, weights, b + 1, qaddr0 + cur * (N * DIM), waddr0 + cur * kWBytes, tid);
        cp_async_commit();
        early_b = b + 1;
      }
    }
  }
  // The MMA of the tile in stage s into acc (asynchronous: committed, not waited for).
  auto issue_mma = [&](int s, unsigned (&acc)[ACC_WORDS]) {
    // s and cur are warp-uniform but ptxas cannot tell: broadcasting the two addresses lets
    // it build the descriptors in uniform registers (fewer instructions a tile than moving
    // per-thread values to them for every wgmma).
    const unsigned long long da = P::desc(__shfl_sync(0xffffffffu, base + s * L::kVals, 0));
    const unsigned long long db = P::desc(__shfl_sync(0xffffffffu, qaddr0 + cur * (N * DIM), 0));
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    tma_mma_cols<N, 0, N, DIM, F16ACC>(acc, da, db);
  };
  // Tile (stage s, descriptor m) once its MMA is done: release the stage, epilogue.
  auto finish = [&](int s, int4 m, unsigned (&acc)[ACC_WORDS]) {
    const float* scales = reinterpret_cast<const float*>(smem + L::kScales) + s * kTile;
    const float sc0 = scales[warp * 16 + g], sc1 = scales[warp * 16 + g + 8];
    if constexpr (WREG) {
      tma_epilogue<NEXT_N, HEADS, OutT, EpiT, AccT>(acc, wreg, empty0 + 8 * s, sc0, sc1, m, out, out_stride,
                                                    warp, g, tig, out_bf16);
    } else {
      const float* wbuf = reinterpret_cast<const float*>(smem + L::kW) +
                          (wg * QBUF + cur) * LaneWeights<N>::kFloats + tig * LaneWeights<N>::kStride;
      tma_epilogue<NEXT_N, HEADS, OutT, EpiT, AccT>(acc, LaneWeights<N>{reinterpret_cast<const float4*>(wbuf)},
                                                    empty0 + 8 * s, sc0, sc1, m, out, out_stride, warp, g, tig,
                                                    out_bf16);
    }
  };
  // Waits for tile i and returns its descriptor (m.x >= batch: padding, already released).
  auto arrive = [&](int i) {
    const int s = i % STAGES;
    mbar_wait(full0 + 8 * s, (i / STAGES) & 1);
    const int4 m = meta[s];
    if (m.x >= batch) release_stage(empty0 + 8 * s);  // padding
    return m;
  };

  // LEAN: between a stage landing and its MMA only the wait: the stage's descriptor is
  // built before the wait (it depends on the stage index only), Q's once per request, and
  // the MMA goes out on the current request's Q before the tile's request is read. A tile
  // of another request (or padding) waits for that MMA, switches and redoes the tile
  // inside its branch; no MMA is in flight across a branch's join (ptxas would serialize
  // every wgmma, C7518), so the first request is made current before the loop. The loop's
  // state is warp-uniform (broadcast values) and every per-tile address is one add from a
  // per-thread, per-stage or per-request base (LaneRows): a tile costs the wait, the MMA,
  // the epilogue and a few adds (d32: ~126 instructions a warp a tile against 157).
  auto lean_loop = [&] {
    const int wgu = __shfl_sync(0xffffffffu, wg, 0), lenu = __shfl_sync(0xffffffffu, len, 0);
    if (T * wgu < lenu && pf_b >= 0) switch_to(pf_b);
    using Sums = TileSums<NEXT_N, HEADS, OutT, EpiT, AccT>;
    LaneRows<Sums, OutT> rows_out(warp, g, tig, out_bf16);
    if (q_b >= 0) rows_out.point(out, out_stride, q_b, tig);
    const float* sc_lane = reinterpret_cast<const float*>(smem + L::kScales) + warp * 16 + g;
    const unsigned a_lo0 = P::desc_lo(base);
    // Descriptors are kept as their low words (the high word is a constant): fewer live
    // registers at N = 128, where the loop state would otherwise spill.
    auto q_desc = [&] { return P::desc_lo(__shfl_sync(0xffffffffu, qaddr0 + cur * (N * DIM), 0)); };
    unsigned db = q_desc();
    auto mma = [&](unsigned (&into)[ACC_WORDS], unsigned da) {
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
      tma_mma_lo<N, DIM, F16ACC>(into, da, db);
    };
    // The epilogue of the tile in stage s once its MMA is done; one_left: the MMA of the
    // pair's second tile may still run (a runtime flag folded at each inlined call: NVRTC
    // 13.0 crashed on a generic lambda taking it as a type, MQA round 12).
    auto epilogue = [&](unsigned (&acc)[ACC_WORDS], int s, int4 m, bool one_left) {
      const float sc0 = sc_lane[s * kTile], sc1 = sc_lane[s * kTile + 8];
      Sums sums;
      if (one_left) tma_mma_wait<1, 0, ACC_WORDS>(acc);
      else tma_mma_wait<0, 0, ACC_WORDS>(acc);
      release_stage(empty0 + 8 * s);
      if constexpr (WREG) {
        sums.template add<0, N / 8>(acc, wreg, tig);
      } else {
        const float* wbuf = reinterpret_cast<const float*>(smem + L::kW) +
                            (wg * QBUF + cur) * LaneWeights<N>::kFloats + tig * LaneWeights<N>::kStride;
        sums.template add<0, N / 8>(acc, LaneWeights<N>{reinterpret_cast<const float4*>(wbuf)}, tig);
      }
      typename Sums::Item res[Sums::M];
      sums.reduce(sc0, sc1, tig, res);
      rows_out.put(res, m.y, m.z, tig);
    };
    // A tile whose MMA is drained and did not run on the tile's request: padding is
    // released; otherwise switch if needed and redo the MMA.
    auto redo = [&](int s, int4 m) {
      if (m.x >= batch) {
        release_stage(empty0 + 8 * s);
        return;
      }
      if (m.x != q_b) {
        switch_to(m.x);
        db = q_desc();
        rows_out.point(out, out_stride, q_b, tig);
      }
      unsigned again[ACC_WORDS];
      mma(again, a_lo0 + s * (L::kVals >> 4));
      epilogue(again, s, m, false);
    };
    // One tile at ring position c (see the loop below).
    auto one = [&](int c) {
      const int s = c >= STAGES ? c - STAGES : c;
      const unsigned da = a_lo0 + s * (L::kVals >> 4);
      mbar_wait(full0 + 8 * s, c >= STAGES ? 1 : 0);
      // The descriptor's shared load -> broadcast -> compare chain lands between the
      // tile's wgmmas, and the warp's in-order issue holds the rest of the MMA behind it
      // (ncu: 9 % of the stall samples at d64n2, 4.6 % at next_n=3). Loading it before the
      // MMA wins at head_dim <= 64 (d64n2 -2.3 %, d32n2 -4.5 %, A/B on the H200) and is
      // level to -1.2 % in the three-warpgroup configs of next_n 3-4 (A/B; -3.5 / -4.5 % in
      // one process); at next_n <= 2, head_dim 128 (four warpgroups hide the chain) it cost
      // b256n2 1.5-2.4 % (MQA round 22).
      constexpr bool META_FIRST = DIM <= 64 || NEXT_N >= 3;
      int4 m;
      if constexpr (META_FIRST) m = meta[s];
      unsigned acc[ACC_WORDS];
      mma(acc, da);
      if constexpr (!META_FIRST) m = meta[s];
      m.x = __shfl_sync(0xffffffffu, m.x, 0);
      if (m.x != q_b) {  // another request, or padding: drain, switch, redo in this branch
        tma_mma_wait<0, 0, ACC_WORDS>(acc);
        redo(s, m);
        return;
      }
      epilogue(acc, s, m, false);
    };
    // PAIR: two tiles' MMAs in flight (two commit groups); the first one's epilogue runs
    // while the second's MMA does. (c is even and STAGES a multiple of two: stages s and
    // s + 1 of one lap.)
    auto two = [&](int c) {
      const int s = c >= STAGES ? c - STAGES : c;
      const unsigned parity = c >= STAGES ? 1 : 0;
      unsigned acc0[ACC_WORDS], acc1[ACC_WORDS];
      mbar_wait(full0 + 8 * s, parity);
      mma(acc0, a_lo0 + s * (L::kVals >> 4));
      mbar_wait(full0 + 8 * (s + 1), parity);
      mma(acc1, a_lo0 + (s + 1) * (L::kVals >> 4));
      int4 m0 = meta[s], m1 = meta[s + 1];
      m0.x = __shfl_sync(0xffffffffu, m0.x, 0);
      m1.x = __shfl_sync(0xffffffffu, m1.x, 0);
      if (m0.x != q_b || m1.x != q_b) {  // drain both, then each on its own
        const int issued = q_b;
        tma_mma_wait<0, 0, ACC_WORDS>(acc0);
        tma_mma_wait<0, 0, ACC_WORDS>(acc1);
        if (m0.x == issued) epilogue(acc0, s, m0, false);
        else redo(s, m0);
        if (m1.x == issued && q_b == issued) epilogue(acc1, s + 1, m1, false);
        else redo(s + 1, m1);
        return;
      }
      epilogue(acc0, s, m0, true);
      epilogue(acc1, s + 1, m1, false);
    };
    // Steps of T tiles, counted down; with pairs the last step may hold one tile. The ring
    // position c counts tiles modulo two laps (stage c % STAGES, parity c / STAGES): one
    // register for both.
    int c = T * wgu;
    const int steps = (lenu - T * wgu + T * WGS - 1) / (T * WGS);
    const bool tail = PAIR && steps > 0 && (lenu - T * wgu - 1) % (T * WGS) == 0;
    for (int left = steps - tail; left > 0; --left, c = c + T * WGS >= 2 * STAGES ? c + T * WGS - 2 * STAGES : c + T * WGS) {
      if constexpr (PAIR) two(c);
      else one(c);
    }
    if (tail) one(c);
  };

  if constexpr (LEAN) {
    lean_loop();
  } else {
    for (int i = wg; i < len; i += WGS) {
      const int4 m = arrive(i);
      if (m.x >= batch) continue;
      if (m.x != q_b) switch_to(m.x);
      unsigned acc[ACC_WORDS];
      issue_mma(i % STAGES, acc);
      finish(i % STAGES, m, acc);
    }
  }
  cp_async_wait_all();  // no cp.async may outlive the block
}

}  // namespace fij_mqa
