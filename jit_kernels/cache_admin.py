"""Cache maintenance for the CLI: list and verify entries, measure and clear what it wrote.

Only what the package wrote is touched, so a cache root shared with other files (or
pointed at the wrong folder) loses nothing else:

    <root>/<version>/<arch>/<family>/<64 hex>.{cubin,json}   where the record parses and
                                                             binds them to that place
    <root>/<version>/<arch>/<family>/<64 hex>.lock           while empty
    <root>/native/_launcher-<16 hex><ext suffix>{,.json,.lock}
    and the temporary files of those (and .probe.*.tmp), named as tempfile names them

A key's files are removed holding its lock (one a builder holds is left whole), the lock
last. Below the root (resolved once: it may be a link) folders are entered only when
they are real folders (never through a link) with names of that shape, and removed only
when this clear emptied them. A root that is, holds or sits in a prebuilt root is refused.
"""

from __future__ import annotations

import dataclasses
import errno
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import filelock

from . import native
from .cache import CUBIN_PATH_ENV, CacheEntry, CubinCache, bound_fields, read_entry
from .cache_record import (
    CACHE_DIR_ENV,
    TEMP_TAIL,
    CorruptEntry,
    InsecureCacheError,
    binding_problem,
    check_existing_folders,
    read_record,
)

VERSION_RE = re.compile(r"\d+(\.\d+)*[0-9A-Za-z.+!-]*")
ARCH_RE = re.compile(r"sm_\d{2,3}[af]?")
FAMILY_RE = re.compile(r"[A-Za-z0-9_]+")
NATIVE_FOLDER_RE = re.compile(re.escape(native.FOLDER))
ENTRY_RE = re.compile(r"(?P<key>[0-9a-f]{64})\.(?P<kind>cubin|json|lock)")
# The cache's temporary files: an entry file's, its lock's folder probe (tempfile.mkstemp).
TEMP_RE = re.compile(rf"\.(?P<key>[0-9a-f]{{64}})\.(cubin|json){TEMP_TAIL}|\.probe{TEMP_TAIL}")


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
    """What verify found at ``path``. ``refused``: loading raises on it (others can write to
    it or a folder above it, or another user owns it) instead of rebuilding it."""

    path: Path
    what: str
    refused: bool = False


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


def verify(entry: CacheEntry, named_by: str = CACHE_DIR_ENV) -> Problem | None:
    """None when loading would serve the entry (intact, bound to its place, not writable by
    other users, nor its folders), else what is wrong with it (naming ``named_by``, the
    setting that chose its root, where it is refused)."""
    root = entry.cubin_path.parents[3]
    try:
        read_entry(root, entry.cubin_path.relative_to(root), named_by=named_by)
    except InsecureCacheError as exc:
        return Problem(entry.cubin_path, str(exc), refused=True)
    except (OSError, CorruptEntry) as exc:
        return Problem(entry.cubin_path, str(exc))
    return None


