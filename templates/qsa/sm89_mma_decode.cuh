// QSA fp8 sparse paged decode: attention of a row's query heads over the KV tokens the
// slot pass resolved, gathered from an e4m3 paged cache (see qsa/sm89_slot_pass.cuh).
//
// One CTA per (row, kv head, split); a CTA's 16-token chunks are dealt round-robin to its
// warps. Each warp runs its own copy pipeline (NUM_STAGES chunks in flight, no block-wide
// barrier in the loop) and its own online softmax; the warps' (max, sum, acc) are merged
// through shared memory at the end. Split-K (small batches, qsa_decode_cluster): chunk c
// of a (row, kv head) belongs to split c % CLUSTER, the splits form one thread block
// cluster and merge through distributed shared memory, optionally resolving their own
// slots (SLOT_CAP > 0) so a call is one launch with no workspace.
// Tensor cores, m16n8k16 (rows = the group's query heads, zero-padded to 16):
//   S = Q K^T and P V in fp16 (e4m3 -> fp16 is exact; q is scaled per head so bf16 -> fp16
//   is exact too, see the Q fragment comment). P is rounded to fp16 (2^-11 relative): about
//   2e-4 of norm-wise error, a tenth of what the bf16 output rounding itself costs.
// The fragments are arranged so every thread gathers whole 16-byte (D=64: 8-byte) pieces
// of token rows and never needs a byte-wise shared-memory access:
//   * QK: the dot product's dim order is free, so quad lane t of the B fragment for token
//     n takes bytes [64G + 16t, +16) of K row n; k-step (G, u) uses its word u: bytes
//     0,1 are logical k = 2t, 2t+1 and bytes 2,3 are k = 2t+8, 2t+9. Q's A fragment is
//     loaded with the same permutation. K is copied by whole rows (see issue()) into a
//     swizzled [16 tokens][D] stage, so every copy instruction reads whole 128-byte lines.
//   * PV: lane (g, t) gathers D/8 bytes of V, [S g, +S) + 128 p (S = min(D/8, 16)), of
//     tokens 2t, 2t+1, 2t+8, 2t+9 (the tokens its score fragment covers) and transposes
//     4x4 byte blocks with prmt, so n8 tile i, column g is dim vdim(g, i) ((D/8)g + i for
//     D <= 128). Thread (g, t) then accumulates dims vdim(2t, i), vdim(2t+1, i) of heads
//     g and g+8.
// Byte offsets into the cache are 64-bit (a layer's pool can pass 2**31 bytes); the cache
// strides themselves are 32-bit (the host checks), which keeps a token's address at two
// 32x32->64 multiply-adds.
// BULK (D = 128, V right after K in memory): each token's K and V rows arrive by one
// 256-byte cp.async.bulk copy instead of the cp.async gathers (qsa/bulk.cuh).
// Every kernel waits for the preceding grid before its first global access and then lets
// its dependents launch (programmatic dependent launch; no-ops for ordinary launches).
#pragma once
#include "qsa/body.cuh"

namespace fij_qsa {

// The large-batch kernel: one CTA per (row, kv head), slots and row order from the slot pass.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, bool BULK>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) qsa_decode(FIJ_QSA_DECODE_PARAMS) {
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, 0, 0, BULK, false, false>(FIJ_QSA_DECODE_ARGS);
}

// The same in the shipped loop form (see decode_body): TMMA (GROUP <= 8), tokens as the
// MMAs' rows; LEAN, the loop's invariants kept in registers.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, bool BULK, bool TMMA, bool LEAN>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) qsa_decode_form(FIJ_QSA_DECODE_PARAMS) {
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, 0, 0, BULK, TMMA, LEAN>(FIJ_QSA_DECODE_ARGS);
}

// The single pass with few warps a row (opt-in, not dispatched: qsa/short.py). A CTA of 1-2
// warps per (row, kv head), so 7-16 rows share an SM where the shipped 4 warps fit 4; ORDER
// false takes the rows in index order (no order lookup; the slot pass sorts nothing).
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, bool BULK, bool TMMA, bool ORDER>
__global__ void __launch_bounds__(NUM_WARPS * 32, MIN_CTAS) qsa_decode_short(FIJ_QSA_DECODE_PARAMS) {
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, 0, 0, BULK, TMMA, true, false, ORDER>(
      FIJ_QSA_DECODE_ARGS);
}

// The small-batch kernel: CLUSTER splits per (row, kv head) in one thread block cluster
// (grid.y = CLUSTER), merged through distributed shared memory; SLOT_CAP > 0 also resolves
// the slots in the kernel, so a call is this one launch.
// PAIR: its warps step two chunks at a time (one-wave grids: few chunks a warp).
// ORDER (after the slot pass): the clusters take the rows longest first, as the single pass.
template <int GROUP, int HEAD_DIM, int NUM_WARPS, int NUM_STAGES, int MIN_CTAS, int CLUSTER, int SLOT_CAP, bool BULK,
          bool PAIR, bool ORDER>
__global__ void __cluster_dims__(1, CLUSTER, 1) __launch_bounds__(NUM_WARPS * 32, MIN_CTAS)
    qsa_decode_cluster(FIJ_QSA_DECODE_PARAMS) {
  static_assert(CLUSTER >= 2 && CLUSTER <= 8, "portable cluster sizes");
  decode_body<GROUP, HEAD_DIM, NUM_WARPS, NUM_STAGES, MIN_CTAS, CLUSTER, SLOT_CAP, BULK, false, false, PAIR, ORDER>(
      FIJ_QSA_DECODE_ARGS);
}

#undef FIJ_QSA_DECODE_ARGS
#undef FIJ_QSA_DECODE_PARAMS

}  // namespace fij_qsa
