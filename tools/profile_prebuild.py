"""Where ``prebuild`` time goes, on the build machine (no GPU): per kernel and per op.

``python tools/profile_prebuild.py --arch sm_90a -j 2 --json out.json`` builds the shipped
kernels like ``flashinfer-jit prebuild`` (into $FLASHINFER_JIT_CACHE_DIR, which should be
empty for cold figures), then prints wall seconds, the sum of per-kernel seconds per op and
arch, the slowest kernels, and how many rendered specializations are byte-identical.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit import cli  # noqa: E402
from flashinfer_jit._jit import TEMPLATE_ROOT  # noqa: E402
from flashinfer_jit._version import __version__  # noqa: E402
from jit_kernels.prebuild import build_all  # noqa: E402
from jit_kernels.render import render  # noqa: E402


def distinct(tasks) -> tuple[int, int]:
    """(tasks, distinct compiler inputs): identical rendered source, name and arch."""
    seen = set()
    for task in tasks:
        rendered = render(task.spec, TEMPLATE_ROOT)
        seen.add((tuple(rendered.digest_parts()), task.arch))
    return len(tasks), len(seen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--ops")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.perf_counter()
    tasks = cli._tasks(cli._ops(args.ops), cli._archs(args.arch), None)
    listed = time.perf_counter() - start
    n, unique = distinct(tasks)
    rendered = time.perf_counter() - start - listed
    start = time.perf_counter()
    results = list(build_all(tasks, TEMPLATE_ROOT, __version__, args.jobs))
    wall = time.perf_counter() - start
    # The workers' CPU seconds: on a shared machine wall time says little, CPU time holds.
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    children = cpu.ru_utime + cpu.ru_stime
    if args.jobs <= 1:
        own = resource.getrusage(resource.RUSAGE_SELF)
        children = own.ru_utime + own.ru_stime
    per_op: dict = defaultdict(lambda: [0, 0.0])
    for r in results:
        per_op[(r.task.group, r.task.arch)][0] += 1
        per_op[(r.task.group, r.task.arch)][1] += r.seconds
    print(f"listing {listed:.2f} s, rendering+hashing all {rendered:.2f} s")
    print(f"{n} kernels, {unique} distinct compiler inputs, wall {wall:.1f} s with -j {args.jobs}")
    print(
        f"compiling processes' CPU time {children:.1f} s (wall at 2 idle cores ~{children / 2:.0f} s)"
    )
    for (op, arch), (count, secs) in sorted(per_op.items()):
        print(f"{op:14} {arch:8} {count:4} kernels  {secs:7.1f} s  {secs / count:5.2f} s/kernel")
    for r in sorted(results, key=lambda r: -r.seconds)[:8]:
        print(f"  {r.seconds:6.2f} s  {r.status:8} {r.task.arch} {r.task.spec.label}")
    if args.json:
        rows = [
            [r.task.group, r.task.arch, r.task.spec.label, r.status, r.seconds] for r in results
        ]
        Path(args.json).write_text(
            json.dumps({"wall": wall, "cpu": children, "jobs": args.jobs, "rows": rows})
        )


if __name__ == "__main__":
    main()
