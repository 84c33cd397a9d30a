"""The JSON record beside each cached cubin, and the file-system rules the cache keeps.

A record binds its entry: the cache key (which is also the file name), the spec label,
the family and arch (which are also the folders), the package version (the top folder),
the cubin's size and sha256, and its entry symbol (which the cubin must name). An entry
copied or renamed under another key, family, arch or version no longer matches its record,
so it is never served as another kernel.
A record that does not parse into this shape is a corrupt entry, like a bad checksum.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

CACHE_DIR_ENV = "FLASHINFER_JIT_CACHE_DIR"

# Field -> type; ints are checked as "int and not bool" (JSON true is not a size).
RECORD_FIELDS: dict[str, type] = {
    "key": str,
    "family": str,
    "label": str,
    "arch": str,
    "version": str,
    "entry": str,
    "size": int,
    "sha256": str,
}
_HEX64 = re.compile(r"[0-9a-f]{64}")
# The tail of the name of a temporary file the cache writes: tempfile.mkstemp's 8 random
# characters, then the suffix given (``cache clear`` tells its own temporary files by it).
TEMP_TAIL = r"\.[a-z0-9_]{8}\.tmp"
# The most the cache reads of one file (read_file), so a wrong file costs no more: a record
# linked to /dev/zero ran `cache list` out of memory. A record is under 1 KB (more where it
# keeps ptxas's warnings, compiler_messages): 1 MiB is a wide margin. The largest cubin seen
# is 0.9 MB, the native launcher 32 KB: 256 MiB only bounds a file that is neither.
RECORD_MAX_BYTES = 1 << 20
CUBIN_MAX_BYTES = 256 << 20
# Never through a link (O_NOFOLLOW), never waiting on a FIFO without a writer (O_NONBLOCK:
# the open returns at once, and fstat then refuses it), where the platform has the flags.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


class InsecureCacheError(RuntimeError):
    """A cache directory other users can write to: its cubins cannot be trusted."""


class CorruptEntry(ValueError):
    """A cache record or cubin that is not what the cache wrote (the message says why)."""


def parse_record(text: str) -> dict:
    """The record in ``text``; CorruptEntry when it is not a record of the expected shape."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise CorruptEntry(f"record is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise CorruptEntry(f"record is a JSON {type(record).__name__}, not an object")
    for field, kind in RECORD_FIELDS.items():
        value = record.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorruptEntry(f"record field {field!r} is missing or not a {kind.__name__}")
    if not _HEX64.fullmatch(record["sha256"]) or not _HEX64.fullmatch(record["key"]):
        raise CorruptEntry("record key or sha256 is not 64 lowercase hex digits")
    return record


def read_file(path: Path, limit: int) -> tuple[bytes, os.stat_result]:
    """(the bytes of ``path``, its stat) where it is a regular file of at most ``limit``
    bytes; CorruptEntry where it is a link, a FIFO, a device, a folder or larger (it is
    opened first, so nothing blocks or is read); OSError where it cannot be opened."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW says of a link
            raise CorruptEntry(f"{path.name} is a link (not followed)") from None
        raise
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            mode = stat.filemode(st.st_mode)
            raise CorruptEntry(f"{path.name} is not a regular file (mode {mode})")
        if st.st_size > limit:
            raise CorruptEntry(f"{path.name} is {st.st_size} bytes, over the {limit} read")
        return file.read(limit), st  # a file grown since fstat: cut, then a bad checksum


def read_record(meta_path: Path) -> dict:
    """parse_record of a file; CorruptEntry also when it cannot be read (e.g. a folder)."""
    try:
        return parse_record(read_file(meta_path, RECORD_MAX_BYTES)[0].decode())
    except (OSError, UnicodeDecodeError) as exc:
        raise CorruptEntry(f"record unreadable ({exc})") from None


def binding_problem(record: dict, expected: dict[str, str]) -> str | None:
    """What in ``record`` differs from ``expected`` (field -> value), else None."""
    for field, want in expected.items():
        if record.get(field) != want:
            return f"record {field} {record.get(field)!r} is not this entry's {want!r}"
    return None


def cubin_problem(record: dict, data: bytes) -> str | None:
    import hashlib

    if len(data) != record["size"]:
        return f"size {len(data)} != recorded {record['size']}"
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return "sha256 mismatch"
    # The entry is looked up by name on load: one the cubin does not define would fail
    # there, and be remembered as unavailable, instead of being rebuilt here.
    if record["entry"].encode() + b"\0" not in data:
        return f"record entry {record['entry']!r} is not a symbol of the cubin"
    return None


def check_owner_and_mode(
    path: Path, st: os.stat_result | None = None, named_by: str = CACHE_DIR_ENV
) -> None:
    """InsecureCacheError where ``path`` can be written by other users (a folder with the
    sticky bit excepted) or is owned by someone other than the user or root. ``st``: its
    stat where the caller has it (that of the file it opened and read). ``named_by``: the
    setting that chose the folder (prebuild's ``--output``...), which the error names."""
    st = path.stat() if st is None else st
    if st.st_mode & stat.S_IWOTH and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        raise InsecureCacheError(
            f"refusing to use {path}: it is writable by other users "
            f"(mode {stat.filemode(st.st_mode)}); a cubin is executable code. "
            f"Run `chmod o-w {path}` or point {named_by} elsewhere."
        )
    if st.st_uid not in (os.getuid(), 0):
        raise InsecureCacheError(
            f"refusing to use {path}: it is owned by uid {st.st_uid}, "
            f"neither you nor root; a cubin is executable code."
        )


def check_existing_folders(root: Path, rel_folder: Path, named_by: str = CACHE_DIR_ENV) -> None:
    """check_owner_and_mode on ``root`` and each folder of ``rel_folder`` that exists, so a
    folder other users can write to is refused before anything is written into it."""
    folder = root
    for part in ("", *rel_folder.parts):
        folder = folder / part if part else folder
        if not folder.exists():
            return
        check_owner_and_mode(folder, named_by=named_by)


def make_folders(folder: Path) -> None:
    """``mkdir -p folder``, each folder it creates with mode 0o755 narrowed by the umask: a
    plain ``mkdir(parents=True)`` under umask 000 makes folders other users can write to,
    which the cache then refuses (check_owner_and_mode). Folders that exist keep their mode."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o755)
        except FileExistsError:  # another process made it: checked like any found folder
            continue


def remove_squatter(path: Path) -> bool:
    """Remove a folder or link standing where the cache writes a plain file (the name is
    the cache's own). True when something was removed."""
    if path.is_symlink():
        path.unlink()
        return True
    if path.is_dir():
        shutil.rmtree(path)
        return True
    return False
