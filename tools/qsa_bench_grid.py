"""The QSA dispatch sweep's grid and bookkeeping, importable without a GPU (tests run it).

Issue 22's bar: the dispatcher (``qsa_sparse_paged_attention``) within 3% of the faster of
its own kernels at every point, >= 85% of the byte floor where the floor is >= 50 µs, and
>= 4x the seed's Triton kernel where rows x Hkv <= 128. Per point the sweep times our
kernels as ``run_kernels`` variants (labels below), the dispatcher and the seed's kernel;
this module says which variants a point times, which kernel specializations that compiles
(so the GPU run can build them all at once, in parallel, before timing), a rough wall-time
model (to keep one device call bounded), and turns measurements into JSON rows, the table
and the bar's verdicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from qsa_bench_util import BANDWIDTH, n_sets_for

from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import short as qs
from flashinfer_jit.qsa.plan import Choice, QsaOptions, Variant, launch_choice, short_variant
from jit_kernels import KernelSpec

GATE = qk.DECODE_MIN_PROGRAMS  # rows x Hkv from which the dispatcher takes the single pass
H200_SMS = 132
H200_CAP = (9, 0)
# Our kernels, as columns: k1 the single pass (slot pass + decode: qsa_sparse_paged_decode),
# k2 / k4 a thread block cluster of 2 / 4 CTAs per (row, kv head) under the shipped gather
# rule (kernels.gather_choice), "split" what launch_split (the dispatcher below the gate)
# picks, often the one-wave split. k2 is timed up to 4x the gate, so the sweep shows
# whether the split should reach past it; k4 up to half the gate (more splits only add
# merges once a 2-CTA grid fills the device). "short": the short single pass as the
# dispatcher takes it (plan.short_variant), wherever it serves the point (short.short_choice
# forced on) from sm_90's single-pass crossover on, so the sweep shows where it should start
# (short.SHORT_MIN_PAIRS_PER_SM, provisional) and end (SHORT_MAX_TOPK: topk 4096 timed too).
SPLITS = ("k2", "k4", "split")
# k2o / k4o: those clusters after the slot pass, taking the rows longest first (the single
# pass's order): past one wave of clusters a grid's later clusters then start in decreasing
# length as the first finish (rows' counts vary up to 2x), from ORDERED_MIN_PAIRS pairs.
ORDERED = ("k2o", "k4o")
OURS = ("k1", *SPLITS, *ORDERED, "short")
K2_MAX_PAIRS, K4_MAX_PAIRS = 4 * GATE, GATE // 2
ORDERED_MIN_PAIRS = 256
SHORT_MIN_TIMED = qk.DECODE_MIN_PROGRAMS_SM90  # below it sm_90 splits: no short pass there


@dataclasses.dataclass(frozen=True)
class Point:
    rows: int
    hq: int
    hkv: int
    topk: int
    page: int = 64
    head_dim: int = 128

    @property
    def pairs(self) -> int:
        return self.rows * self.hkv

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def name(self) -> str:
        extra = "" if self.page == 64 else f" p{self.page}"
        extra += "" if self.head_dim == 128 else f" D{self.head_dim}"
        return f"{self.rows}/{self.hq}/{self.hkv}/{self.topk}{extra}"

    def est_floor_us(self) -> float:
        """The floor with valid counts at their mean (3/4 of topk)."""
        kv = self.rows * self.hkv * 0.75 * self.topk * 2 * self.head_dim
        return (kv + 3 * self.rows * self.hq * self.head_dim * 2) / BANDWIDTH


# 256 rows puts Hkv = 8 exactly at the gate (and Hkv = 4 at half of it).
ROWS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096)
TOPKS = (256, 512, 2048, 4096)
# (Hq, Hkv): G = 16 at Hkv 1 / 4 / 8 (the shapes) over the full rows x topk grid;
# G = 4 and 8 (the single pass's TMMA form, Hq 32 and 8) at fewer points. Hq/Hkv 128/1 is
# G = 128: past the kernels' MAX_GROUP (16), the dispatcher refuses it (torch path).
FULL_HEADS = ((16, 1), (64, 4), (128, 8))
SHORT_HEADS, SHORT_ROWS, SHORT_TOPKS = ((32, 8), (8, 1)), (1, 16, 64, 512, 4096), (512, 2048)
# Page sizes and head dims at a few points each (64/4, topk 2048, both sides of the gate).
SIDE_ROWS = (4, 128, 1024)
# BENCHMARKS.md's QSA rows not on the grid, so one run refreshes that table too.
EXTRA = (Point(2048, 32, 4, 1024), Point(256, 32, 8, 4096))
# Around the short single pass's thresholds (1518 / 2046 / 4092 pairs on 132 SMs by topk),
# between the grid's 1024, 2048 and 4096 pairs, at round 10's short and long selections.
SHORT_EDGE_PAIRS = (1536, 2112, 3072)
SHORT_EDGE_HEADS = ((16, 1, 256), (64, 4, 512), (128, 8, 2048))  # (Hq, Hkv, topk)
# Each side of the single pass's gate (512 pairs) at long selections, where a 2-split read
# level with or ahead of it at 512 pairs (session 29): where the crossover and the ordered
# 2-split's zone lie.
GATE_EDGE_PAIRS, GATE_EDGE_TOPKS = (384, 448, 576, 640, 704, 768, 896), (2048, 4096)


def grid() -> list[Point]:
    """Every point of the sweep, in the order it runs."""
    points = [Point(r, hq, hkv, t) for hq, hkv in FULL_HEADS for t in TOPKS for r in ROWS]
    points += [
        Point(r, hq, hkv, t) for hq, hkv in SHORT_HEADS for t in SHORT_TOPKS for r in SHORT_ROWS
    ]
    points += [Point(r, 64, 4, 2048, page=p) for p in (16, 32, 128) for r in SIDE_ROWS]
    points += [Point(r, 64, 4, 2048, head_dim=d) for d in (64, 256) for r in SIDE_ROWS]
    points += [
        Point(n // hkv, hq, hkv, t) for hq, hkv, t in SHORT_EDGE_HEADS for n in SHORT_EDGE_PAIRS
    ]
    points += [p for p in EXTRA if p not in points]
    # last, so a time limit cuts these before the rows (EXTRA) and the seeds of the
    # points before them stay what they were
    return points + [
        Point(n // hkv, hq, hkv, t)
        for hq, hkv in FULL_HEADS for t in GATE_EDGE_TOPKS for n in GATE_EDGE_PAIRS
    ]  # fmt: skip


def select_pairs(points: Sequence[Point], pairs: str | None) -> list[Point]:
    """--pairs ``"LO:HI"``: the points with LO <= rows x Hkv <= HI (either end may be left
    out); all of them without."""
    if not pairs:
        return list(points)
    lo, sep, hi = pairs.partition(":")
    if not sep:
        raise ValueError(f"--pairs wants LO:HI (e.g. 512:4096), got {pairs}")
    low, high = int(lo or 0), int(hi) if hi else None
    return [p for p in points if low <= p.pairs and (high is None or p.pairs <= high)]


def variants_of(point: Point, sms: int, clusters: qk.Clusters) -> dict[str, Variant]:
    """The variants ``point`` times, by column label (``split`` only below the gate)."""
    out = {"k1": Variant()}
    if point.pairs <= K2_MAX_PAIRS:
        out["k2"] = Variant(2)
    if point.pairs <= K4_MAX_PAIRS:
        out["k4"] = Variant(4)
    for label, splits, most in (("k2o", 2, K2_MAX_PAIRS), ("k4o", 4, K4_MAX_PAIRS)):
        if point.topk and ORDERED_MIN_PAIRS <= point.pairs <= most:
            out[label] = Variant(splits, False, order=True)
    if point.pairs < GATE:
        out["split"] = split_variant(point, sms, clusters)
    if point.pairs >= SHORT_MIN_TIMED and point.head_dim in qs.SHORT_HEAD_DIMS and point.topk:
        out["short"] = short_variant(short_call(point, sms))
    return out


def short_call(point: Point, sms: int) -> qs.ShortCall:
    """What the short rule reads of ``point`` on an sm_90 of ``sms`` SMs (the bench's caches
    are the combined layout: bulk copies at D=128)."""
    return qs.ShortCall(H200_CAP, point.head_dim, point.group, point.topk, point.pairs, sms,
                        point.head_dim == 128)  # fmt: skip


def dispatch_variant(point: Point, sms: int, clusters: qk.Clusters) -> Variant:
    """plan.dispatch_split without a device (``sms`` and ``clusters`` given, sm_90's short
    rule; the split gate GATE)."""
    call = short_call(point, sms)
    if qs.takes_short(call):
        return short_variant(call)
    return Variant() if point.pairs >= GATE else split_variant(point, sms, clusters)


def split_variant(point: Point, sms: int, clusters: qk.Clusters) -> Variant:
    """What kernels.launch_split launches for ``point`` (the "split" column)."""
    args = (point.rows, point.hkv, point.topk, point.head_dim, sms, clusters)
    splits, config, pair, _ = qk.launch_split(*args)
    return Variant(splits, None, config, None, pair)


def resolve(point: Point, variant: Variant, sms: int, options: QsaOptions | None = None) -> Choice:
    """What plan.decode_launch launches for ``variant`` at ``point`` (plan.launch_choice,
    the dispatcher's own planner; the bench's caches are the combined layout, so bulk
    copies apply at D=128). Variants with equal choices launch the same kernels the same way."""
    return launch_choice(
        variant, options or QsaOptions(), point.group, point.head_dim, point.topk, point.page,
        point.pairs, sms, point.head_dim == 128,
    )  # fmt: skip


def sweep_specs(points: Iterable[Point], sms: int, clusters: qk.Clusters) -> list[KernelSpec]:
    """Every NVRTC specialization the points' variants and dispatcher launch."""
    options, plans = QsaOptions(), {}
    for point in points:
        variants = [*variants_of(point, sms, clusters).values()]
        for variant in [*variants, dispatch_variant(point, sms, clusters)]:
            for plan in resolve(point, variant, sms, options).plans():
                plans[plan] = None
    return sorted({family.spec(params) for family, params in plans}, key=str)


