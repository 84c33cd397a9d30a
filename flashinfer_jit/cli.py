"""The ``flashinfer-jit`` command: prebuild kernels, inspect the cache, report the setup.

Every user error (a bad argument, environment variable or workloads file, a cache folder
that cannot be trusted or read) is one line on stderr and exit status 2, never a traceback;
``env`` reports the archs variable or the cache folder among the rest instead, and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

from jit_kernels import InsecureCacheError, target_archs
from jit_kernels.prebuild import (
    BuildResult,
    BuildTask,
    build_all,
    build_native,
    kernel_counts,
    one_line,
    prebuild_cache,
)

from . import workload_format
from ._jit import TEMPLATE_ROOT
from ._version import __version__
from .cli_cache import cmd_cache
from .cli_common import CliError, os_error_text, table
from .cli_env import cmd_env
from .registry import OPS
from .workload_format import WorkloadError

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print the usage too
        raise CliError(message)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _ops(text: str | None) -> list[str] | None:
    """The ops --ops names (None: not given)."""
    if text is None:
        return None
    ops = [s.strip() for s in text.split(",") if s.strip()]
    if not ops:
        raise CliError(f"--ops {text!r} names no op; choose from {','.join(OPS)}")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise CliError(f"--ops: unknown op(s) {','.join(unknown)}; choose from {','.join(OPS)}")
    return list(dict.fromkeys(ops))


def _archs(text: str | None) -> tuple[str, ...]:
    try:
        return target_archs(text)
    except ValueError as exc:
        raise CliError(f"--arch: {exc}" if text is not None else str(exc)) from None


def _given(option: str, text: str, what: str) -> str:
    """``text``, refused where it is empty: Path("") is the current folder, and an unset
    shell variable (``--output $DIR``) gives "" without a word."""
    if not text.strip():
        raise CliError(f"{option} is empty (an unset shell variable?): name {what}")
    return text


def _tasks(
    ops: list[str] | None, archs: tuple[str, ...], workload_file: str | None
) -> list[BuildTask]:
    workloads = {name: op.load_workloads() for name, op in OPS.items()}
    if workload_file is not None:
        path = Path(_given("--workloads", workload_file, "a workloads file"))
        data = workload_format.load(path, OPS)
        if ops is not None and data["op"] not in ops:
            raise CliError(
                f"--workloads {workload_file} is for {data['op']}, not --ops {','.join(ops)}"
            )
        workloads[data["op"]] = data
        ops = ops or [data["op"]]
    tasks = []
    for name in ops or list(OPS):
        op = OPS[name]
        for spec in op.prebuild_specs(workloads[name], op.default.options):
            tasks += [BuildTask(name, spec, arch) for arch in archs if op.prebuilt_on(spec, arch)]
    return tasks


def _output(text: str | None) -> Path | None:
    if text is None:
        return None
    output = Path(_given("--output", text, "the bundle's folder")).resolve()
    if output.exists() and not output.is_dir():
        raise CliError(f"--output {output} exists and is not a folder")
    return output


def _summarize(results: list[BuildResult]) -> int:
    """Print the per-op, per-arch table and one line per cause of failure; the failures."""
    stats: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"kernels": 0, "compiled": 0, "cached": 0, "failed": 0, "seconds": 0.0}
    )
    causes: dict[str, list[BuildResult]] = defaultdict(list)
    for result in results:
        row = stats[(result.task.group, result.task.arch)]
        row["kernels"] += 1
        row[result.status] += 1
        row["seconds"] += result.seconds
        if result.status == "failed":
            causes[result.cause or result.error].append(result)
    rows = [
        [op, arch, s["kernels"], s["compiled"], s["cached"], s["failed"], f"{s['seconds']:.1f}"]
        for (op, arch), s in sorted(stats.items())
    ]
    print(table(["op", "arch", "kernels", "compiled", "cached", "failed", "seconds"], rows))
    warned = [r for r in results if r.messages]
    if warned:  # built and stored, but the compiler flagged them (ptxas performance warnings)
        first = warned[0]
        more = f" and {len(warned) - 1} more" if len(warned) > 1 else ""
        print(
            f"WARNED {len(warned)} kernel(s) ({first.task.spec.label} {first.task.arch}{more}): "
            f"{one_line(first.messages)}",
            file=sys.stderr,
        )
    for cause, failed in causes.items():
        first = failed[0].task
        more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        print(
            f"FAILED {len(failed)} kernel(s) ({first.spec.label} {first.arch}{more}): {cause}",
            file=sys.stderr,
        )
    return sum(len(failed) for failed in causes.values())


def cmd_prebuild(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    ops = _ops(args.ops)
    archs = _archs(args.arch)
    tasks = _tasks(ops, archs, args.workloads)
    output = _output(args.output)  # checked in a dry run too: it reads, never writes
    if args.dry_run:  # before the cache is touched: a dry run writes nothing
        rows = [list(row) for row in kernel_counts(tasks)]
        print(table(["op", "arch", "kernels"], rows))
        print(f"{len(tasks)} kernels for {', '.join(archs)} (dry run: nothing compiled)")
        return 0
    cache = prebuild_cache(__version__, output)
    cache.check_trusted()  # a folder others can write to is refused before the first write
    print(
        f"prebuilding {len(tasks)} kernels for {', '.join(archs)} into {cache.root} "
        f"with {args.jobs} workers"
    )
    # Outside a terminal (CI logs) the bar redraws rarely instead of on every kernel.
    refresh = 0.1 if sys.stderr.isatty() else 30.0
    results = list(
        tqdm(
            build_all(tasks, TEMPLATE_ROOT, __version__, args.jobs, output),
            total=len(tasks),
            unit="kernel",
            file=sys.stderr,
            mininterval=refresh,
        )
    )
    failed = _summarize(results)
    status, detail = build_native(output)  # optional: a failure is reported, not fatal
    print(f"native launcher: {status} ({detail})", file=sys.stderr if status == "failed" else None)
    stored = len(results) - failed
    print(f"{stored} of {len(results)} kernels stored in {cache.root}, {failed} failed")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashinfer-jit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prebuild", help="compile the shipped workloads' kernels")
    p.add_argument(
        "--arch",
        help="archs from sm_90 that NVRTC lists, e.g. sm_90a,sm_100a or '9.0a 10.0a' "
        "(default: $FLASHINFER_JIT_ARCHS, else the GPUs', else sm_90a,sm_100a,sm_103a,sm_107a)",
    )
    p.add_argument("--ops", help=f"comma-separated ops among {','.join(OPS)} (default: all)")
    p.add_argument(
        "--workloads", help="a workloads file (README: 'Workloads files') to use for its op"
    )
    p.add_argument(
        "-j", "--jobs", type=_positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    p.add_argument(
        "--output", help="write a relocatable bundle here (for FLASHINFER_JIT_CUBIN_PATH)"
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the kernels per op and arch; compile none"
    )
    p.set_defaults(func=cmd_prebuild)

    c = sub.add_parser("cache", help="inspect or clear the cubin cache")
    c.add_argument("action", choices=["path", "list", "verify", "clear"])
    c.add_argument("--arch", help="with clear: only these archs (e.g. sm_90a,sm_100a)")
    c.set_defaults(func=cmd_cache)

    e = sub.add_parser("env", help="versions, variables, archs, GPUs and the cache")
    e.add_argument("--json", action="store_true", help="one JSON object, for machines")
    e.set_defaults(func=cmd_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return args.func(args)
    except (CliError, WorkloadError, InsecureCacheError, ValueError) as exc:
        print(f"flashinfer-jit: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except OSError as exc:  # a cache folder unreadable, immutable, a name too long...
        print(f"flashinfer-jit: error: {os_error_text(exc)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("flashinfer-jit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
