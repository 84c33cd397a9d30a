"""The cache never serves a wrong kernel, never deletes what it does not own, and repairs
what it finds broken (issue 19, items 1-4 and 6)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import filelock
import pytest

from jit_kernels import (
    CompiledKernel,
    CubinCache,
    InsecureCacheError,
    KernelBuilder,
    KernelSpec,
    cache_admin,
    cache_record,
    native,
)
from jit_kernels import build as build_mod
from jit_kernels.cache_record import CorruptEntry, parse_record

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
VERSION = "9.9.9"
SPEC = KernelSpec(
    "mla_kv_pack", "mla_kv_pack/sm90_warp_cvt.cuh", "fij_mla::concat_mla_kv_quant_fp8",
    (("num_heads", 0), ("unroll", 4)),
)  # fmt: skip
OTHER = KernelSpec(SPEC.family, SPEC.template, SPEC.kernel, (("num_heads", 12), ("unroll", 6)))


def _builder(root: Path) -> KernelBuilder:
    return KernelBuilder(TEMPLATES, VERSION, CubinCache(root, [], VERSION))


def _entry(root: Path, spec: KernelSpec, arch: str = "sm_90a") -> Path:
    key = _builder(root).cache_key(spec, arch)
    return root / VERSION / arch / spec.family / f"{key}.cubin"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A cache holding SPEC and OTHER for sm_90a (compiled once for the module)."""
    root = tmp_path_factory.mktemp("built") / "cache"
    for spec in (SPEC, OTHER):
        _builder(root).build(spec, "sm_90a")
    return root


@pytest.fixture
def cache(built, tmp_path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(built, root)
    return root


# -- item 2: a record binds its key, label and cubin -------------------------------------
def test_an_entry_copied_under_another_key_is_not_served(cache, caplog):
    a, b = _entry(cache, SPEC), _entry(cache, OTHER)
    for suffix in (".cubin", ".json"):
        shutil.copy(a.with_suffix(suffix), b.with_suffix(suffix))
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        kernel, compiled = _builder(cache).build(OTHER, "sm_90a")
    assert compiled, "served SPEC's cubin as OTHER"
    assert "record key" in caplog.text
    assert json.loads(b.with_suffix(".json").read_text())["label"] == OTHER.label


def test_an_entry_copied_into_another_family_or_arch_is_not_served(cache):
    a = _entry(cache, SPEC)
    for folder in (
        a.parent.parent / "other_family",
        a.parent.parent.parent / "sm_100a" / SPEC.family,
    ):
        folder.mkdir(parents=True, exist_ok=True)
        for suffix in (".cubin", ".json"):
            shutil.copy(a.with_suffix(suffix), (folder / a.name).with_suffix(suffix))
    store = CubinCache(cache, [], VERSION)
    key = a.stem
    assert store.lookup("sm_90a", SPEC.family, key, SPEC.label) is not None
    assert store.lookup("sm_90a", "other_family", key) is None
    assert store.lookup("sm_100a", SPEC.family, key) is None
    assert store.lookup("sm_90a", SPEC.family, key, OTHER.label) is None  # label bound too


def test_verify_reports_a_renamed_entry(cache):
    a = _entry(cache, SPEC)
    renamed = a.with_name("0" * 64 + ".cubin")
    for suffix in (".cubin", ".json"):
        a.with_suffix(suffix).rename(renamed.with_suffix(suffix))
    problems = {
        e.cubin_path.name: cache_admin.verify(e)
        for e in cache_admin.entries(CubinCache(cache, [], VERSION))
    }
    assert "record key" in problems[renamed.name].what
    assert list(problems.values()).count(None) == 1  # OTHER is still fine


def test_a_record_naming_another_entry_is_not_served(cache, caplog):
    """The record's entry symbol was never checked: one naming a symbol the cubin does not
    define was served, and on a GPU its lookup failed and was remembered as unavailable."""
    meta_path = _entry(cache, SPEC).with_suffix(".json")
    record = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**record, "entry": "bogus"}))
    (bad,) = [
        e
        for e in cache_admin.entries(CubinCache(cache, [], VERSION))
        if e.meta == {**record, "entry": "bogus"}
    ]
    assert "not a symbol" in cache_admin.verify(bad).what
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        kernel, compiled = _builder(cache).build(SPEC, "sm_90a")
    assert compiled and "not a symbol" in caplog.text and kernel.entry == record["entry"]


