"""On-disk cubin cache: one plain .cubin plus a JSON record per key, shared safely.

Layout: ``<root>/<package version>/<arch>/<family>/<key>.cubin`` and ``<key>.json``.
Bundles written by ``prebuild --output`` have the same layout, so a bundle directory
can be listed in ``FLASHINFER_JIT_CUBIN_PATH`` as it is.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import filelock
import platformdirs

from .cache_record import (
    CACHE_DIR_ENV,
    CUBIN_MAX_BYTES,
    CorruptEntry,
    InsecureCacheError,
    binding_problem,
    check_existing_folders,
    check_owner_and_mode,
    cubin_problem,
    make_folders,
    read_file,
    read_record,
    remove_squatter,
)
from .compile import CompiledKernel

log = logging.getLogger("flashinfer_jit.jit")

CUBIN_PATH_ENV = "FLASHINFER_JIT_CUBIN_PATH"
LOCK_TIMEOUT_S = 600.0
# Store failures that mean the cache cannot be written at all: it is then used in memory
# for the rest of the process. ENOTDIR: a file where a cache folder goes.
UNWRITABLE = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR})
T = TypeVar("T")
__all__ = ["CACHE_DIR_ENV", "CacheWriteError", "CubinCache", "InsecureCacheError"]


class CacheWriteError(RuntimeError):
    """An entry could not be stored (only raised by a cache made with ``require_store``).

    ``cause`` says why without naming the entry, so callers can group failures by it."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashinfer-jit"))


def prebuilt_roots() -> list[Path]:
    return [Path(p) for p in os.environ.get(CUBIN_PATH_ENV, "").split(":") if p]


def bound_fields(rel: Path) -> dict[str, str]:
    """What the record of the entry at ``rel`` (version/arch/family/key.*) must say."""
    version, arch, family = rel.parent.parts
    return {"key": rel.stem, "family": family, "arch": arch, "version": version}


def read_entry(
    root: Path, rel: Path, label: str | None = None, named_by: str = CACHE_DIR_ENV
) -> tuple[dict, bytes]:
    """(record, cubin) of the entry at ``root/rel``, bound to its folders and file name (and
    ``label``, when given). CorruptEntry when it is not intact or not bound so; an OSError
    where it cannot be read; InsecureCacheError where others can write to it or its folders
    (naming ``named_by``, the setting that chose ``root``)."""
    check_existing_folders(root, rel.parent, named_by)
    cubin_path = root / rel
    record = read_record(cubin_path.with_suffix(".json"))
    expected = bound_fields(rel)
    problem = binding_problem(record, expected if label is None else {**expected, "label": label})
    if problem is None:
        data, st = read_file(cubin_path, CUBIN_MAX_BYTES)  # a regular file: never a link
        check_owner_and_mode(cubin_path, st, named_by)
        problem = cubin_problem(record, data)
    if problem is not None:
        raise CorruptEntry(problem)
    return record, data


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    cubin_path: Path
    meta: dict

    @property
    def meta_path(self) -> Path:
        return self.cubin_path.with_suffix(".json")


