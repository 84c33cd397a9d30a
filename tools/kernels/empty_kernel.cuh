// An empty kernel (tools/engine_rows.py's launch-floor rows): one or two bound launches of it
// are what a cached call's driver launches cost the host, the floor under issue 21's hot-cost
// rows of ops that launch one or two kernels. Benchmark only, never shipped.
#pragma once

namespace fij_tools {

template <int WAITS>
__global__ void empty_kernel(const int* __restrict__ unused) {
  if constexpr (WAITS != 0) asm volatile("griddepcontrol.wait;" ::: "memory");  // as the ops' kernels
  (void)unused;
}

}  // namespace fij_tools