@pytest.mark.parametrize("where", ["cubin", "family folder"])
def test_verify_reports_what_loading_refuses(cache, where):
    """verify said 0 bad for a cubin other users can write to, which loading refuses."""
    cubin = _entry(cache, SPEC)
    (cubin if where == "cubin" else cubin.parent).chmod(0o666 if where == "cubin" else 0o777)
    with pytest.raises(InsecureCacheError):
        CubinCache(cache, [], VERSION).lookup("sm_90a", SPEC.family, cubin.stem)
    problems = {
        e.cubin_path: cache_admin.verify(e)
        for e in cache_admin.entries(CubinCache(cache, [], VERSION))
    }
    bad = {path for path, found in problems.items() if found and found.refused}
    assert bad == ({cubin} if where == "cubin" else set(problems)) and len(problems) == 2
    assert all("writable by other users" in problems[path].what for path in bad)


# -- item 3: a record of the wrong shape is a corrupt entry ---------------------------------
@pytest.mark.parametrize("text", ["null", "[]", "{}", '"x"', "{not json", '{"size": true}'])
def test_malformed_records_are_rejected(text):
    with pytest.raises(CorruptEntry):
        parse_record(text)


@pytest.mark.parametrize("mutate", ["null", "[]", "drop entry", "size bool"])
def test_a_malformed_record_is_rebuilt_and_verified_bad(cache, mutate, caplog):
    meta_path = _entry(cache, SPEC).with_suffix(".json")
    record = json.loads(meta_path.read_text())
    if mutate == "drop entry":
        del record["entry"]
    elif mutate == "size bool":
        record["size"] = True
    text = mutate if mutate in ("null", "[]") else json.dumps(record)
    meta_path.write_text(text)
    (bad,) = [
        e for e in cache_admin.entries(CubinCache(cache, [], VERSION)) if e.meta_path == meta_path
    ]
    assert cache_admin.verify(bad) is not None
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        _, compiled = _builder(cache).build(SPEC, "sm_90a")
    assert compiled and "corrupt" in caplog.text
    assert parse_record(meta_path.read_text())["entry"]
    assert _builder(cache).build(SPEC, "sm_90a")[1] is False  # the rebuilt entry serves


# -- item 4: folders where files go ---------------------------------------------------------
@pytest.mark.parametrize("suffix", [".cubin", ".json", ".lock"])
def test_a_folder_in_place_of_a_file_is_replaced(cache, suffix, caplog):
    path = _entry(cache, SPEC).with_suffix(suffix)
    path.unlink(missing_ok=True)
    (path / "inside").mkdir(parents=True)
    if suffix == ".lock":  # a whole entry is served without its lock: make it rebuild
        path.with_suffix(".json").unlink()
    builder = _builder(cache)
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        kernel, _ = builder.build(SPEC, "sm_90a")
    assert "not writable" not in caplog.text  # not mistaken for an unwritable cache
    assert not path.is_dir()
    assert builder.cache._writable is not False
    reloaded, compiled = _builder(cache).build(SPEC, "sm_90a")
    assert not compiled and reloaded.cubin == kernel.cubin


def test_verify_reports_a_lock_folder(cache):
    lock = _entry(cache, SPEC).with_suffix(".lock")
    lock.unlink(missing_ok=True)
    lock.mkdir()
    found = cache_admin.other_problems(CubinCache(cache, [], VERSION), cache)
    assert [p.what for p in found if p.path == lock] == ["lock path is a folder"]