class CubinCache:
    """A writable root plus read-only prebuilt roots searched first.

    ``require_store``: failing to store an entry raises CacheWriteError instead of
    compiling in memory (``prebuild`` wants every kernel on disk or an error). ``named_by``:
    the setting that chose ``root``, which a refusal of it names (prebuild's ``--output``).
    """

    def __init__(
        self,
        root: Path,
        prebuilt: list[Path] | None = None,
        version: str = "",
        require_store: bool = False,
        named_by: str = CACHE_DIR_ENV,
    ):
        self.root = root
        self.prebuilt = prebuilt or []
        self.version = version
        self.require_store = require_store
        self.named_by = named_by
        self._writable: bool | None = None

    def _relative(self, arch: str, family: str, key: str) -> Path:
        return Path(self.version, arch, family, f"{key}.cubin")

    # -- reading ---------------------------------------------------------------------
    def _load_from(self, root: Path, rel: Path, label: str | None = None) -> CompiledKernel | None:
        cubin_path = root / rel
        meta_path = cubin_path.with_suffix(".json")
        if not meta_path.exists() and not meta_path.is_symlink():
            return None
        try:  # InsecureCacheError propagates: other users can write there
            named_by = self.named_by if root == self.root else CUBIN_PATH_ENV
            record, data = read_entry(root, rel, label, named_by)
        except (OSError, CorruptEntry) as exc:
            log.warning("cache entry %s is corrupt or truncated (%s); rebuilding", cubin_path, exc)
            return None
        return CompiledKernel(data, record["entry"], 0.0)

    def lookup(
        self, arch: str, family: str, key: str, label: str | None = None
    ) -> CompiledKernel | None:
        """The entry for ``key`` whose record binds it (and ``label``, when given)."""
        rel = self._relative(arch, family, key)
        for root in [*self.prebuilt, self.root]:
            found = self._load_from(root, rel, label)
            if found is not None:
                log.debug("cache hit %s in %s", rel, root)
                return found
        log.debug("cache miss %s", rel)
        return None

    # -- writing ---------------------------------------------------------------------
    def _cannot_store(self, exc: OSError) -> None:
        """Raise (require_store), or warn and go on in memory: for the rest of the process
        where the cache cannot be written at all (warned once), else for this entry."""
        if self.require_store:
            reason = exc.strerror or str(exc)
            raise CacheWriteError(f"cannot write the cache {self.root}: {reason}") from exc
        if exc.errno not in UNWRITABLE:  # a full disk, a folder removed twice meanwhile...
            log.warning(
                "cubin cache %s could not store an entry (%s); kept in memory", self.root, exc
            )
            return
        if self._writable is not False:
            log.warning(
                "cubin cache %s is not writable (%s); compiling in memory only", self.root, exc
            )
        self._writable = False

    def check_trusted(self) -> None:
        """InsecureCacheError where the root (or its version folder) exists and other users
        can write to it: checked before the first write, not only when reading back."""
        check_existing_folders(self.root, Path(self.version), self.named_by)

    def _lock(self, cubin_path: Path) -> filelock.FileLock:
        # A folder that cannot be written (read-only or immutable) must fail here, at once:
        # filelock retries some open() errors until its timeout (600 s) instead of raising.
        fd, probe = tempfile.mkstemp(dir=cubin_path.parent, prefix=".probe.", suffix=".tmp")
        os.close(fd)
        Path(probe).unlink(missing_ok=True)  # (`cache clear` may have removed it)
        lock_path = cubin_path.with_suffix(".lock")
        if remove_squatter(lock_path):
            log.warning("removed a folder or link in place of the lock file %s", lock_path)
        lock = filelock.FileLock(str(lock_path), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
        return lock

    def get_or_build(
        self,
        arch: str,
        family: str,
        key: str,
        meta: dict,
        build: Callable[[], CompiledKernel],
    ) -> tuple[CompiledKernel, bool]:
        """Return (kernel, was_built). One process builds a key; the rest wait and reuse."""
        label = meta.get("label")
        found = self.lookup(arch, family, key, label)
        if found is not None:
            return found, False
        if self._writable is False:
            return build(), True
        rel = self._relative(arch, family, key)
        cubin_path = self.root / rel
        try:
            check_existing_folders(self.root, rel.parent, self.named_by)
            make_folders(cubin_path.parent)
            # again: the folders as created here, or by another process meanwhile
            check_existing_folders(self.root, rel.parent, self.named_by)
            lock = _again_if_removed(lambda: self._lock(cubin_path), cubin_path.parent)
        except OSError as exc:
            self._cannot_store(exc)
            return build(), True
        try:
            # Another process may have finished this key while we waited for the lock.
            found = self._load_from(self.root, rel, label)
            if found is not None:
                return found, False
            kernel = build()
            try:
                _again_if_removed(lambda: self._store(cubin_path, kernel, meta), cubin_path.parent)
            except OSError as exc:
                self._cannot_store(exc)
            return kernel, True
        finally:
            lock.release()

    def _store(self, cubin_path: Path, kernel: CompiledKernel, meta: dict) -> None:
        record = {
            **meta,
            "entry": kernel.entry,
            "size": len(kernel.cubin),
            "sha256": hashlib.sha256(kernel.cubin).hexdigest(),
            "compile_seconds": round(kernel.seconds, 4),
            **({"compiler_messages": kernel.messages} if kernel.messages else {}),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        meta_path = cubin_path.with_suffix(".json")
        for path in (cubin_path, meta_path):
            if remove_squatter(path):  # os.replace cannot write over a folder
                log.warning("removed a folder or link in place of the cache file %s", path)
        # The cubin lands first and the record last: a record always names a whole cubin.
        _atomic_write(cubin_path, kernel.cubin)
        _atomic_write(meta_path, json.dumps(record, indent=1).encode())


def _again_if_removed(write: Callable[[], T], folder: Path) -> T:
    """``write()`` into ``folder``; where it fails on a missing folder (ENOENT), once more in
    the folder made anew: ``cache clear`` removes the folders it empties, and a builder may
    have made one of them a moment before (the folders above were checked then)."""
    try:
        return write()
    except FileNotFoundError:
        make_folders(folder)
        return write()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