def triton_specs(points: Iterable[Point]) -> int:
    """Kernels the seed's Triton module compiles: its decode per (TOPK, group, D, page:
    offset bits) and its slot kernel per (TOPK, page; the table width follows both), as
    constexprs."""
    points = list(points)
    decode = {(p.topk, p.group, p.head_dim, p.page) for p in points}
    return len(decode) + len({(p.topk, p.page) for p in points})


def n_sets(point: Point) -> int:
    """Input sets ``point`` cycles (past 4x L2)."""
    return n_sets_for(point.rows, point.hkv, point.topk, point.head_dim)


def reps_for(floor_us: float, sets: int) -> int:
    """Graph replays to time: 30, fewer where one replay is long (about 0.3 s a variant)."""
    return int(min(30, max(10, 0.3e6 / (sets * max(floor_us, 1.0)))))


def pick_label(point: Point, chosen: Variant, sms: int, clusters: qk.Clusters) -> str | None:
    """The first label whose variant launches what ``chosen`` (the dispatcher's) launches."""
    key = resolve(point, chosen, sms)
    variants = variants_of(point, sms, clusters)
    return next((k for k, v in variants.items() if resolve(point, v, sms) == key), None)


def h200_clusters(size: int) -> int:
    """plan.wave_clusters as the H200 answers (the CPU stand-in)."""
    return qk.H200_WAVE_CLUSTERS[size]


