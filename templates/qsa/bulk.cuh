// Bulk copies of the QSA decode (BULK in templates/qsa/body.cuh; D = 128): one
// cp.async.bulk copy of a token's 256 bytes (its K row, then its V row: the combined
// cache), completing on one mbarrier per warp stage, and the bank-conflict-free placement
// of the copied rows in a stage.
#pragma once

namespace fij_qsa {

constexpr int kBulkStageBytes = 4224;  // 16 token rows of 256 bytes placed by bulk_row

__device__ __forceinline__ void mbar_init(unsigned bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Makes barrier initializations and earlier generic shared-memory writes visible to the
// async proxy (the bulk copies) before any copy is issued.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.mbarrier_init.release.cluster;\n\tfence.proxy.async.shared::cta;" ::: "memory");
}
// The barrier's one arrival of a phase, announcing `bytes` of copies that complete it.
__device__ __forceinline__ void mbar_arrive_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits for the phase of parity `parity` to complete. try_wait suspends for a bounded
// time per call, so 2^26 failed tries are seconds: a phase that never completes (a wrong
// byte count) traps, which ends the launch with an error instead of hanging the process.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  for (unsigned tries = 0;; ++tries) {
    unsigned done;
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    if (tries == 1u << 26) __trap();
  }
}
// bytes (a multiple of 16, both addresses 16-byte aligned) global -> this CTA's smem.
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Byte offset of token row r (0..15; [K 128 B | V 128 B]) in a kBulkStageBytes bulk stage
// (D = 128). Bulk copies cannot swizzle inside a row, so rows are placed by their offset
// mod 128 instead: rows 2m, 2m + 1 (one 8-lane phase of the K fragment reads) sit 64 bytes apart,
// and rows 2t + c, t = 0..3 (a phase of the V reads) at four distinct 32-byte offsets.
// Rows of one residue class are packed 256 bytes apart, classes 1056 bytes apart.
__device__ __forceinline__ int bulk_row(int r) {
  const int b = r & 1, cls = (((r >> 1) & 3) + 2 * b) & 3;
  return cls * 1056 + (2 * (r >> 3) + b) * 256;
}

}  // namespace fij_qsa