def other_problems(cache: CubinCache, root: Path) -> list[Problem]:
    """The root or version folder where others can write to it (refused by loading and
    prebuild, entries or none), lock paths that are folders, and native launchers that fail
    their record."""
    found = []
    try:
        check_existing_folders(root, Path(cache.version), cache.named_by)
    except InsecureCacheError as exc:
        found.append(Problem(root, str(exc), refused=True))
    found += [
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
    busy: int = 0  # files of entries being built (their lock held elsewhere), left alone
    folders: list[Path] = dataclasses.field(default_factory=list)  # emptied and removed


def _bound(meta_path: Path) -> bool:
    """Whether the record at ``meta_path`` parses and binds to its place (the cache's own
    check): a cubin or record named like an entry is the cache's only then."""
    try:
        record = read_record(meta_path)
    except CorruptEntry:
        return False
    return (
        binding_problem(record, bound_fields(meta_path.relative_to(meta_path.parents[3]))) is None
    )


def _entry_file(path: Path) -> tuple[bool, Path | None]:
    """(whether the cache wrote ``path``, a file in a family folder; its key's lock, if any):
    a cubin or record whose record binds it, an empty lock, a temporary file of its own."""
    if not path.is_file() or path.is_symlink():
        return False, None
    if match := ENTRY_RE.fullmatch(path.name):
        lock = path.with_name(f"{match['key']}.lock")
        if match["kind"] == "lock":
            return path.stat().st_size == 0, lock
        return _bound(path.with_suffix(".json")), lock
    if match := TEMP_RE.fullmatch(path.name):
        return True, path.with_name(f"{match['key']}.lock") if match["key"] else None
    return False, None


def _native_file(path: Path) -> tuple[bool, Path | None]:
    """_entry_file of a file in the native launcher's folder: a name native.build writes."""
    match = native.NAMES.fullmatch(path.name)
    if not match or not path.is_file() or path.is_symlink():
        return False, None
    return True, path.with_name(f"{match['name'] or match['temp']}.lock")


def _remove(lock: Path | None, files: list[Path], report: ClearReport, remove: bool) -> bool:
    """Count (and with ``remove``, remove) one key's ``files``, holding its ``lock`` where it
    is one of them, taken without blocking: a key being built is left whole, and the lock
    file goes last, still held (a builder never holds a lock file clear unlinked under it).
    Whether they were removed."""
    taken = filelock.FileLock(str(lock), timeout=0) if remove and lock in files else None
    if taken is not None:
        try:
            taken.acquire()
        except filelock.Timeout:
            report.busy += len(files)
            return False
    try:
        for path in sorted(files, key=lambda p: p == lock):
            try:
                size = path.stat().st_size
            except FileNotFoundError:  # another clear
                continue
            report.files, report.bytes = report.files + 1, report.bytes + size
            if remove:
                path.unlink(missing_ok=True)
    finally:
        if taken is not None:
            taken.release()
    return remove


def _sweep(
    folder: Path,
    owned: Callable[[Path], tuple[bool, Path | None]],
    report: ClearReport,
    remove: bool,
) -> bool:
    """_remove each key's files in ``folder`` that ``owned`` says the package wrote; whether
    it removed any."""
    keys: dict[Path | None, list[Path]] = {}
    for path in folder.iterdir():
        ours, lock = owned(path)
        if ours:
            keys.setdefault(lock, []).append(path)
        else:
            report.kept += 1
    removed = [_remove(lock, files, report, remove) for lock, files in keys.items()]
    return any(removed)


def _prune(folder: Path, stop: Path, report: ClearReport) -> None:
    """Remove ``folder``, which this clear emptied, and the parents that leaves empty up to
    (not including) ``stop``; one that is not empty (a builder writing there) ends it."""
    while folder != stop:
        try:
            folder.rmdir()
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return
            raise
        report.folders.append(folder)
        folder = folder.parent


def clear(
    root: Path,
    archs: tuple[str, ...] | None = None,
    remove: bool = True,
    keep: Sequence[Path] = (),
) -> ClearReport:
    """Remove (or with ``remove=False`` only measure) what the package wrote under ``root``:
    every version's entries (only ``archs``' when given) and, without ``archs``, the native
    launcher; then the folders that emptied. ``root`` is resolved once (the user named it,
    a link or not); no link below it is followed. ValueError where ``root`` is, holds or sits
    in one of ``keep``, the read-only prebuilt roots: what they hold is not the cache's."""
    root = root.resolve()
    for bundle in (path.resolve() for path in keep):
        if root.is_relative_to(bundle) or bundle.is_relative_to(root):
            raise ValueError(
                f"refusing to clear {root}: it is, holds or sits in the prebuilt bundle "
                f"{bundle} ({CUBIN_PATH_ENV} is read-only)"
            )
    report = ClearReport()
    folders = [(folder, _entry_file) for folder in family_folders(root, archs)]
    if archs is None:
        folders += [(folder, _native_file) for folder in _real_dirs(root, NATIVE_FOLDER_RE)]
    for folder, owned in folders:
        if _sweep(folder, owned, report, remove):
            _prune(folder, root, report)
    return report
