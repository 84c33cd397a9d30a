// Fused MLA K/V pack with a saturating e4m3 cast (the "specialized" backend).
//
//   kv_nope [T, H, NOPE + V] bf16  ->  key   [T, H, NOPE + ROPE] e4m3 = [k_nope | k_pe]
//   k_pe    [T, ROPE]        bf16      value [T, H, V]           e4m3
//
// With NOPE = V = 128 and ROPE = 64 one head's kv_nope row is 512 bytes: exactly one
// 16-byte load per lane of a warp. Lanes 0-15 hold k_nope, lanes 16-31 hold v, and
// lanes 0-7 also hold the token's k_pe, converted once and stored for every head.
// A warp owns one token and a run of `heads_per_warp` heads (the host picks it so
// that small batches still fill the GPU); UNROLL rows are loaded before any is
// stored so several loads are in flight per lane. NUM_HEADS > 0 fixes the head
// count at compile time (the serving configuration of 12 local heads); 0 reads it
// from `num_heads`.
#pragma once
#include "common.cuh"

namespace fij_mla {

constexpr int kNope = 128, kRope = 64, kV = 128;
constexpr int kKeyRow = kNope + kRope;  // bytes of one e4m3 key row
constexpr int kWarpsPerBlock = 8;

template <int NUM_HEADS, int UNROLL>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
concat_mla_kv_quant_fp8(const fij::bf16_t* __restrict__ kv_nope, const fij::bf16_t* __restrict__ k_pe,
                        unsigned char* __restrict__ key, unsigned char* __restrict__ value,
                        int num_tokens, int num_heads, int heads_per_warp, long long pe_row_stride) {
  const int lane = threadIdx.x & 31;
  const long long token = (long long)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
  if (token >= num_tokens) return;
  const int heads = NUM_HEADS > 0 ? NUM_HEADS : num_heads;
  const int first = blockIdx.y * heads_per_warp;
  const int last = min(first + heads_per_warp, heads);

  const long long row0 = token * heads;
  const fij::bf16_t* src = kv_nope + row0 * (kNope + kV) + lane * 8;
  uint2 pe = make_uint2(0, 0);
  bool pe_loaded = false;
  for (int h = first; h < last; h += UNROLL) {
    uint4 in[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      if (h + u < last) in[u] = fij::load_stream_16(src + (long long)(h + u) * (kNope + kV));
    // k_pe is loaded after the first rows, not before: converting it waits for its load,
    // and a load ahead of the rows would put two memory round trips in series (what a
    // decode-sized call, one pass per warp, pays in full).
    if (!pe_loaded) {
      if (lane < kRope / 8) pe = fij::bf16x8_to_e4m3x8(fij::load_stream_16(k_pe + token * pe_row_stride + lane * 8));
      pe_loaded = true;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (h + u >= last) break;
      const uint2 out = fij::bf16x8_to_e4m3x8(in[u]);
      const long long row = row0 + h + u;
      if (lane < kNope / 8) {
        *reinterpret_cast<uint2*>(key + row * kKeyRow + lane * 8) = out;
        if (lane < kRope / 8) *reinterpret_cast<uint2*>(key + row * kKeyRow + kNope + lane * 8) = pe;
      } else {
        *reinterpret_cast<uint2*>(value + row * kV + (lane - kNope / 8) * 8) = out;
      }
    }
  }
}

}  // namespace fij_mla
