// Shared device helpers for flashinfer-jit templates.
//
// Templates include no CUDA toolkit headers: NVRTC then compiles a kernel in well under
// a second and needs no include path on the target machine. Storage types are plain
// bit containers; conversions are the PTX instructions the kernels rely on.
#pragma once

namespace fij {

struct bf16_t { unsigned short bits; };
struct half_t { unsigned short bits; };
struct e4m3_t { unsigned char bits; };

// Saturating e4m3 conversion of two floats (round to nearest even; finite overflow and
// +-inf -> +-448; NaN -> 0x7F). Byte 0 of the result holds `lo`, byte 1 holds `hi`.
__device__ __forceinline__ unsigned short e4m3x2_satfinite(float lo, float hi) {
  unsigned short packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(hi), "f"(lo));
  return packed;
}

// The two bf16 values packed in a 32-bit word, exactly, as floats.
__device__ __forceinline__ float bf16_lo(unsigned int pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float bf16_hi(unsigned int pair) { return __uint_as_float(pair & 0xffff0000u); }

// Eight bf16 values (16 bytes) to eight saturated e4m3 codes (8 bytes), in order.
__device__ __forceinline__ uint2 bf16x8_to_e4m3x8(uint4 v) {
  const unsigned int a = e4m3x2_satfinite(bf16_lo(v.x), bf16_hi(v.x));
  const unsigned int b = e4m3x2_satfinite(bf16_lo(v.y), bf16_hi(v.y));
  const unsigned int c = e4m3x2_satfinite(bf16_lo(v.z), bf16_hi(v.z));
  const unsigned int d = e4m3x2_satfinite(bf16_lo(v.w), bf16_hi(v.w));
  return make_uint2(a | (b << 16), c | (d << 16));
}

// Programmatic dependent launch (sm_90+): wait for the preceding grid's results before the
// first global access, then let the dependent grid launch. Both are no-ops for an ordinary
// launch (the preceding grid has completed by then) and before sm_90.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Inclusive prefix of `v` over the warp (every lane active).
__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// A read-once 16-byte load that skips L1: streaming inputs must not evict reused data.
__device__ __forceinline__ uint4 load_stream_16(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

}  // namespace fij
