"""Derive the sm_90 ``auto`` rule of concat_mla_kv_quant_fp8 from measured kernel times.

    python tools/mla_kv_pack_rule.py RESULTS.json [--tolerance 0.03] [--write [POINTS.json]]

RESULTS is ``tools/bench_mla_kv_pack.py --json`` output (its serving measure) or a points
file this tool wrote. The rule is what ``heuristics.SM90_SPECIALIZED_MAX_TOKENS`` holds:
from each head count on (up to the next entry), the most tokens a call may have for
``auto`` to try ``specialized`` first (None: any), else ``cake``. Per measured head count
the tool takes the token threshold that keeps the picked backend within the tolerance of
the faster one at every measured token count (the smallest worst ratio; ties: the larger
threshold), merges neighbours with equal thresholds, prints the table as code to paste,
and checks the table heuristics.py holds now. ``--write`` stores the points compactly (the
file tests/test_mla_kv_pack.py checks the committed table against).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit.mla_kv_pack import heuristics  # noqa: E402

Table = tuple[tuple[int, int | None], ...]  # (from this head count, max tokens or None)
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


def pick(table: Table, tokens: int, heads: int) -> str:
    return "specialized" if heuristics.specialized_first(table, tokens, heads) else "cake"


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


def _threshold(points: list[Point], tolerance: float) -> int | None:
    """The token threshold for one head count's points (0: cake at every one)."""
    tokens = sorted(p.tokens for p in points)

    def worst(limit: int | None) -> float:
        return max(p.ratio(pick(((1, limit),), p.tokens, 1)) for p in points)

    candidates = [0, *tokens[:-1], None]  # None: specialized at every measured count
    valid = [t for t in candidates if worst(t) <= 1 + tolerance]
    if not valid:
        best = min(candidates, key=worst)
        bad = violations(points, lambda t, h: pick(((1, best),), t, 1), tolerance)
        raise ValueError(f"no token threshold at {points[0].heads} heads: " + "; ".join(bad))
    return min(valid, key=lambda t: (worst(t), -(t if t is not None else 1 << 40)))


def derive(points: list[Point], tolerance: float = TOLERANCE) -> Table:
    """The table keeping every point within ``tolerance`` (ValueError naming the points of
    a head count no threshold serves)."""
    table: list[tuple[int, int | None]] = []
    for heads in sorted({p.heads for p in points}):
        limit = _threshold([p for p in points if p.heads == heads], tolerance)
        if not table or table[-1][1] != limit:
            table.append((heads, limit))
    return tuple(table)


def _score(points: list[Point], table: Table) -> tuple[float, float]:
    ratios = [p.ratio(pick(table, p.tokens, p.heads)) for p in points]
    return max(ratios, default=1.0), sum(ratios) / max(1, len(ratios))


def render(table: Table, points: list[Point], header: dict) -> str:
    """The table as code for heuristics.py, with its measured worst case."""
    worst, mean = _score(points, table)
    at = max(points, key=lambda p: p.ratio(pick(table, p.tokens, p.heads)))
    lines = [
        f"# sm_90 table from {len(points)} points measured on {header.get('device', '?')}"
        f" ({header.get('measure', 'serving measure')}):",
        f"# worst auto/faster {worst:.3f} at {at.tokens}x{at.heads}, mean {mean:.4f}.",
        "SM90_SPECIALIZED_MAX_TOKENS: tuple[tuple[int, int | None], ...] = (",
    ]
    lines += [f"    {entry!r}," for entry in table]
    lines.append(")")
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
    held = heuristics.SM90_SPECIALIZED_MAX_TOKENS
    now = violations(points, lambda t, h: pick(held, t, h), args.tolerance)
    print(
        f"heuristics.SM90_SPECIALIZED_MAX_TOKENS now: {len(now)} of {len(points)} points over the tolerance"
    )
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
