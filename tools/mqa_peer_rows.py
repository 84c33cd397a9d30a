"""The rows tools/bench_mqa_peer.py times (the issue's shapes and ours beside them), the
forced TMA configs of --sweep and the template variants of --variants."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit.mqa_logits import MqaLogitsOptions  # noqa: E402
from flashinfer_jit.mqa_logits.tma import TMA_DIMS, TmaConfig, kv_evict_first  # noqa: E402


class Row(NamedTuple):
    name: str
    batch: int
    next_n: int
    heads: int
    length: int
    dim: int = 128
    block: int = 64
    long: int = 0  # one request of this length among the others (a skewed batch)

    def head_dim_fits_tma(self) -> bool:
        return self.dim in TMA_DIMS


ROWS = [
    Row("b1", 1, 1, 64, 8192),
    Row("b32", 32, 1, 64, 8192),
    Row("b256", 256, 1, 64, 8192),
    Row("b256n2", 256, 2, 64, 8192),
    Row("b64L64k", 64, 1, 64, 65536),
    Row("b64L64kn2", 64, 2, 64, 65536),
    Row("b256h32", 256, 1, 32, 8192),
    Row("b256h32n2", 256, 2, 32, 8192),
    Row("b128n4h32", 128, 4, 32, 16384),
    Row("b128n3", 128, 3, 64, 16384),
    Row("d64", 256, 1, 64, 8192, dim=64),
    Row("d64n2", 256, 2, 64, 8192, dim=64),
    Row("d32", 256, 1, 64, 8192, dim=32),
    Row("d32n2", 256, 2, 64, 8192, dim=32),
    Row("d256", 128, 1, 64, 8192, dim=256),
    Row("d96", 256, 1, 64, 8192, dim=96),
    Row("d96n2", 256, 2, 64, 8192, dim=96),
    Row("skew32", 32, 1, 64, 4096, long=65536),
    Row("skew128n2", 128, 2, 64, 8192, long=131072),
    Row("b1024", 1024, 1, 64, 2048),
    Row("blk32", 256, 1, 64, 8192, block=32),
    Row("blk128", 256, 1, 64, 8192, block=128),
]
# --sweep: per row, forced TMA configs (warpgroups, stages, producer warps, Q buffers[, lean[,
# pair[, regs]]]; "-pair": paired tiles, "rN": N registers a consumer thread) or ("name", MqaLogitsOptions) for other options (say
# l2_promotion=256). Every TMA row also times the dispatcher's config with the other
# consumer loop: "lean" where the dispatcher takes the plain one, "plain" (unpaired) where
# it takes the lean one.
T = TmaConfig
EVICT = ("evict", MqaLogitsOptions(kv_evict_first=True))  # the dispatcher's config, KV evict-first
NO_EVICT = ("no-evict", MqaLogitsOptions(kv_evict_first=False))
NO_PDL = ("no-pdl", MqaLogitsOptions(pdl=False))
# Three consumer warpgroups at 160 registers (every weight in registers, room for the lane
# indices) against the dispatcher's four at 112, at next_n=2 head_dim 64 and 32: session 21's
# ncu had d64n2 issue-bound on per-tile integer work under the 112-register cap.
WIDE = {
    "d64n2": [("3x24-r160", MqaLogitsOptions(config=T(3, 24, 4, 2, 1, 0, 160)))],
    "d32n2": [("3x36-r160", MqaLogitsOptions(config=T(3, 36, 4, 2, 1, 0, 160)))],
}
SWEEPS: dict[str, list] = {
    # The KV stream's L2 policy against the dispatcher's (tma.kv_evict_first: evict-first for
    # small calls, next_n=1 calls of 256 requests or more and next_n=2-3 calls of 128 or more
    # with a 16 KB Q, from sessions 18-20's sweeps): every
    # row but the skewed B=32 one times the other policy. (The ring depths, warpgroups and Q
    # buffers: rounds 10-16 of docs/perf-log/mqa_logits.md; deeper rings at the skewed row
    # and one Q buffer with 12-16 stages at next_n=2, both slower: round 19.)
    # "no-pdl": an ordinary launch, as DeepGEMM's (its runtime leaves PDL off): whether the
    # programmatic launch's early CTAs help or hold the rows a fixed chain dominates.
    "skew32": [("small", MqaLogitsOptions(config=T(2, 6, 2, 2, 1))), EVICT,
               ("small-evict", MqaLogitsOptions(config=T(2, 6, 2, 2, 1), kv_evict_first=True)), NO_PDL],
    "b32": [NO_EVICT, NO_PDL],
    "b1": [NO_PDL],
    **{row.name: [NO_EVICT if kv_evict_first(0, row.batch, (row.next_n, row.heads, row.dim)) else EVICT,
                  *WIDE.get(row.name, ())]
       for row in ROWS if row.batch >= 64},
}  # fmt: skip


# --variants: candidate template changes (tools/mqa_logits_probe.py variant), each timed in the
# dispatcher's config beside the shipped kernel on the rows named (round 16 timed the
# weights' column groups in registers this way, round 19 the Q prefetch only where a CTA's
# run crosses a request and the schedule derived by warp 0 alone, both since shipped:
# docs/perf-log/mqa_logits.md).
# Session 23 timed the head sum as a second MMA this way (tf32 m64n8k8, A the ReLU'd
# accumulators in registers): level at B=256 next_n=1, 5-17 % slower at the other rows, with
# one accumulator chain or four (docs/perf-log/mqa_logits.md round 23; the probes are
# docs/perf-log/patches/mma-epi*).
# "butterfly" (session 21's ncu at d64n2, not timed yet): DeepGEMM sums the quad with full
# butterflies and every lane stores every item (redundant stores to one address cost one
# transaction), where ours reduce-scatters to store each item once (SHFL -> FADD -> FSEL
# chains; the FADDs after SHFL were one of the short-scoreboard sites that ncu counted, 807
# samples in all against its 186, beside the descriptor chain and the lane indices). The
# sums are bitwise the same ((a + b) + (c + d) either way); float32 logits and epilogue only.
_BUTTERFLY = (
    (
        "    if (q_b >= 0) rows_out.point(out, out_stride, q_b, tig);\n",
        "    if (q_b >= 0) rows_out.point(out, out_stride, q_b, tig);\n"
        "    OutT* vrow = out + (long long)max(q_b, 0) * NEXT_N * out_stride + warp * 16 + g;\n",
    ),
    (
        "        rows_out.point(out, out_stride, q_b, tig);\n",
        "        rows_out.point(out, out_stride, q_b, tig);\n"
        "        vrow = out + (long long)q_b * NEXT_N * out_stride + warp * 16 + g;\n",
    ),
    (
        """      typename Sums::Item res[Sums::M];
      sums.reduce(sc0, sc1, tig, res);
      rows_out.put(res, m.y, m.z, tig);
