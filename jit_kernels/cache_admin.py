"""Cache maintenance for the CLI: list and verify entries, measure and clear what it wrote.

Only names the package writes are touched, so a cache root shared with other files (or
pointed at the wrong folder) loses nothing else:

    <root>/<version>/<arch>/<family>/<64 hex>.{cubin,json,lock}   (and their .tmp files,
                                                                  .probe.*.tmp)
    <root>/native/_launcher-<16 hex><suffix>{,.json,.lock}       (and their .tmp files)

Folders are entered only when they are real folders (never through a link) with names of
that shape, and removed only when clearing left them empty.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

from . import native
from .cache import CacheEntry, CubinCache, read_entry
from .cache_record import CorruptEntry, InsecureCacheError, read_record

VERSION_RE = re.compile(r"\d+(\.\d+)*[0-9A-Za-z.+!-]*")
ARCH_RE = re.compile(r"sm_\d{2,3}[af]?")
FAMILY_RE = re.compile(r"[A-Za-z0-9_]+")
ENTRY_RE = re.compile(r"\.?[0-9a-f]{64}\.(cubin|json|lock)(\.[^/]*\.tmp)?|\.probe\.[^/]*\.tmp")
NATIVE_RE = re.compile(r"\.?_launcher-[0-9a-f]{16}[^/]*")


def _real_dirs(folder: Path, pattern: re.Pattern) -> list[Path]:
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    )


def family_folders(root: Path, archs: tuple[str, ...] | None = None) -> Iterator[Path]:
    """Every <version>/<arch>/<family> folder under ``root`` (only ``archs``, when given)."""
    for version in _real_dirs(root, VERSION_RE):
        for arch in _real_dirs(version, ARCH_RE):
            if archs is None or arch.name in archs:
                yield from _real_dirs(arch, FAMILY_RE)


# -- list and verify -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Problem:
    """Something verify found that is not an entry (a folder where a lock file goes...)."""

    path: Path
    what: str


def entries(cache: CubinCache, root: Path | None = None) -> Iterator[CacheEntry]:
    """The entries of this package version under ``root`` (default: the cache's root);
    a record that cannot be parsed gives an empty ``meta``."""
    base = (root or cache.root) / cache.version
    for meta_path in sorted(base.glob("*/*/*.json")):
        try:
            meta = read_record(meta_path)
        except CorruptEntry:
            meta = {}
        yield CacheEntry(meta_path.with_suffix(".cubin"), meta)


def verify(entry: CacheEntry) -> str | None:
    """None when loading would serve the entry (intact, bound to its place, not writable by
    other users, nor its folders), else what is wrong with it."""
    root = entry.cubin_path.parents[3]
    try:
        read_entry(root, entry.cubin_path.relative_to(root))
    except (OSError, CorruptEntry, InsecureCacheError) as exc:
        return str(exc)
    return None


def other_problems(cache: CubinCache, root: Path) -> list[Problem]:
    """Lock paths that are folders, and native launchers that fail their record."""
    found = [
        Problem(p, "lock path is a folder")
        for p in sorted((root / cache.version).glob("*/*/*.lock"))
        if p.is_dir()
    ]
    for path in native.launchers(root):
        problem = native.launcher_problem(path)
        found.append(Problem(path, problem or "ok"))
    return found


# -- size and clear ----------------------------------------------------------------------
@dataclasses.dataclass
class ClearReport:
    files: int = 0
    bytes: int = 0
    kept: int = 0  # files below the root that the package did not write, left alone
    folders: list[Path] = dataclasses.field(default_factory=list)  # emptied and removed


def _owned_files(folder: Path, pattern: re.Pattern) -> tuple[list[Path], int]:
    """(files in ``folder`` whose names the package writes, count of everything else)."""
    owned, other = [], 0
    for p in folder.iterdir():
        if pattern.fullmatch(p.name) and p.is_file() and not p.is_symlink():
            owned.append(p)
        else:
            other += 1
    return owned, other


def _sweep(folders: list[Path], pattern: re.Pattern, report: ClearReport, remove: bool) -> None:
    for folder in folders:
        owned, other = _owned_files(folder, pattern)
        report.kept += other
        for path in owned:
            report.bytes += path.stat().st_size
            report.files += 1
            if remove:
                path.unlink(missing_ok=True)


def _prune(folder: Path, stop: Path, report: ClearReport) -> None:
    """Remove ``folder`` and its parents up to (not including) ``stop`` while empty."""
    while folder != stop and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()
        report.folders.append(folder)
        folder = folder.parent


def clear(root: Path, archs: tuple[str, ...] | None = None, remove: bool = True) -> ClearReport:
    """Remove (or with ``remove=False`` only measure) the entries the package wrote under
    ``root``: every version's cubins, records and locks (only ``archs``' when given) and,
    without ``archs``, the native launcher."""
    report = ClearReport()
    families = list(family_folders(root, archs))
    _sweep(families, ENTRY_RE, report, remove)
    natives = [] if archs is not None else _real_dirs(root, re.compile(native.FOLDER))
    _sweep(natives, NATIVE_RE, report, remove)
    if remove:
        for folder in [*families, *natives]:
            _prune(folder, root, report)
    return report
