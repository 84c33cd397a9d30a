"""``flashinfer-jit cache path|list|verify|clear``."""

from __future__ import annotations

import argparse
import sys

from jit_kernels import CubinCache, cache_admin
from jit_kernels.arch import parse_arch_list
from jit_kernels.cache import CUBIN_PATH_ENV

from ._jit import BUILDER
from ._version import __version__
from .cli_common import CliError, table


def _caches() -> list[tuple[str, CubinCache]]:
    cache = BUILDER.cache
    return [("cache", cache)] + [
        ("prebuilt", CubinCache(root, [], __version__, named_by=CUBIN_PATH_ENV))
        for root in cache.prebuilt
    ]


def _clear(cache: CubinCache, arch_text: str | None) -> int:
    try:
        archs = None if arch_text is None else parse_arch_list(arch_text)
    except ValueError as exc:
        raise CliError(f"--arch: {exc}") from None
    if not cache.root.is_dir():
        print(f"nothing to clear: {cache.root} is not a folder")
        return 0
    report = cache_admin.clear(cache.root, archs, keep=cache.prebuilt)
    which = f" for {','.join(archs)}" if archs else ""
    print(f"removed {report.files} files ({report.bytes} bytes){which} from {cache.root}")
    if report.kept:
        print(f"left {report.kept} files beside them that flashinfer-jit did not write")
    if report.busy:
        print(f"left {report.busy} files of kernels another process is building")
    return 0


def _rows(verify: bool) -> tuple[list[list], list[cache_admin.Problem]]:
    """The table's rows and the problems verify found."""
    rows, bad = [], []
    for kind, each in _caches():
        for entry in cache_admin.entries(each):
            problem = cache_admin.verify(entry, each.named_by) if verify else None
            bad += [problem] if problem else []
            meta = entry.meta
            last = (problem.what if problem else "ok") if verify else meta.get("created", "?")
            label = meta.get("label", entry.cubin_path.stem)
            rows.append([kind, meta.get("arch", "?"), label, meta.get("size", "?"), last,
                         entry.cubin_path])  # fmt: skip
        if verify:
            for found in cache_admin.other_problems(each, each.root):
                bad += [found] if found.what != "ok" else []
                rows.append([kind, "-", found.path.name, "-", found.what, found.path])
    return rows, bad


def cmd_cache(args: argparse.Namespace) -> int:
    cache = BUILDER.cache
    if args.arch is not None and args.action != "clear":
        raise CliError(f"--arch only applies to `cache clear`, not `cache {args.action}`")
    if args.action == "path":
        print(cache.root)
        for root in cache.prebuilt:
            print(f"{root} (prebuilt, read-only)")
        return 0
    if args.action == "clear":
        return _clear(cache, args.arch)
    verify = args.action == "verify"
    rows, bad = _rows(verify)
    last = "status" if verify else "created"
    print(table(["where", "arch", "kernel", "bytes", last, "path"], rows))
    print(f"{len(rows)} entries" + (f", {len(bad)} bad" if verify else ""))
    refused = sum(problem.refused for problem in bad)
    if len(bad) > refused:
        print(f"{len(bad) - refused} bad entries: they are rebuilt on next use", file=sys.stderr)
    if refused:
        print(
            f"{refused} refused: loading raises on them until no other user can write to them "
            "or their folders, and they are yours or root's",
            file=sys.stderr,
        )
    return 1 if bad else 0
