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
# Rows outside the table, timed only when --rows names them: next_n=2 H=64 calls from
# 16 to 256 requests of 16K-128K tokens, where session 25 timed paired tiles (2 x 16 at 232
# registers) beside the 4 x 8 at 112 they replaced (SWEEPS below).
PAIR_ROWS = [
    Row(f"b{b}L{length // 1024}kn2", b, 2, 64, length)
    for b, length in ((16, 131072), (32, 131072), (32, 65536), (64, 32768), (128, 32768),
                      (128, 16384), (256, 16384), (32, 32768))
]  # fmt: skip
# Session 26: the KV stream's L2 policy (evict-first / normal, both forced, beside the
# dispatcher's) over batches and lengths the table does not hold, for tma.kv_evict_first's rule
# ("p-" rows: --rows p-..., --sweep).
POLICY_ROWS = [
    Row(f"p-b{b}n{n}h{h}d{d}L{length // 1024}k", b, n, h, length, dim=d)
    for b, n, h, d, length in (
        (64, 1, 64, 128, 8192), (64, 1, 64, 128, 32768), (128, 1, 64, 128, 8192),
        (128, 1, 64, 128, 65536), (32, 1, 64, 128, 65536), (16, 1, 64, 128, 131072),
        (64, 1, 32, 128, 65536), (64, 1, 64, 64, 32768), (128, 1, 64, 32, 16384),
        (128, 2, 32, 128, 16384), (64, 2, 32, 128, 65536), (64, 2, 64, 64, 32768),
        (64, 2, 64, 128, 32768), (256, 2, 64, 64, 16384), (64, 4, 32, 128, 16384),
        (64, 3, 64, 128, 16384),
    )
]  # fmt: skip
EXTRA_ROWS = PAIR_ROWS + POLICY_ROWS
# --sweep: per row, ("name", MqaLogitsOptions) pairs: a forced TMA config (TmaConfig's
# fields; in names "AxB": warpgroups x stages, "-pair": paired tiles, "rN": N registers a
# consumer thread) or other options (say l2_promotion=256). Every TMA row also times the
# dispatcher's config with the other consumer loop: "lean" where the dispatcher takes the
# plain one, "plain" (unpaired) where it takes the lean one.
T = TmaConfig
EVICT = ("evict", MqaLogitsOptions(kv_evict_first=True))  # the dispatcher's config, KV evict-first
NO_EVICT = ("no-evict", MqaLogitsOptions(kv_evict_first=False))
NO_PDL = ("no-pdl", MqaLogitsOptions(pdl=False))


# Paired tiles at next_n=2 (n = 128): two warpgroups at 232 registers hold two accumulator
# sets each (the four producer warps keep 40), so each runs a tile's epilogue under its
# next tile's MMA, with as many tiles in flight as the four unpaired warpgroups. Round 14
# found pairs 6 % faster at n = 64, head_dim 64 (shipped there), before setmaxnreg made room
# for them at n = 128; session 25 shipped 2 x 16 at head_dim 128 (tma.PAIRED_WIDE_CONFIG),
# timed here beside the config it replaced ("4x8-r112"); at head_dim 96 it measured mixed.
def _paired(*stages: int) -> list:
    return [(f"2x{s}-pair-r232", MqaLogitsOptions(config=T(2, s, 4, 2, 1, 1, 232))) for s in stages]


UNPAIRED = ("4x8-r112", MqaLogitsOptions(config=T(4, 8, 4, 2, 1, 0, 112)))


