// Device helpers of the paged MQA logits kernels: PTX conversions and half2 math,
// block-wide scans, and the work split (the "schedule") shared by the schedule
// kernel and the logits kernel's own prologue, so both derive identical splits.
#pragma once
#include "common.cuh"

namespace fij_mqa {

constexpr int kTile = 64;  // KV tokens per warpgroup tile (the wgmma M); the schedule unit

// Registers per thread for a block of `threads`. Each of the SM's 4 sub-partitions has
// its own 16K-register file and a block's warps are dealt to them round-robin, so the
// fullest sub-partition holds ceil(warps / 4) warps: 9 warps (2 consumer warpgroups + a
// producer warp) get 168, not 65536 / 288 = 224 (which fails with LAUNCH_OUT_OF_RESOURCES).
// Mirrored by reg_cap in flashinfer_jit/mqa_logits/checks.py.
__host__ __device__ constexpr int reg_cap(int threads) {
  return 65536 / (((threads + 127) / 128) * 128) / 8 * 8 > 255 ? 255
                                                                 : 65536 / (((threads + 127) / 128) * 128) / 8 * 8;
}

template <typename A, typename B>
struct same_type { static constexpr bool value = false; };
template <typename A>
struct same_type<A, A> { static constexpr bool value = true; };
template <bool C, typename A, typename B>
struct conditional { using type = A; };
template <typename A, typename B>
struct conditional<false, A, B> { using type = B; };

// -- conversions and half2 arithmetic (raw PTX: no cuda_fp16.h) -------------------------
__device__ __forceinline__ unsigned smem_u32(const void* ptr) {
  unsigned addr;
  asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(addr) : "l"(ptr));
  return addr;
}
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ unsigned short f2h(float x) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
// float32 -> bfloat16 bits, round to nearest even (the bfloat16 logits of the DeepGEMM surface).
__device__ __forceinline__ unsigned short f2bf(float x) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float h2f(unsigned short h) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return r;
}
__device__ __forceinline__ float h2_lo(unsigned v) { return h2f((unsigned short)(v & 0xffffu)); }
__device__ __forceinline__ float h2_hi(unsigned v) { return h2f((unsigned short)(v >> 16)); }
__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ unsigned hrelu2(unsigned a) {
  unsigned r;
  asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(0u));
  return r;
}
// The two halves of a half2 added in f16 (one rounding), returned in the low 16 bits.
__device__ __forceinline__ unsigned short hsum2(unsigned a) {
  unsigned short r;
  asm("{.reg .b16 l, h; mov.b32 {l, h}, %1; add.rn.f16 %0, l, h;}" : "=h"(r) : "r"(a));
  return r;
}
__device__ __forceinline__ unsigned short hadd(unsigned short a, unsigned short b) {
  unsigned short r;
  asm("add.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(a), "h"(b));
  return r;
}
__device__ __forceinline__ unsigned short hmul(unsigned short a, unsigned short b) {
  unsigned short r;
  asm("mul.rn.f16 %0, %1, %2;" : "=h"(r) : "h"(a), "h"(b));
  return r;
}
// Two e4m3 codes (bits 0-7, 8-15) to a half2 (low, high); exact.
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned short v) {
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(v));
  return r;
}

__device__ __forceinline__ uint2 load_stream_8(const void* ptr) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(ptr));
  return v;
}
__device__ __forceinline__ float load_stream_f32(const void* ptr) {
  float v;
  asm volatile("ld.global.nc.L1::no_allocate.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
  return v;
}

// -- the work split -------------------------------------------------------------------
// Work is the list of 64-token tiles of every request in order (request-major). CTA c of
// C gets linear tiles [c*T/C, (c+1)*T/C); the schedule stores where that range starts
// as (request, tile), with entry C = (batch, 0).
__device__ __forceinline__ int tiles_of(int seq_len) { return seq_len > 0 ? (seq_len + kTile - 1) / kTile : 0; }

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Exclusive prefix of `v` over the block (THREADS threads) and the block total.
template <int THREADS>
__device__ __forceinline__ int block_exclusive_scan(int v, int* red, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int inc = fij::warp_inclusive_scan(v);
  if (lane == 31) red[warp] = inc;
  __syncthreads();
  int before = 0, all = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) {
    const int x = red[w];
    before += w < warp ? x : 0;
    all += x;
  }
  __syncthreads();
  total = all;
  return before + inc - v;
}

