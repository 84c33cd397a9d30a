"""The compiled kernel launcher (``_launcher.c``): built on first use, cached, optional.

``launcher()`` is the extension module, or None: ``FLASHINFER_JIT_NATIVE_LAUNCH=0``, no C
compiler, a failed build or import (logged once). ``LoadedKernel`` reads it when a kernel
is loaded and then launches through it, else through cuda-python; nothing here runs per
launch.

The module is compiled with the system C compiler (``$CC``, else Python's configured one
where it exists, else ``cc``) against Python's headers, into
``<cache root>/native/_launcher-<key><EXT_SUFFIX>``: the key hashes the sources (the C file
and the header it includes) and the flags, EXT_SUFFIX names the Python ABI. Prebuilt
bundles (FLASHINFER_JIT_CUBIN_PATH, ``flashinfer-jit prebuild --output``) are searched
first, then the cache, as for cubins; one ``filelock`` per file lets concurrent processes
build it once, and directories other users can write to are refused (a shared object is
code). A record beside it (``<name>.json``: size and sha256) is written last; a launcher
that does not match its record (truncated, overwritten, a folder in its place) is not
loaded: the cache's copy is rebuilt, a bundle's is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import filelock

from .cache import LOCK_TIMEOUT_S, default_cache_root, prebuilt_roots
from .cache_record import (
    CUBIN_MAX_BYTES,
    RECORD_MAX_BYTES,
    TEMP_TAIL,
    check_owner_and_mode,
    make_folders,
    read_file,
    remove_squatter,
)
from .spec import sha256_hex

log = logging.getLogger("flashinfer_jit.jit")

NATIVE_ENV = "FLASHINFER_JIT_NATIVE_LAUNCH"
SOURCE = Path(__file__).with_name("_launcher.c")
HEADERS = (
    SOURCE.with_name("_launcher_bound.h"),
    SOURCE.with_name("_launcher_driver.h"),
)  # in the key
# -O1: a cold first call waits for this build where its kernel compiles faster (the pack's
# 0.12 s NVRTC against the C compiler's ~0.45 s on the H200 host). On the CPU machine -O1
# builds in 0.19-0.25 s against -O2's 0.25-0.34, and a bound launch through a stand-in
# libcuda takes 230-255 ns either way (session 25; H200 figures pending).
FLAGS = ("-O1", "-shared", "-fPIC")
LIBS = ("-ldl",)  # dlopen: in libc since glibc 2.34, in libdl before
BUILD_TIMEOUT_S = 120.0
FOLDER = "native"
# The names build() writes in FOLDER, of any key and Python ABI: the launcher, its record
# and lock, and the temporary files of the first two (``cache clear`` removes only these).
_NAME = r"_launcher-[0-9a-f]{16}(\.[0-9A-Za-z_-]+)?\.so"
NAMES = re.compile(rf"(?P<name>{_NAME})(\.json|\.lock)?|\.(?P<temp>{_NAME})(\.json)?{TEMP_TAIL}")


class NativeBuildError(RuntimeError):
    """The launcher could not be compiled (``no_compiler``: none was found)."""

    def __init__(self, message: str, no_compiler: bool = False):
        super().__init__(message)
        self.no_compiler = no_compiler


def compiler() -> list[str]:
    """The C compiler command: $CC, else Python's configured CC if it exists, else cc."""
    chosen = os.environ.get("CC")
    if chosen:
        return shlex.split(chosen)
    configured = shlex.split(sysconfig.get_config_var("CC") or "")
    return configured if configured and shutil.which(configured[0]) else ["cc"]


def file_name() -> str:
    sources = (path.read_bytes() for path in (SOURCE, *HEADERS))
    key = sha256_hex(*sources, *FLAGS, *LIBS)[:16]
    return f"_launcher-{key}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def launcher_problem(path: Path) -> str | None:
    """None when the launcher at ``path`` matches the record written beside it."""
    try:
        record = json.loads(read_file(_record_path(path), RECORD_MAX_BYTES)[0])
        data = read_file(path, CUBIN_MAX_BYTES)[0]
    except (OSError, ValueError) as exc:  # CorruptEntry (a link, a FIFO, too large) too
        return f"launcher or its record unreadable ({exc})"
    if not isinstance(record, dict) or record.get("size") != len(data):
        return "launcher size differs from its record"
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        return "launcher sha256 differs from its record"
    return None


def launchers(root: Path) -> list[Path]:
    """The launchers under ``root`` (any key and Python ABI), records and locks aside."""
    folder = root / FOLDER
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(
        p for p in folder.glob("_launcher-*") if not p.name.endswith((".json", ".lock", ".tmp"))
    )