# Three consumer warpgroups at 160 registers (every weight in registers, room for the lane
# indices) against the dispatcher's four at 112, at next_n=2 head_dim 64 and 32: session 21's
# ncu had d64n2 issue-bound on per-tile integer work under the 112-register cap (run 14:
# d64n2 55.3 against 53.6). And the paired configs above.
WIDE = {
    "d64n2": [("3x24-r160", MqaLogitsOptions(config=T(3, 24, 4, 2, 1, 0, 160))), *_paired(16, 24)],
    "d32n2": [("3x36-r160", MqaLogitsOptions(config=T(3, 36, 4, 2, 1, 0, 160))), *_paired(32, 40)],
    **{name: [UNPAIRED] for name in ("b256n2", "b64L64kn2", "skew128n2")},
    "d96n2": _paired(16),
    # next_n=4 H=32 is n = 128 too: the same two accumulator sets fit (168 registers, no
    # spills, sm_90a); the dispatcher's three warpgroups at 160 beside them (session 27)
    "b128n4h32": _paired(8, 16),
    **{row.name: [UNPAIRED] for row in PAIR_ROWS},
}
SWEEPS: dict[str, list] = {
    # The KV stream's L2 policy against the dispatcher's (tma.kv_evict_first: evict-first for
    # small calls, every next_n=1 call and next_n=2-3 calls at head_dim >= 96): every
    # row but the skewed B=32 one times the other policy. (The ring depths, warpgroups and Q
    # buffers: rounds 10-16 of docs/perf-log/mqa_logits.md; deeper rings at the skewed row
    # and one Q buffer with 12-16 stages at next_n=2, both slower: round 19.)
    # "no-pdl": an ordinary launch, as DeepGEMM's (its runtime leaves PDL off): whether the
    # programmatic launch's early CTAs help or hold the rows a fixed chain dominates.
    "skew32": [("small", MqaLogitsOptions(config=T(2, 6, 2, 2, 1))), EVICT,
               ("small-evict", MqaLogitsOptions(config=T(2, 6, 2, 2, 1), kv_evict_first=True)), NO_PDL],
    "b32": [NO_EVICT, NO_PDL],
    "b1": [NO_PDL],
    **{row.name: [NO_EVICT if kv_evict_first(0, (row.next_n, row.heads, row.dim)) else EVICT,
                  *WIDE.get(row.name, ())]
       for row in ROWS if row.batch >= 64},
    **{row.name: WIDE[row.name] for row in PAIR_ROWS},
    **{row.name: [EVICT, NO_EVICT] for row in POLICY_ROWS},
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
# Session 24 (docs/perf-log/mqa_logits.md round 24) timed "butterfly" (DeepGEMM's quad sum:
# full butterflies, every lane storing every item): 4-19 % slower at next_n 2-4; "sat" (the
# ReLU as FMUL.SAT on the FMA pipe instead of FMNMX on the ALU pipe, bitwise the same
# logits): level in 4 alternating rounds; "pf1" (a B=1 call's first reads prefetched into
# L2 before griddepcontrol.wait): level; "b1" (a B=1 call's run without the warp's scan
# and search): 8-15 % faster at B=1, since shipped (util.cuh, cta_tiles).
# Session 27 timed "lap" (round 27): the unpaired lean loop unrolled over a lap of the ring
# (stage s = wg + WGS k: per-stage addresses as immediates, descriptors in uniform
# registers, ~10 instructions a tile fewer at d32): level to 2 % slower (d32 31.7 / 31.0);
# spilled 8-72 bytes in the 112-register configs.
VARIANTS: dict[str, tuple[tuple[str, ...], ...]] = {}
# --ab: options timed beside the dispatcher's on every row named (a runtime switch of the
# shipped kernels, no other build): session 28, the block table prefetched into L2 beside
# the lengths' read (tma.TABLE_PREFETCH) against without.
AB: list[tuple[str, MqaLogitsOptions]] = [("no-tpf", MqaLogitsOptions(table_prefetch=False))]
VARIANT_ROWS = tuple(row.name for row in ROWS if row.head_dim_fits_tma())
# Rows whose variants are also timed in a forced config (column "<variant>-<config>"); round
# 16 timed the weights' variants at d64n2 / d32n2 in their one-Q-buffer configs this way.
VARIANT_CONFIGS: dict[str, TmaConfig] = {}
