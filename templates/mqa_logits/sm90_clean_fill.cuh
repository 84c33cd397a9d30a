// DeepGEMM's clean_logits for flashinfer_jit.deep_gemm: -inf at every position of an
// output row past the positions it sees, up to `cols` (max_context_len). Row
// r = b * next_n + t sees positions < lens[b, t] (2-D lengths) or <= lens[b] - next_n + t
// (1-D). Only the positions to clean are written: one block per row, its threads
// striding the row's tail (coalesced stores), so the pass costs the bytes it writes.
#pragma once
#include "mqa_logits/util.cuh"

namespace fij_mqa {

template <typename OutT>
__global__ void __launch_bounds__(256) clean_logits(const int* __restrict__ lens, long long lens_b, long long lens_t,
                                                    int two_d, int next_n, OutT* __restrict__ out,
                                                    long long out_stride, int cols) {
  const int row = blockIdx.x;
  const int b = row / next_n, t = row - b * next_n;
  const int visible = two_d ? lens[b * lens_b + t * lens_t] : lens[b * lens_b] - next_n + 1 + t;
  OutT* dst = out + (long long)row * out_stride;
  for (int pos = max(visible, 0) + (int)threadIdx.x; pos < cols; pos += 256) {
    if constexpr (sizeof(OutT) == 2) {
      // -inf: 0xff80 in bfloat16, 0xfc00 in float16
      reinterpret_cast<unsigned short*>(dst)[pos] = same_type<OutT, fij::bf16_t>::value ? 0xff80u : 0xfc00u;
    } else {
      reinterpret_cast<unsigned*>(dst)[pos] = 0xff800000u;  // float32 -inf
    }
  }
}

}  // namespace fij_mqa
