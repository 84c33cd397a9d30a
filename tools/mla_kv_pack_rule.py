"""Derive the sm_90 ``auto`` rule of concat_mla_kv_quant_fp8 from measured kernel times.

    python tools/mla_kv_pack_rule.py RESULTS.json [--tolerance 0.03] [--write POINTS.json]

RESULTS is ``tools/bench_mla_kv_pack.py --json`` output (its serving measure) or a points
file this tool wrote. A rule is what ``heuristics.SM90_SPECIALIZED`` holds: clauses of
upper bounds (max tokens, max heads, max tokens x heads, None for no bound); ``auto``
tries ``specialized`` first when a clause covers the call, else ``cake``. The tool prints
the simplest rule (fewest bounds, then fewest clauses; ties: the smallest worst and then
mean ratio) under which the picked backend is within the tolerance of the faster one at
every measured point, as code to paste, and checks the rule heuristics.py holds now.
``--write`` stores the points compactly (the file tests/test_mla_kv_pack.py checks the
committed rule against).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit.mla_kv_pack import heuristics  # noqa: E402

Clause = tuple[int | None, int | None, int | None]  # max tokens, max heads, max work
TOLERANCE = 0.03
POINTS_FILE = Path(__file__).resolve().parent.parent / "docs/perf-log/mla_kv_pack_sm90_serving.json"


@dataclass(frozen=True)
class Point:
    tokens: int
    heads: int
    spec_us: float
    cake_us: float

    def ratio(self, backend: str) -> float:
        """The backend's time over the faster backend's."""
        us = self.spec_us if backend == "specialized" else self.cake_us
        return us / min(self.spec_us, self.cake_us)


def load_points(path: Path) -> tuple[list[Point], dict]:
    """Points with both backends measured, and the file's header (device, measure)."""
    data = json.loads(path.read_text())
    if "points" in data:  # this tool's compact file
        return [Point(*p) for p in data["points"][1:]], data  # [0]: the column names
    points = []
    for row in data["rows"]:
        us = row.get("us", {})
        if "specialized" in us and "cake" in us:
            points.append(Point(row["tokens"], row["heads"], us["specialized"], us["cake"]))
        else:  # a backend failed there: it cannot constrain the rule
            print(f"skipped {row['tokens']}x{row['heads']}: {row.get('errors')}", file=sys.stderr)
    return points, {k: v for k, v in data.items() if k != "rows"}


def pick(clauses: tuple[Clause, ...], tokens: int, heads: int) -> str:
    hit = any(heuristics.covers(c, tokens, heads) for c in clauses)
    return "specialized" if hit else "cake"


def violations(points: list[Point], choose, tolerance: float = TOLERANCE) -> list[str]:
    """Points where ``choose(tokens, heads)``'s backend is over the tolerance (empty: ok)."""
    out = []
    for p in points:
        backend = choose(p.tokens, p.heads)
        if p.ratio(backend) > 1 + tolerance:
            out.append(
                f"{p.tokens}x{p.heads}: {backend} {p.ratio(backend):.3f}x the faster "
                f"(specialized {p.spec_us:.2f}, cake {p.cake_us:.2f} us)"
            )
    return out


def _safe_clauses(points: list[Point], unsafe: int) -> dict[int, Clause]:
    """Cover mask -> the clause with the fewest bounds covering exactly those points, for
    every clause whose bounds are measured values and that covers no point where
    specialized is over the tolerance."""

    def masks(values, key) -> dict[int | None, int]:
        out = {None: (1 << len(points)) - 1}
        for v in values:
            out[v] = sum(1 << i for i, p in enumerate(points) if key(p) <= v)
        return out

    tok = masks(sorted({p.tokens for p in points}), lambda p: p.tokens)
    hd = masks(sorted({p.heads for p in points}), lambda p: p.heads)
    work = masks(sorted({p.tokens * p.heads for p in points}), lambda p: p.tokens * p.heads)
    best: dict[int, Clause] = {}
    for (t, mt), (h, mh), (w, mw) in itertools.product(tok.items(), hd.items(), work.items()):
        mask = mt & mh & mw
        if mask & unsafe:
            continue
        clause = (t, h, w)
        if mask not in best or _cost((clause,)) < _cost((best[mask],)):
            best[mask] = clause
    return best


def _cost(clauses: tuple[Clause, ...]) -> tuple[int, int]:
    # Simplicity: bounds first (a bound is one comparison), then clauses.
    return sum(b is not None for c in clauses for b in c), len(clauses)


def _score(points: list[Point], clauses: tuple[Clause, ...]) -> tuple[float, float]:
    ratios = [p.ratio(pick(clauses, p.tokens, p.heads)) for p in points]
    return max(ratios, default=1.0), sum(ratios) / max(1, len(ratios))