def _trusted(root: Path, path: Path) -> bool:
    """Whether an intact launcher is at ``path`` (``root``/native/name); InsecureCacheError
    where it, or a folder above it, can be written by other users."""
    if not path.exists():
        return False
    for checked in (root, root / FOLDER, path):
        check_owner_and_mode(checked)
    problem = launcher_problem(path)
    if problem is not None:
        log.warning("native launcher %s is corrupt (%s)", path, problem)
        return False
    return True


def find() -> Path | None:
    """The built launcher in a prebuilt bundle or the cache, if any."""
    name = file_name()
    for root in (*prebuilt_roots(), default_cache_root()):
        if _trusted(root, root / FOLDER / name):
            return root / FOLDER / name
    return None


def _compile(target: Path) -> None:
    include = sysconfig.get_paths()["include"]
    command = [*compiler(), *FLAGS, f"-I{include}", str(SOURCE), "-o", str(target), *LIBS]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except FileNotFoundError as exc:
        raise NativeBuildError(f"no C compiler ({exc})", no_compiler=True) from exc
    except subprocess.TimeoutExpired as exc:
        raise NativeBuildError(f"{shlex.join(command)} ran over {BUILD_TIMEOUT_S:.0f} s") from exc
    if run.returncode != 0:
        output = (run.stderr + run.stdout).strip()[-2000:]
        raise NativeBuildError(f"{shlex.join(command)} failed ({run.returncode}): {output}")


def build(root: Path) -> tuple[Path, bool]:
    """(path, built now) of the launcher under ``root``, compiled unless it is there."""
    folder, name = root / FOLDER, file_name()
    path = folder / name
    for checked in (root, folder):  # before anything is written, built or loaded there
        if checked.exists():
            check_owner_and_mode(checked)
    make_folders(folder)
    check_owner_and_mode(folder)
    if _trusted(root, path):
        return path, False
    remove_squatter(folder / f"{name}.lock")
    with filelock.FileLock(str(folder / f"{name}.lock"), timeout=LOCK_TIMEOUT_S):
        if _trusted(root, path):  # another process built it while we waited
            return path, False
        start = time.perf_counter()
        fd, temp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            _compile(Path(temp))
            os.chmod(temp, 0o755)
            remove_squatter(path)  # os.replace cannot write over a folder
            os.replace(temp, path)
            data = path.read_bytes()
            record = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            _write_record(_record_path(path), record)
        finally:
            Path(temp).unlink(missing_ok=True)
    log.info("compiled the native launcher %s in %.2f s", path, time.perf_counter() - start)
    return path, True


def _write_record(path: Path, record: dict) -> None:
    remove_squatter(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(temp, path)


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("jit_kernels._launcher", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resolve() -> ModuleType | None:
    try:
        path = find() or build(default_cache_root())[0]
        return load(path)
    except NativeBuildError as exc:
        level = logging.INFO if exc.no_compiler else logging.WARNING
        log.log(level, "native launcher unavailable, launching through cuda-python: %s", exc)
    except Exception as exc:  # an unwritable or insecure cache, a failed import: fall back
        log.warning("native launcher unavailable, launching through cuda-python: %r", exc)
    return None


_resolved: list[ModuleType | None] = []  # [the launcher or None] once resolved
_lock = threading.Lock()


def resolve_in_background() -> None:
    """Start resolving the launcher on a thread unless it is resolved or switched off: a
    build (the C compiler, ~0.3 s) then overlaps what the caller does next, a kernel's
    NVRTC compile on a first call; ``launcher()`` waits for it (``_lock``)."""
    if _resolved or _started or os.environ.get(NATIVE_ENV) == "0":
        return
    _started.append(True)
    threading.Thread(target=launcher, name="flashinfer-jit-launcher", daemon=True).start()


_started: list[bool] = []  # resolve_in_background ran (one thread per process)


def _built() -> bool:
    """Whether resolving needs no build: none under way and one found (an unreadable or
    insecure cache counts as found: ``launcher`` then logs why it falls back, at once)."""
    if _started:
        return False
    try:
        return find() is not None
    except Exception:  # noqa: BLE001 (_resolve reports it)
        return True


def launcher(wait: bool = True) -> ModuleType | None:
    """The launcher module, built or found on the first call of the process; None when
    switched off (FLASHINFER_JIT_NATIVE_LAUNCH=0, read per call) or unavailable.

    Without ``wait``, a launcher that must be built first is not waited for: None, its build
    started on a thread. For driver calls cuda-python makes as well, made before a first
    call's compile (QSA's cluster occupancy): that compile then overlaps the C compiler
    (~0.45 s on the H200 host and here) instead of following it. A launcher already built (a
    bundle, the cache: a warm first call) is loaded and returned as with ``wait``."""
    if os.environ.get(NATIVE_ENV) == "0":
        return None
    if not _resolved and not wait and not _built():
        resolve_in_background()
        return None
    if not _resolved:
        with _lock:
            if not _resolved:
                _resolved.append(_resolve())
    return _resolved[0]