def timed_labels(point: Point, sms: int, clusters: qk.Clusters) -> dict[str, str]:
    """Label -> the label whose timing it takes: variants that launch the same kernels
    the same way (``split`` is often k2) are timed once."""
    first: dict[tuple, str] = {}
    out = {}
    for label, variant in variants_of(point, sms, clusters).items():
        out[label] = first.setdefault(resolve(point, variant, sms), label)
    return out


# A rough device-time model (s) for --list and --part: NVRTC ~1 s a kernel over 16 jobs,
# plus the workers' start; Triton ~1.5 s a kernel, one at a time; start-up (imports, the
# 6 GiB pool, warm-up) ~20 s. Our kernels at ~75% of the floor (8 µs at least), the seed's
# at ~60% (25 µs at least); the torch path's check gathers fp32 K/V (~17 bytes an element
# over ~2.5 TB/s, 1 ms a slice of 64K tokens).
STARTUP_S, NVRTC_S, NVRTC_JOBS, NVRTC_START_S, TRITON_S = 20.0, 1.0, 16, 5.0, 1.5


def point_seconds(point: Point) -> float:
    sets, floor = n_sets(point), point.est_floor_us()
    reps = reps_for(floor, sets)
    elements = point.rows * point.topk * point.hkv * point.head_dim
    setup = 0.2 + elements * 2 * 17 / 2.5e12 + point.rows * point.topk / 65536 * 1e-3
    ours = len(set(timed_labels(point, H200_SMS, h200_clusters).values())) + 1  # + dispatcher
    calls = 1 + sets + (reps + 1) * sets  # check, warm-up, replays (capture: host only)
    host = (ours + 1) * (0.03 + (1 + 2 * sets) * 1e-4)
    device = calls * (ours * max(floor / 0.75, 8.0) + max(floor / 0.6, 25.0)) * 1e-6
    return setup + host + device