# -- item 6: a folder others can write to is refused before the first write ----------------
def test_a_world_writable_empty_cache_is_refused_before_writing(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(InsecureCacheError, match="writable by other users"):
        _builder(root).build(SPEC, "sm_90a")
    assert list(root.iterdir()) == []


def test_a_world_writable_family_folder_is_refused_before_writing(tmp_path):
    folder = tmp_path / "cache" / VERSION / "sm_90a" / SPEC.family
    folder.mkdir(parents=True)
    folder.chmod(folder.stat().st_mode | stat.S_IWOTH)
    with pytest.raises(InsecureCacheError):
        _builder(tmp_path / "cache").build(SPEC, "sm_90a")
    assert list(folder.iterdir()) == []


def test_folders_made_under_umask_000_are_not_writable_by_others(tmp_path):
    """mkdir -p under umask 000 gives 0o777 folders, which the cache then refused: every
    first compile raised InsecureCacheError and prebuild failed every kernel."""
    root = tmp_path / "new" / "cache"
    stand_in = CompiledKernel(b"\x7fELF stand-in entry\0", "entry", 0.0)
    store = CubinCache(root, [], VERSION)
    meta = {"key": "a" * 64, "family": "fam", "label": "x", "arch": "sm_90a", "version": VERSION}
    old = os.umask(0)
    try:
        _, built = store.get_or_build("sm_90a", "fam", "a" * 64, meta, lambda: stand_in)
        native.build(root)
    finally:
        os.umask(old)
    assert built and store._writable is not False
    folders = [root.parent, *(p for p in root.parent.rglob("*") if p.is_dir())]
    assert len(folders) == 6 and all(p.stat().st_mode & 0o777 == 0o755 for p in folders)
    assert store.lookup("sm_90a", "fam", "a" * 64, "x") == stand_in


# -- item 1: clear removes only what the package wrote --------------------------------------
def _plant(root: Path) -> list[Path]:
    """Files no cubin cache wrote, under and beside the cache's own folders."""
    planted = [
        root / "notes.txt",
        root / VERSION / "README",
        root / VERSION / "sm_90a" / "keep.bin",
        root / VERSION / "sm_90a" / SPEC.family / "mine.cubin",
        root / "native" / "other.so",
        root / "data" / "model.bin",
    ]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("user data")
    return planted


def test_clear_removes_only_its_own_entries(cache):
    planted = _plant(cache)
    outside = cache.parent / "outside"
    outside.mkdir()
    (outside / "precious").write_text("x")
    (cache / VERSION / "sm_90a" / "link").symlink_to(outside)
    own = [p for p in cache.rglob("*") if p.is_file() and len(p.stem) == 64]
    size = sum(p.stat().st_size for p in own)
    report = cache_admin.clear(cache)
    assert report.files == len(own) > 0 and report.bytes == size
    assert all(p.read_text() == "user data" for p in planted)
    assert (outside / "precious").exists() and cache.exists()
    assert not any(p.suffix in (".cubin", ".json") and len(p.stem) == 64 for p in cache.rglob("*"))


def test_clear_one_arch_leaves_the_others(cache):
    other = cache / VERSION / "sm_100a" / SPEC.family
    other.mkdir(parents=True)
    kept = other / ("a" * 64 + ".cubin")
    kept.write_bytes(b"x")
    report = cache_admin.clear(cache, ("sm_90a",))
    assert report.files > 0 and kept.exists()
    assert not (cache / VERSION / "sm_90a").exists()  # emptied, so removed


def test_clear_keeps_what_only_looks_like_entries(cache):
    """Names of the cache's shapes that it did not write: a record that is not one, a
    launcher-like name, an empty folder it never wrote (all removed before)."""
    planted = [
        cache / "2024" / "sm_90" / "notes" / ("a" * 64 + ".json"),
        cache / "native" / "_launcher-0123456789abcdef-notes.txt",
        cache / VERSION / "sm_90a" / SPEC.family / ("b" * 64 + ".lock"),  # not empty
    ]
    for path in planted:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("user data")
    empty = cache / "3" / "sm_80" / "fam"
    empty.mkdir(parents=True)
    report = cache_admin.clear(cache)
    assert report.files > 0 and report.kept == len(planted)
    assert all(p.read_text() == "user data" for p in planted) and empty.is_dir()
    assert not list(cache.rglob("*.cubin"))


def test_clear_through_a_linked_root(cache, tmp_path):
    """A root that is a link (the user named it) was never entered: 0 files removed."""
    link = tmp_path / "link"
    link.symlink_to(cache)
    files = len([p for p in cache.rglob("*") if p.is_file()])
    assert cache_admin.clear(link, remove=False).files == files > 0
    assert cache_admin.clear(link).files == files and not list(cache.rglob("*.cubin"))


@pytest.mark.parametrize("bundle", [".", "..", "9.9.9"])
def test_clear_refuses_a_prebuilt_root(cache, bundle):
    """A bundle listed in FLASHINFER_JIT_CUBIN_PATH that is, holds or sits in the root."""
    files = sorted(cache.rglob("*"))
    with pytest.raises(ValueError, match="prebuilt bundle"):
        cache_admin.clear(cache, keep=[cache / bundle])
    assert sorted(cache.rglob("*")) == files


# -- a clear during a build ---------------------------------------------------------------
def test_clear_during_a_build_leaves_its_lock(cache, monkeypatch):
    """clear unlinked the lock a builder held (a second process then took it too) and
    pruned the folder, so the store failed and the cache was off for the process."""
    cubin = _entry(cache, SPEC)
    for suffix in (".cubin", ".json"):
        cubin.with_suffix(suffix).unlink()
    real, reports = build_mod.compile_cubin, []

    def compile_and_clear(rendered, arch):
        reports.append(cache_admin.clear(cache))
        with pytest.raises(filelock.Timeout):
            filelock.FileLock(str(cubin.with_suffix(".lock")), timeout=0).acquire()
        return real(rendered, arch)

    monkeypatch.setattr(build_mod, "compile_cubin", compile_and_clear)
    builder = _builder(cache)
    builder.build(SPEC, "sm_90a")
    assert reports[0].busy == 1 and reports[0].files > 0  # OTHER's entry went
    assert builder.cache._writable is not False
    assert _builder(cache).build(SPEC, "sm_90a")[1] is False


def test_a_store_into_a_folder_removed_meanwhile_is_retried(cache, monkeypatch, caplog):
    """ENOENT on storing (a clear pruned the folder) made the cache in-memory for good."""
    cubin = _entry(cache, SPEC)
    for suffix in (".cubin", ".json"):
        cubin.with_suffix(suffix).unlink()
    real = build_mod.compile_cubin

    def compile_and_remove(rendered, arch):
        shutil.rmtree(cubin.parent.parent.parent)
        return real(rendered, arch)

    monkeypatch.setattr(build_mod, "compile_cubin", compile_and_remove)
    builder = _builder(cache)
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        builder.build(SPEC, "sm_90a")
    assert builder.cache._writable is not False and not caplog.text
    assert cubin.exists() and _builder(cache).build(SPEC, "sm_90a")[1] is False


# -- a cache file is read only where it is a regular file of a bounded size -------------------
@pytest.mark.parametrize("suffix", [".json", ".cubin"])
@pytest.mark.parametrize("kind", ["link to /dev/zero", "fifo", "huge"])
def test_a_cache_file_not_a_small_regular_file_is_a_bad_entry(cache, tmp_path, suffix, kind):
    """A record linked to /dev/zero ran `cache list` out of memory; a FIFO hung it."""
    path = _entry(cache, SPEC).with_suffix(suffix)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "huge":  # sparse: over the cap without taking the disk space
        cap = {".json": cache_record.RECORD_MAX_BYTES, ".cubin": cache_record.CUBIN_MAX_BYTES}
        with path.open("wb") as f:
            f.truncate(cap[suffix] + 1)
    else:
        path.symlink_to("/dev/zero")
    bundle_only = CubinCache(tmp_path / "empty", [cache], VERSION)
    assert bundle_only.lookup("sm_90a", SPEC.family, path.stem, SPEC.label) is None  # skipped
    (bad,) = [e for e in cache_admin.entries(bundle_only, cache) if e.cubin_path.stem == path.stem]
    words = {"fifo": "not a regular file", "huge": "bytes, over", "link to /dev/zero": "a link"}
    assert words[kind] in cache_admin.verify(bad).what
    assert _builder(cache).build(SPEC, "sm_90a")[1] and stat.S_ISREG(path.lstat().st_mode)


def test_verify_of_a_launcher_record_that_is_a_fifo_does_not_hang(tmp_path):
    launcher = tmp_path / native.FOLDER / "_launcher-0123456789abcdef.so"
    launcher.parent.mkdir()
    launcher.write_bytes(b"\x7fELF")
    os.mkfifo(launcher.with_name(launcher.name + ".json"))
    assert "not a regular file" in native.launcher_problem(launcher)