template <int THREADS>
__device__ int total_tiles(const int* seq_lens, long long stride, int batch, int* red) {
  int total = 0;
  for (int base = 0; base < batch; base += THREADS) {
    const int b = base + (int)threadIdx.x;
    int chunk;
    block_exclusive_scan<THREADS>(b < batch ? tiles_of(seq_lens[b * stride]) : 0, red, chunk);
    total += chunk;
  }
  return total;
}

// (request, tile) of linear tile x into where[0..1]; (batch, 0) when x is past the end.
template <int THREADS>
__device__ void locate_tile(const int* seq_lens, long long stride, int batch, int x, int* red, int* where) {
  if (threadIdx.x == 0) { where[0] = batch; where[1] = 0; }
  int carry = 0;
  for (int base = 0; base < batch; base += THREADS) {
    const int b = base + (int)threadIdx.x;
    const int n = b < batch ? tiles_of(seq_lens[b * stride]) : 0;
    int chunk;
    const int start = carry + block_exclusive_scan<THREADS>(n, red, chunk);
    if (n > 0 && start <= x && x < start + n) { where[0] = b; where[1] = x - start; }
    carry += chunk;
  }
  __syncthreads();
}

// floor(c * total / ctas) in 32-bit operations, exact for every int total (c * (total %
// ctas) < ctas^2 fits): a 64-bit division is a ~130-instruction subroutine on every CTA's
// way to its first copy.
__device__ __forceinline__ int split_point(int c, int ctas, int total) {
  const unsigned q = (unsigned)total / (unsigned)ctas, r = (unsigned)total - q * (unsigned)ctas;
  return (int)((unsigned)c * q + (unsigned)c * r / (unsigned)ctas);
}

// The block table's first `cols` entries of every request into L2 (the TMA kernel's
// producer warp 0, cols > 0), beside warp 0's read of seq_lens: a CTA's first copies wait
// for their tiles' table entries, read right after that read, and a call after other
// kernels (a serving step's layers) finds the table in HBM, a second round trip before the
// first KV copy. Each 128-byte line holding an entry is one item; the grid's CTAs and the
// lanes take them in turn, at most kTablePrefetchPerLane a lane (4.3 MB of table at 132
// CTAs). Only lines holding an entry are touched: no address past the table.
constexpr int kTablePrefetchPerLane = 8;