def derive(points: list[Point], tolerance: float = TOLERANCE) -> tuple[Clause, ...]:
    """The simplest rule keeping every point within ``tolerance``; ValueError if none
    with upper bounds exists (the message names the conflicting points)."""
    full = (1 << len(points)) - 1
    spec_ok = sum(1 << i for i, p in enumerate(points) if p.ratio("specialized") <= 1 + tolerance)
    cake_ok = sum(1 << i for i, p in enumerate(points) if p.ratio("cake") <= 1 + tolerance)
    required, unsafe = full & ~cake_ok, full & ~spec_ok
    if not required:
        return ()  # cake everywhere: no bound at all
    useful = [(m, c) for m, c in _safe_clauses(points, unsafe).items() if m & required]
    useful.sort(key=lambda mc: _cost((mc[1],)))
    rules = [(c,) for m, c in useful if m & required == required]
    # Pairs only while they can tie the cheapest rule found: bounds add up, and ``useful``
    # is in ascending bounds, so the inner loop stops at the first pair over the limit.
    limit = min((_cost(r) for r in rules), default=(99, 99))
    bounds = [_cost((c,))[0] for _, c in useful]
    for i, (m1, c1) in enumerate(useful):
        for j in range(i + 1, len(useful)):
            if (bounds[i] + bounds[j], 2) > limit:
                break
            if (m1 | useful[j][0]) & required == required:
                rules.append((c1, useful[j][1]))
    if not rules:
        return _greedy(points, required, useful)
    cheapest = min(_cost(r) for r in rules)
    return min((r for r in rules if _cost(r) == cheapest), key=lambda r: _score(points, r))


def _greedy(points: list[Point], required: int, useful: list[tuple[int, Clause]]):
    """No rule of two clauses: cover the points only specialized serves with the clause
    covering most of them, repeatedly, then drop clauses the others make redundant (not
    minimal, but a valid rule)."""
    chosen: list[tuple[int, Clause]] = []
    left = required
    while left:
        best = max(useful, key=lambda mc: (bin(mc[0] & left).count("1"), -_cost((mc[1],))[0]),
                   default=(0, ()))  # fmt: skip
        if not best[0] & left:
            stuck = [f"{p.tokens}x{p.heads}" for i, p in enumerate(points) if left >> i & 1]
            raise ValueError(
                "no rule of upper bounds: specialized is needed at "
                f"{', '.join(stuck)}, yet over the tolerance at a call no larger in tokens and heads"
            )
        chosen.append(best)
        left &= ~best[0]
    for item in list(chosen):
        rest = [m for m, c in chosen if (m, c) != item]
        if required & ~_union(rest) == 0:
            chosen.remove(item)
    return tuple(c for _, c in chosen)


def _union(masks: list[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


def _describe(clause: Clause) -> str:
    names = ("tokens", "heads", "tokens*heads")
    parts = [f"{n} <= {b}" for n, b in zip(names, clause, strict=True) if b is not None]
    return " and ".join(parts) or "always"


def render(clauses: tuple[Clause, ...], points: list[Point], header: dict) -> str:
    """The rule as code for heuristics.py, with its measured worst case."""
    worst, mean = _score(points, clauses)
    at = max(points, key=lambda p: p.ratio(pick(clauses, p.tokens, p.heads)))
    lines = [
        f"# sm_90 rule from {len(points)} points measured on {header.get('device', '?')}"
        f" ({header.get('measure', 'serving measure')}):",
        f"# worst auto/faster {worst:.3f} at {at.tokens}x{at.heads}, mean {mean:.4f}.",
        "SM90_SPECIALIZED: tuple[tuple[int | None, int | None, int | None], ...] = (",
    ]
    lines += [f"    {tuple(c)!r},  # {_describe(c)}" for c in clauses]
    lines.append(")" if clauses else "    # none: cake first everywhere\n)")
    return "\n".join(lines)


COLUMNS = ["tokens", "heads", "specialized_us", "cake_us"]


def _row(p: Point) -> list:
    return [p.tokens, p.heads, round(p.spec_us, 4), round(p.cake_us, 4)]


def write_points(points: list[Point], header: dict, path: Path) -> None:
    """The compact file the CPU test checks heuristics.py against."""
    out = {k: header[k] for k in ("device", "torch", "measure", "l2_bytes") if k in header}
    out["tolerance"] = TOLERANCE
    body = json.dumps(out, indent=1)[:-2]  # the header, one field a line
    rows = ",\n  ".join(json.dumps(p) for p in [COLUMNS] + [_row(p) for p in points])
    text = body + ',\n "points": [\n  ' + rows + "\n ]\n}\n"
    path.write_text(text)
    print(f"wrote {len(points)} points to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--write", type=Path, nargs="?", const=POINTS_FILE, metavar="POINTS")
    args = parser.parse_args(argv)
    points, header = load_points(args.results)
    if not points:
        print("no point has both backends measured", file=sys.stderr)
        return 1
    now = violations(points, lambda t, h: pick(heuristics.SM90_SPECIALIZED, t, h), args.tolerance)
    print(f"heuristics.SM90_SPECIALIZED now: {len(now)} of {len(points)} points over the tolerance")
    for line in now:
        print(f"  {line}")
    try:
        rule = derive(points, args.tolerance)
    except ValueError as exc:
        print(f"no rule: {exc}", file=sys.stderr)
        return 1
    print("\nderived (paste into flashinfer_jit/mla_kv_pack/heuristics.py):\n")
    print(render(rule, points, header))
    if args.write:
        write_points(points, header, args.write)
    else:
        print(f"\nthen commit the points for the CPU test: --write ({POINTS_FILE.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