""",
        """      if constexpr (!Sums::F16EPI && sizeof(OutT) == 4) {
        float v[Sums::V];
#pragma unroll
        for (int i = 0; i < Sums::V; ++i) v[i] = sums.part[i >> 1][i & 1] + sums.part_b[i >> 1][i & 1];
#pragma unroll
        for (int i = 0; i < Sums::V; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], 1);
#pragma unroll
        for (int i = 0; i < Sums::V; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], 2);
        OutT* p = vrow + m.y * kTile;
        const int pos = m.y * kTile + warp * 16 + g;
#pragma unroll
        for (int t = 0; t < NEXT_N; ++t) {
          if (pos < m.z) p[t * out_stride] = v[2 * t] * sc0;
          if (pos + 8 < m.z) p[t * out_stride + 8] = v[2 * t + 1] * sc1;
        }
      } else {
        typename Sums::Item res[Sums::M];
        sums.reduce(sc0, sc1, tig, res);
        rows_out.put(res, m.y, m.z, tig);
      }
""",
    ),
)
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {"butterfly": _BUTTERFLY}
VARIANT_ROWS = (
    "skew32",
    "b32",
    "b1",
    "b256",
    "b256n2",
    "d64n2",
    "d32n2",
    "b128n3",
    "b128n4h32",
    "b64L64kn2",
)
# Rows whose variants are also timed in a forced config (column "<variant>-<config>"); round
# 16 timed the weights' variants at d64n2 / d32n2 in their one-Q-buffer configs this way.
VARIANT_CONFIGS: dict[str, TmaConfig] = {}