def wall_seconds(points: Sequence[Point]) -> dict[str, float]:
    """The model's parts and total for one run over ``points``."""
    specs = len(sweep_specs(points, H200_SMS, h200_clusters))
    parts = {
        "startup": STARTUP_S,
        "nvrtc": NVRTC_START_S + NVRTC_S * -(-specs // NVRTC_JOBS),
        "triton": TRITON_S * triton_specs(points),
        "points": sum(point_seconds(p) for p in points),
    }
    return {**parts, "total": sum(parts.values())}


def parse_part(part: str) -> tuple[int, int]:
    index, count = (int(x) for x in part.split("/"))
    if not 1 <= index <= count:
        raise ValueError(f"--part wants i/n with 1 <= i <= n, got {part}")
    return index, count


def select_part(points: Sequence[Point], part: str | None) -> list[Point]:
    """Part i of n (``"i/n"``): the points dealt longest first to the least loaded part
    (the model's seconds), so the parts take about as long; grid order kept."""
    if not part:
        return list(points)
    index, count = parse_part(part)
    loads, owner = [0.0] * count, {}
    for point in sorted(points, key=point_seconds, reverse=True):
        j = loads.index(min(loads))
        owner[point], loads[j] = j, loads[j] + point_seconds(point)
    return [p for p in points if owner[p] == index - 1]


def list_lines(points: Sequence[Point]) -> list[str]:
    """--list: each point with what it times (``split=k2``: timed once, as k2) and the
    dispatcher's pick, then the specializations and the wall-time model."""
    lines = []
    for point in points:
        labels = timed_labels(point, H200_SMS, h200_clusters)
        shown = ",".join(k if k == v else f"{k}={v}" for k, v in labels.items())
        chosen = dispatch_variant(point, H200_SMS, h200_clusters)
        pick = pick_label(point, chosen, H200_SMS, h200_clusters)
        kind = "short" if chosen.short else f"k{chosen.num_splits}"
        lines.append(
            f"{point.name:>22}  pairs {point.pairs:>6}  floor~{point.est_floor_us():8.1f} µs  "
            f"sets {n_sets(point):>2}  times {shown:<24}  dispatcher {pick} ({kind})  "
            f"~{point_seconds(point):.1f} s"
        )
    specs = sweep_specs(points, H200_SMS, h200_clusters)
    by_family: dict[str, int] = {}
    for spec in specs:
        by_family[spec.family] = by_family.get(spec.family, 0) + 1
    wall = wall_seconds(points)
    lines.append(f"{len(points)} points; NVRTC specializations {len(specs)} {by_family}")
    lines.append(f"Triton specializations (seed, if importable) {triton_specs(points)}")
    lines.append("model seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    return lines


def _num(value: object) -> float | None:
    return value if isinstance(value, float) else None


def summarize(point: Point, floor: float, times: dict[str, object], pick: str | None) -> dict:
    """One JSON row: the point, its times (µs, an error string, or None: not timed), the
    dispatcher's pick (the label launching what it launches), the best of ours and the
    bar's ratios and misses."""
    ours = {k: v for k, v in times.items() if k in OURS and isinstance(v, float)}
    best = min(ours, key=ours.get) if ours else None
    disp, triton = _num(times.get("disp")), _num(times.get("triton"))
    row = {
        "name": point.name,
        "point": dataclasses.asdict(point),
        "pairs": point.pairs,
        "floor_us": floor,
        "times_us": times,
        "pick": pick,
        "best": best,
        "disp_over_best": disp / ours[best] if disp and best else None,
        "pct_floor": 100 * floor / disp if disp else None,
        "vs_triton": triton / disp if disp and triton else None,
    }
    return {**row, "misses": misses(row)}


def misses(row: dict) -> list[str]:
    """Where a row misses the bar (empty: it meets it, as far as measured)."""
    out = []
    if row["disp_over_best"] is None:
        out.append("no disp")
    elif row["disp_over_best"] > 1.03:
        out.append("disp>3%")
    if row["floor_us"] >= 50 and (row["pct_floor"] or 0) < 85:
        out.append("floor<85%")
    if row["pairs"] <= 128 and row["vs_triton"] is not None and row["vs_triton"] < 4:
        out.append("triton<4x")
    return out


HEADER = ["rows/Hq/Hkv/topk", "pairs", "floor", "triton", *OURS, "disp", "pick", "best"]
HEADER += ["disp/best", "% floor", "x triton", "bar"]


def _cell(value: object) -> object:
    return "ERR" if isinstance(value, str) else value


def table_row(row: dict) -> list[object]:
    times = row["times_us"]
    cells = [row["name"], row["pairs"], row["floor_us"], _cell(times.get("triton"))]
    cells += [_cell(times.get(label)) for label in (*OURS, "disp")]
    ratio, pct, vs = row["disp_over_best"], row["pct_floor"], row["vs_triton"]
    cells += [row["pick"], row["best"], None if ratio is None else f"{ratio:.3f}"]
    cells += [None if pct is None else f"{pct:.0f}%", None if vs is None else f"{vs:.1f}x"]
    return [*cells, ",".join(row["misses"]) or "ok"]


def gate_lines(rows: Iterable[dict], labels: Sequence[str] = SPLITS) -> list[str]:
    """Per geometry, by rows x Hkv: the best of ``labels``' times over the single pass's
    (< 1: they win there), the data a gate is derived from: the splits' (the single pass's
    crossover) or ("short",) the short single pass's threshold."""
    groups: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        times, p = row["times_us"], row["point"]
        splits = [times[k] for k in labels if isinstance(times.get(k), float)]
        if isinstance(times.get("k1"), float) and splits:
            key = f"{p['hq']}/{p['hkv']} topk {p['topk']} page {p['page']} D {p['head_dim']}"
            groups.setdefault(key, []).append((row["pairs"], min(splits) / times["k1"]))
    return [
        f"{key}: " + ", ".join(f"{pairs} {ratio:.2f}" for pairs, ratio in sorted(values))
        for key, values in groups.items()
    ]


def write_json(path: str, meta: dict, rows: list[dict]) -> None:
    """All rows so far, replacing the file whole (a killed run leaves valid JSON)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    os.replace(tmp, target)