__device__ __forceinline__ void prefetch_table(const int* block_tables, long long bt_stride, int batch, int cols,
                                               int lane) {
  const unsigned lines = ((unsigned)cols * 4u + 123u) / 128u + 1u;  // a row's lines, at any 4-byte start
  const unsigned long long items = (unsigned long long)batch * lines;
#pragma unroll 1
  for (int i = 0; i < kTablePrefetchPerLane; ++i) {
    const unsigned j = blockIdx.x + gridDim.x * (unsigned)(lane + 32 * i);
    if (j >= items) break;
    const unsigned row = j / lines, k = j - row * lines;
    const unsigned long long start = reinterpret_cast<unsigned long long>(block_tables + row * bt_stride);
    const unsigned long long line = k == 0 ? start : (start & ~127ull) + 128ull * k;
    if (line < start + 4ull * (unsigned)cols) asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
}

// This CTA's run of tiles into sched[0..2] = (request, tile, count): from the caller's
// schedule or derived here from seq_lens (the same split as paged_mqa_schedule). The
// caller synchronizes the block before reading sched. Without a schedule, up to
// kOnePassPerThread * THREADS requests take one pass (below); more take two chunked ones.
constexpr int kOnePassPerThread = 8;

// One pass over the requests by threads [0, SCANNERS) (the block, warp 0 alone with
// SCANNERS 32, or thread 0 alone with SCANNERS 1 and at most kOnePassPerThread requests):
// each takes k consecutive requests, all k loads in flight at once, and one scan of their
// sums gives the total and each request's first tile. The loads sit on every CTA's critical
// path: one round trip, where the chunked passes took two per THREADS requests (B=1024:
// ~3 us of a 72 us call).
template <int SCANNERS, int THREADS>
__device__ __forceinline__ void one_pass_tiles(const int* __restrict__ seq_lens, long long sl_stride, int batch,
                                               int* red, int* sched) {
  const int k = (batch + SCANNERS - 1) / SCANNERS, b0 = (int)threadIdx.x * k;
  // Every load first, at an index clamped into the batch (a lane past it rereads the last
  // length, a hit; batch >= 1: an empty call never launches), then the tests: under the
  // tests the compiler put each load in its own branch and consumed it there, so a lane's
  // loads went out one after another. B=256 59.7-59.8 -> 58.9-59.2 us, head_dim 32
  // 31.5-31.6 -> 30.8-30.9, B=32 12.1-12.4 -> 12.1; level elsewhere (H200, MQA round 29).
  int n[kOnePassPerThread], sum = 0;
#pragma unroll
  for (int i = 0; i < kOnePassPerThread; ++i) n[i] = __ldg(seq_lens + (long long)min(b0 + i, batch - 1) * sl_stride);
#pragma unroll
  for (int i = 0; i < kOnePassPerThread; ++i) {
    n[i] = i < k && b0 + i < batch ? tiles_of(n[i]) : 0;
    sum += n[i];
  }
  if (threadIdx.x == 0) { sched[0] = batch; sched[1] = 0; }  // past the end, unless found
  int total, start;
  if constexpr (SCANNERS == 1) {
    total = sum;  // one thread: its own requests are all of them
    start = 0;
  } else if constexpr (SCANNERS == 32) {
    const int inc = fij::warp_inclusive_scan(sum);
    total = __shfl_sync(0xffffffffu, inc, 31);
    start = inc - sum;
    __syncwarp();  // lane 0's defaults before any lane's find
  } else {
    start = block_exclusive_scan<THREADS>(sum, red, total);  // (synchronizes the block)
  }
  const int x0 = split_point(blockIdx.x, gridDim.x, total), x1 = split_point(blockIdx.x + 1, gridDim.x, total);
#pragma unroll
  for (int i = 0; i < kOnePassPerThread; ++i) {
    if (n[i] > 0 && start <= x0 && x0 < start + n[i]) { sched[0] = b0 + i; sched[1] = x0 - start; }
    start += n[i];
  }
  if (threadIdx.x == 0) sched[2] = x1 - x0;
}

template <int THREADS, bool WARP = true>
__device__ __forceinline__ void cta_tiles(const int* __restrict__ schedule, const int* __restrict__ seq_lens,
                                          long long sl_stride, int batch, int* red, int* sched) {
  const int lane = threadIdx.x & 31;
  if (WARP && schedule == nullptr && batch == 1) {
    // One request: its tiles are the run, so no scan and no search, one thread. The warp's
    // scan and search held every CTA's first copy: B=1 L=8K 3.2-3.3 -> 2.8-3.0 us (H200,
    // MQA round 24, variant "b1"), below a given schedule's 2.9-3.1. (Not in the setmaxnreg
    // kernels, WARP false: the branch's code spilled 16 bytes at next_n=3.)
    if (threadIdx.x == 0) one_pass_tiles<1, THREADS>(seq_lens, sl_stride, batch, red, sched);
  } else if (WARP && schedule == nullptr && batch <= 32 * kOnePassPerThread) {
    // Up to 256 requests: warp 0 alone. The block-wide scan's two barriers held every CTA's
    // first copy: B=1 L=8K 3.74 -> 3.53 us, B=32 11.71 -> 11.46, the skewed B=32 row 11.62
    // -> 11.25 (a given schedule: 3.23, 11.18, 11.21; H200, MQA round 19, variant
    // "warpsched").
    if (threadIdx.x < 32) one_pass_tiles<32, THREADS>(seq_lens, sl_stride, batch, red, sched);
  } else if (schedule == nullptr && batch <= kOnePassPerThread * THREADS) {
    one_pass_tiles<THREADS, THREADS>(seq_lens, sl_stride, batch, red, sched);
  } else if (schedule == nullptr) {
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
}

// One CTA per schedule entry: grid = num_sms + 1.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) paged_mqa_schedule(const int* __restrict__ seq_lens, long long stride,
                                                              int batch, int* __restrict__ schedule) {
  __shared__ int red[THREADS / 32];
  __shared__ int where[2];
  const int ctas = (int)gridDim.x - 1;
  const int total = total_tiles<THREADS>(seq_lens, stride, batch, red);
  locate_tile<THREADS>(seq_lens, stride, batch, split_point(blockIdx.x, ctas, total), red, where);
  if (threadIdx.x == 0) {
    schedule[2 * blockIdx.x] = where[0];
    schedule[2 * blockIdx.x + 1] = where[1];
  }
}

}  // namespace fij_mqa
