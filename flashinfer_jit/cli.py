"""The ``flashinfer-jit`` command: prebuild kernels, inspect the cache, report the setup."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from jit_kernels import CubinCache, target_archs
from jit_kernels.prebuild import BuildTask, build_all, build_native

from ._jit import BUILDER, TEMPLATE_ROOT
from ._version import __version__
from .registry import OPS


def _split(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def _tasks(ops: list[str], archs: tuple[str, ...], workload_file: str | None) -> list[BuildTask]:
    override: dict[str, dict] = {}
    if workload_file:
        data = json.loads(Path(workload_file).read_text())
        if data.get("op") not in OPS:
            raise SystemExit(f'{workload_file}: needs an "op" key naming one of {sorted(OPS)}')
        override[data["op"]] = data
        ops = [data["op"]] if not ops else ops
    tasks = []
    for name in ops:
        op = OPS[name]
        workloads = override[name] if name in override else op.load_workloads()
        for spec in op.prebuild_specs(workloads, op.default.options):
            tasks += [BuildTask(name, spec, arch) for arch in archs if spec.supports(arch)]
    return tasks


def _table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_prebuild(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    ops = _split(args.ops) or ([] if args.workloads else list(OPS))
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise SystemExit(f"unknown op(s) {unknown}; choose from {sorted(OPS)}")
    archs = target_archs(args.arch)
    tasks = _tasks(ops, archs, args.workloads)
    output = Path(args.output).resolve() if args.output else None
    where = output or BUILDER.cache.root
    print(
        f"prebuilding {len(tasks)} kernels for {', '.join(archs)} into {where} with {args.jobs} workers"
    )
    stats: dict[tuple[str, str], dict] = defaultdict(
        lambda: {"kernels": 0, "compiled": 0, "cached": 0, "failed": 0, "seconds": 0.0}
    )
    failures = []
    results = build_all(tasks, TEMPLATE_ROOT, __version__, args.jobs, output)
    # Outside a terminal (CI logs) the bar redraws rarely instead of on every kernel.
    refresh = 0.1 if sys.stderr.isatty() else 30.0
    for result in tqdm(
        results, total=len(tasks), unit="kernel", file=sys.stderr, mininterval=refresh
    ):
        row = stats[(result.task.group, result.task.arch)]
        row["kernels"] += 1
        row[result.status] += 1
        row["seconds"] += result.seconds
        if result.status == "failed":
            failures.append(result)
    for failure in failures:
        print(
            f"FAILED {failure.task.spec.label} {failure.task.arch}: {failure.error}",
            file=sys.stderr,
        )
    rows = [
        [op, arch, s["kernels"], s["compiled"], s["cached"], s["failed"], f"{s['seconds']:.1f}"]
        for (op, arch), s in sorted(stats.items())
    ]
    print(_table(["op", "arch", "kernels", "compiled", "cached", "failed", "seconds"], rows))
    status, detail = build_native(output)  # optional: a failure is reported, not fatal
    print(f"native launcher: {status} ({detail})", file=sys.stderr if status == "failed" else None)
    return 1 if failures else 0


def _caches() -> list[tuple[str, CubinCache]]:
    cache = BUILDER.cache
    return [("cache", cache)] + [
        ("prebuilt", CubinCache(root, [], __version__)) for root in cache.prebuilt
    ]


def cmd_cache(args: argparse.Namespace) -> int:
    cache = BUILDER.cache
    if args.action == "path":
        print(cache.root)
        for root in cache.prebuilt:
            print(f"{root} (prebuilt, read-only)")
        return 0
    if args.action == "clear":
        targets = sorted(cache.root.glob(f"*/{args.arch}")) if args.arch else [cache.root]
        for target in targets:
            shutil.rmtree(target, ignore_errors=True)
            print(f"removed {target}")
        return 0
    bad = 0
    rows = []
    for kind, each in _caches():
        for entry in each.entries():
            problem = CubinCache.verify(entry) if args.action == "verify" else None
            bad += problem is not None
            meta = entry.meta
            rows.append(
                [
                    kind,
                    meta.get("arch", "?"),
                    meta.get("label", entry.cubin_path.stem),
                    meta.get("size", "?"),
                    problem or "ok" if args.action == "verify" else meta.get("created", "?"),
                    entry.cubin_path,
                ]
            )
    last = "status" if args.action == "verify" else "created"
    print(_table(["where", "arch", "kernel", "bytes", last, "path"], rows))
    print(f"{len(rows)} entries" + (f", {bad} bad" if args.action == "verify" else ""))
    return 1 if bad else 0


def cmd_env(args: argparse.Namespace) -> int:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from jit_kernels import device_arch, nvrtc_version

    def pkg(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    try:
        nvrtc = nvrtc_version()
    except Exception as exc:  # no NVRTC library is a state to report, not a crash
        nvrtc = f"unavailable ({exc})"
    print(f"flashinfer-jit      {__version__}")
    print(f"python              {sys.version.split()[0]}")
    print(f"torch               {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"cuda-python         {pkg('cuda-python')} (cuda-bindings {pkg('cuda-bindings')})")
    print(f"nvrtc               {nvrtc}")
    print(f"nvidia-cutlass-dsl  {pkg('nvidia-cutlass-dsl')}")
    from jit_kernels.compile import cute_dsl_refusal

    print(f"cake kernels        {cute_dsl_refusal() or 'compiled here'}")
    # The NVRTC extra should follow torch's CUDA major (README, "Install: the extras").
    torch_major, nvrtc_major = (torch.version.cuda or "").split(".")[0], nvrtc.split(".")[0]
    if torch_major and nvrtc_major.isdigit() and nvrtc_major != torch_major:
        print(
            f"warning             NVRTC {nvrtc} beside torch for CUDA {torch.version.cuda}: "
            f"pip install 'flashinfer-jit[cu{torch_major}]'"
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        print(f"gpu {i}               {torch.cuda.get_device_name(i)} ({device_arch(i)})")
    if not gpus:
        print("gpus                none")
    print(f"target archs        {', '.join(target_archs())}")
    print(f"cache dir           {BUILDER.cache.root}")
    print(f"prebuilt dirs       {os.pathsep.join(map(str, BUILDER.cache.prebuilt)) or '-'}")
    print(f"templates           {TEMPLATE_ROOT}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashinfer-jit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prebuild", help="compile the shipped workloads' kernels")
    p.add_argument(
        "--arch", help="comma-separated archs (default: the GPUs', else sm_90a,sm_100a,sm_103a)"
    )
    p.add_argument("--ops", help=f"comma-separated ops among {','.join(OPS)} (default: all)")
    p.add_argument(
        "--workloads",
        help='a workload JSON file (with an "op" key) to use instead of the shipped one',
    )
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    p.add_argument(
        "--output", help="write a relocatable bundle here (for FLASHINFER_JIT_CUBIN_PATH)"
    )
    p.set_defaults(func=cmd_prebuild)

    c = sub.add_parser("cache", help="inspect or clear the cubin cache")
    c.add_argument("action", choices=["path", "list", "verify", "clear"])
    c.add_argument("--arch", help="with clear: only this arch")
    c.set_defaults(func=cmd_cache)

    e = sub.add_parser("env", help="versions, GPUs and cache directories")
    e.set_defaults(func=cmd_env)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
