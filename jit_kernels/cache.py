"""On-disk cubin cache: one plain .cubin plus a JSON record per key, shared safely.

Layout: ``<root>/<package version>/<arch>/<family>/<key>.cubin`` and ``<key>.json``.
Bundles written by ``prebuild --output`` have the same layout, so a bundle directory
can be listed in ``FLASHINFER_JIT_CUBIN_PATH`` as it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import filelock
import platformdirs

from .compile import CompiledKernel

log = logging.getLogger("flashinfer_jit.jit")

CACHE_DIR_ENV = "FLASHINFER_JIT_CACHE_DIR"
CUBIN_PATH_ENV = "FLASHINFER_JIT_CUBIN_PATH"
LOCK_TIMEOUT_S = 600.0


class InsecureCacheError(RuntimeError):
    """A cache directory other users can write to: its cubins cannot be trusted."""


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env) if env else Path(platformdirs.user_cache_dir("flashinfer-jit"))


def prebuilt_roots() -> list[Path]:
    return [Path(p) for p in os.environ.get(CUBIN_PATH_ENV, "").split(":") if p]


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    cubin_path: Path
    meta: dict

    @property
    def meta_path(self) -> Path:
        return self.cubin_path.with_suffix(".json")


def _check_owner_and_mode(path: Path) -> None:
    st = path.stat()
    if st.st_mode & stat.S_IWOTH and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise InsecureCacheError(
            f"refusing to load cubins from {path}: it is writable by other users "
            f"(mode {stat.filemode(st.st_mode)}); a cubin is executable code. "
            f"Run `chmod o-w {path}` or point {CACHE_DIR_ENV} elsewhere."
        )
    if st.st_uid not in (os.getuid(), 0):
        raise InsecureCacheError(
            f"refusing to load cubins from {path}: it is owned by uid {st.st_uid}, "
            f"neither you nor root; a cubin is executable code."
        )


class CubinCache:
    """A writable root plus read-only prebuilt roots searched first."""

    def __init__(self, root: Path, prebuilt: list[Path] | None = None, version: str = ""):
        self.root = root
        self.prebuilt = prebuilt or []
        self.version = version
        self._writable: bool | None = None

    def _relative(self, arch: str, family: str, key: str) -> Path:
        return Path(self.version, arch, family, f"{key}.cubin")

    # -- reading ---------------------------------------------------------------------
    def _load_from(self, root: Path, rel: Path) -> CompiledKernel | None:
        cubin_path = root / rel
        meta_path = cubin_path.with_suffix(".json")
        if not meta_path.exists():
            return None
        folder = root
        _check_owner_and_mode(folder)
        for part in rel.parent.parts:
            folder = folder / part
            _check_owner_and_mode(folder)
        try:
            _check_owner_and_mode(cubin_path)
            meta = json.loads(meta_path.read_text())
            data = cubin_path.read_bytes()
        except (OSError, ValueError) as exc:
            log.warning("cache entry %s unreadable (%s); rebuilding", cubin_path, exc)
            return None
        if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            log.warning("cache entry %s is corrupt or truncated; rebuilding", cubin_path)
            return None
        return CompiledKernel(data, meta["entry"], 0.0)

    def lookup(self, arch: str, family: str, key: str) -> CompiledKernel | None:
        rel = self._relative(arch, family, key)
        for root in [*self.prebuilt, self.root]:
            found = self._load_from(root, rel)
            if found is not None:
                log.debug("cache hit %s in %s", rel, root)
                return found
        log.debug("cache miss %s", rel)
        return None

    # -- writing ---------------------------------------------------------------------
    def _warn_unwritable(self, exc: OSError) -> None:
        if self._writable is not False:
            log.warning(
                "cubin cache %s is not writable (%s); compiling in memory only", self.root, exc
            )
        self._writable = False

    def get_or_build(
        self, arch: str, family: str, key: str, meta: dict, build: Callable[[], CompiledKernel]
    ) -> tuple[CompiledKernel, bool]:
        """Return (kernel, was_built). One process builds a key; the rest wait and reuse."""
        found = self.lookup(arch, family, key)
        if found is not None:
            return found, False
        if self._writable is False:
            return build(), True
        cubin_path = self.root / self._relative(arch, family, key)
        try:
            cubin_path.parent.mkdir(parents=True, exist_ok=True)
            lock = filelock.FileLock(str(cubin_path.with_suffix(".lock")), timeout=LOCK_TIMEOUT_S)
            lock.acquire()
        except OSError as exc:
            self._warn_unwritable(exc)
            return build(), True
        try:
            # Another process may have finished this key while we waited for the lock.
            found = self._load_from(self.root, self._relative(arch, family, key))
            if found is not None:
                return found, False
            kernel = build()
            try:
                self._store(cubin_path, kernel, meta)
            except OSError as exc:
                self._warn_unwritable(exc)
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
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        # The cubin lands first and the record last: a record always names a whole cubin.
        _atomic_write(cubin_path, kernel.cubin)
        _atomic_write(cubin_path.with_suffix(".json"), json.dumps(record, indent=1).encode())

    # -- maintenance (CLI) -----------------------------------------------------------
    def entries(self, root: Path | None = None) -> Iterator[CacheEntry]:
        base = (root or self.root) / self.version
        for meta_path in sorted(base.glob("*/*/*.json")):
            try:
                meta = json.loads(meta_path.read_text())
            except (OSError, ValueError):
                meta = {}
            yield CacheEntry(meta_path.with_suffix(".cubin"), meta)

    @staticmethod
    def verify(entry: CacheEntry) -> str | None:
        """None when the entry is intact, else what is wrong with it."""
        try:
            data = entry.cubin_path.read_bytes()
        except OSError as exc:
            return f"unreadable cubin ({exc})"
        if len(data) != entry.meta.get("size"):
            return f"size {len(data)} != recorded {entry.meta.get('size')}"
        if hashlib.sha256(data).hexdigest() != entry.meta.get("sha256"):
            return "sha256 mismatch"
        return None


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
