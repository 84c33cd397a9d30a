"""The JIT engine on the CPU: keys, cache safety, compile errors, prebuild output."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from jit_kernels import (
    ArgPacker,
    CompileError,
    CubinCache,
    FallbackError,
    InsecureCacheError,
    KernelBuilder,
    KernelSpec,
    fall_back,
)
from jit_kernels import compile as compile_mod

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
SPEC = KernelSpec(
    "mla_kv_pack",
    "mla_kv_pack/sm90_warp_cvt.cuh",
    "fij_mla::concat_mla_kv_quant_fp8",
    (("num_heads", 0), ("unroll", 4)),
)


def _builder(root: Path, templates: Path = TEMPLATES, version: str = "9.9.9") -> KernelBuilder:
    return KernelBuilder(templates, version, CubinCache(root, [], version))


def _cubin_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.cubin"))


# -- keys ------------------------------------------------------------------------------
def test_key_is_stable(tmp_path):
    a = _builder(tmp_path / "a").cache_key(SPEC, "sm_90a")
    b = _builder(tmp_path / "b").cache_key(SPEC, "sm_90a")
    assert a == b and len(a) == 64


def test_key_changes_with_every_input(tmp_path, monkeypatch):
    base = _builder(tmp_path).cache_key(SPEC, "sm_90a")
    keys = {
        "params": _builder(tmp_path).cache_key(
            KernelSpec(SPEC.family, SPEC.template, SPEC.kernel, (("num_heads", 12), ("unroll", 4))),
            "sm_90a",
        ),
        "arch": _builder(tmp_path).cache_key(SPEC, "sm_100a"),
        "version": _builder(tmp_path, version="9.9.10").cache_key(SPEC, "sm_90a"),
    }
    # An included header's content is part of the key, not only the top template.
    edited = tmp_path / "templates"
    shutil.copytree(TEMPLATES, edited)
    (edited / "common.cuh").write_text((edited / "common.cuh").read_text() + "\n// edit\n")
    keys["header"] = _builder(tmp_path, templates=edited).cache_key(SPEC, "sm_90a")
    monkeypatch.setattr(compile_mod, "NVRTC_OPTIONS", (*compile_mod.NVRTC_OPTIONS, "-G"))
    keys["options"] = _builder(tmp_path).cache_key(SPEC, "sm_90a")
    monkeypatch.undo()
    monkeypatch.setattr(compile_mod, "installed_nvrtc_version", lambda: "99.0")
    keys["nvrtc"] = _builder(tmp_path).cache_key(SPEC, "sm_90a")
    for what, key in keys.items():
        assert key != base, f"the key ignores the {what}"
    assert len(set(keys.values())) == len(keys)


# -- the disk cache ----------------------------------------------------------------------
def test_a_warm_lookup_does_not_load_nvrtc(tmp_path, monkeypatch):
    """The key names the installed wheel's NVRTC: finding a cached kernel loads no library
    (the load was 121 of 127 ms of a warm first call on the H200 host)."""
    assert compile_mod.installed_nvrtc_version() == compile_mod.nvrtc_release()
    kernel, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    assert compiled

    def no_load() -> str:
        raise AssertionError("a warm lookup loaded NVRTC")

    monkeypatch.setattr(compile_mod, "nvrtc_version", no_load)
    monkeypatch.setattr(compile_mod, "nvrtc_release", no_load)
    again, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    assert not compiled and again.cubin == kernel.cubin
    assert _builder(tmp_path).lookup(SPEC, "sm_90a").cubin == kernel.cubin


def test_a_wheel_that_is_not_the_loaded_nvrtc_never_names_the_key(tmp_path, monkeypatch, caplog):
    loaded = compile_mod.nvrtc_release()
    monkeypatch.setattr(compile_mod, "installed_nvrtc_version", lambda: "98.7")
    kernel, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    assert compiled and "the installed NVRTC is" in caplog.text
    (cubin,) = _cubin_files(tmp_path)
    record = json.loads(cubin.with_suffix(".json").read_text())
    assert record["compiler"].startswith(f"nvrtc {loaded} ") and "98.7" not in record["compiler"]
    # A new process: the wheel's key misses, the loaded library's key finds it, no compile.
    again, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    assert not compiled and again.cubin == kernel.cubin
    assert len(_cubin_files(tmp_path)) == 1


def test_the_key_names_nvrtc_s_patch_release(tmp_path, monkeypatch):
    """The key named NVRTC's major.minor only: a 13.5.x patch upgrade reused the cubins of
    the release before (ptxas.py, too, takes the exact release only)."""
    real, keys = importlib.metadata.version, []
    for release in ("13.5.37", "13.5.40"):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name, r=release: r if "nvrtc" in name else real(name))  # fmt: skip
        compile_mod.installed_nvrtc_version.cache_clear()
        keys.append(_builder(tmp_path).cache_key(SPEC, "sm_90a"))
    monkeypatch.undo()
    compile_mod.installed_nvrtc_version.cache_clear()
    assert keys[0] != keys[1]


def test_cold_then_disk_then_memory(tmp_path):
    builder = _builder(tmp_path)
    kernel, compiled = builder.build(SPEC, "sm_90a")
    assert compiled and kernel.cubin[:4] == b"\x7fELF"
    assert builder.build(SPEC, "sm_90a") == (kernel, False)  # memory
    again, compiled = _builder(tmp_path).build(SPEC, "sm_90a")  # disk
    assert not compiled and again.cubin == kernel.cubin and again.entry == kernel.entry
    (cubin,) = _cubin_files(tmp_path)
    meta = json.loads(cubin.with_suffix(".json").read_text())
    assert meta["arch"] == "sm_90a" and meta["size"] == len(kernel.cubin)
    assert set(meta) >= {"key", "sha256", "entry", "compiler", "version", "label"}


_RACE = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from jit_kernels import CubinCache, KernelBuilder, KernelSpec
spec = KernelSpec("mla_kv_pack", "mla_kv_pack/sm90_warp_cvt.cuh", "fij_mla::concat_mla_kv_quant_fp8",
                  (("num_heads", 0), ("unroll", 4)))
root = Path({root!r})
builder = KernelBuilder(Path({templates!r}), "9.9.9", CubinCache(root, [], "9.9.9"))
kernel, compiled = builder.build(spec, "sm_90a")
print("compiled" if compiled else "cached", len(kernel.cubin))
"""


def test_eight_processes_one_cold_key(tmp_path):
    script = _RACE.format(repo=str(REPO), root=str(tmp_path), templates=str(TEMPLATES))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    words = [out.split()[0] for out, _ in outputs]
    assert words.count("compiled") == 1, words  # the rest waited on the lock and reused it
    assert len({out.split()[1] for out, _ in outputs}) == 1
    assert len(_cubin_files(tmp_path)) == 1
    leftovers = [
        p
        for p in tmp_path.rglob("*")
        if p.is_file() and p.suffix not in (".cubin", ".json", ".lock")
    ]
    assert leftovers == []


def test_truncated_cubin_is_rebuilt(tmp_path, caplog):
    kernel, _ = _builder(tmp_path).build(SPEC, "sm_90a")
    (cubin,) = _cubin_files(tmp_path)
    cubin.write_bytes(cubin.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        again, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    # NVRTC output is not promised to be byte-identical across compiles in one process
    # (seen once in CI after the CuTe DSL had loaded its own toolchain), so compare what
    # matters: a fresh, whole entry replaced the truncated one.
    assert compiled and again.entry == kernel.entry and again.cubin[:4] == b"\x7fELF"
    assert len(again.cubin) > 100
    assert "corrupt or truncated" in caplog.text
    assert cubin.read_bytes() == again.cubin
    reloaded, compiled = _builder(tmp_path).build(SPEC, "sm_90a")
    assert not compiled and reloaded.cubin == again.cubin


def test_on_compile_runs_before_compiles_only_and_lookup_never_compiles(tmp_path):
    builders, calls = [_builder(tmp_path), _builder(tmp_path)], []
    for builder in builders:
        builder.on_compile = lambda: calls.append("compile")
    assert builders[1].lookup(SPEC, "sm_90a") is None
    built, compiled = builders[0].build(SPEC, "sm_90a")
    assert compiled and calls == ["compile"]
    assert builders[1].lookup(SPEC, "sm_90a").cubin == built.cubin  # from disk, memoized
    assert not builders[1].build(SPEC, "sm_90a")[1] and calls == ["compile"]


def test_unwritable_cache_compiles_in_memory(tmp_path, caplog):
    # Root may write anywhere, so make the cache root impossible to create instead.
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    builder = _builder(blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        kernel, compiled = builder.build(SPEC, "sm_90a")
        builder.build(SPEC, "sm_100a")
    assert compiled and kernel.cubin[:4] == b"\x7fELF"
    assert caplog.text.count("not writable") == 1  # warned once


def test_world_writable_cache_is_refused(tmp_path):
    _builder(tmp_path).build(SPEC, "sm_90a")
    (cubin,) = _cubin_files(tmp_path)
    cubin.parent.chmod(cubin.parent.stat().st_mode | stat.S_IWOTH)
    with pytest.raises(InsecureCacheError, match="writable by other users"):
        _builder(tmp_path).build(SPEC, "sm_90a")


def test_prebuilt_dirs_are_searched_first(tmp_path):
    bundle, user = tmp_path / "bundle", tmp_path / "user"
    kernel, _ = _builder(bundle).build(SPEC, "sm_90a")
    cache = CubinCache(user, [bundle], "9.9.9")
    found, compiled = KernelBuilder(TEMPLATES, "9.9.9", cache).build(SPEC, "sm_90a")
    assert not compiled and found.cubin == kernel.cubin
    assert _cubin_files(user) == []


# -- compile errors ------------------------------------------------------------------------
def test_compile_error_carries_log_and_source(tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "broken.cuh").write_text(
        "template <int N> __global__ void broken(int* x) { x[0] = N + undefined_name; }\n"
    )
    spec = KernelSpec("broken", "broken.cuh", "broken", (("n", 1),))
    with pytest.raises(CompileError) as info:
        _builder(tmp_path / "cache", templates=templates).build(spec, "sm_90a")
    assert "undefined_name" in info.value.log
    assert (info.value.source_dir / "broken.cuh").exists()
    assert str(info.value.source_dir) in str(info.value)


# -- launch argument packing -------------------------------------------------------------
def test_arg_packer_layout():
    packer = ArgPacker(("P", "i", "q", "f", "Piq"))
    assert packer.offsets == (0, 8, 16, 24, 32)
    packer.pack((0x1234, -5, 1 << 40, 1.5, 7, 9, 11))
    data = bytes(packer._local.bufs[0])
    assert struct.unpack_from("<Q", data, 0)[0] == 0x1234
    assert struct.unpack_from("<i", data, 8)[0] == -5
    assert struct.unpack_from("<q", data, 16)[0] == 1 << 40
    assert struct.unpack_from("<f", data, 24)[0] == 1.5
    assert struct.unpack_from("<Qi4xq", data, 32) == (
        7,
        9,
        11,
    )  # C layout of {void*; int; long long}


# -- dispatch --------------------------------------------------------------------------------
def test_fallback_logged_once_and_strict(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger="flashinfer_jit"):
        fall_back("some_op", "reason A")
        fall_back("some_op", "reason A")
    assert caplog.text.count("reason A") == 1
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    with pytest.raises(FallbackError, match="reason B"):
        fall_back("some_op", "reason B")


# -- prebuild --------------------------------------------------------------------------------
def _elf_sm(path: Path) -> int:
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF"
    (machine,) = struct.unpack_from("<H", data, 18)
    assert machine == 190  # EM_CUDA
    (flags,) = struct.unpack_from("<I", data, 48)
    # CUDA ELF ABI 8 (CUDA 13 toolchains) moved the SM number from bits 0-7 to 8-15.
    return (flags >> 8) & 0xFF if data[8] >= 8 else flags & 0xFF


def test_prebuild_bundle_for_three_archs(tmp_path):
    from flashinfer_jit.cli import main

    out = tmp_path / "bundle"
    assert (
        main(
            [
                "prebuild",
                "--ops",
                "mla_kv_pack",
                "--arch",
                "sm_90a,sm_100a,sm_103a",
                "-j",
                "1",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    by_arch: dict[str, list[Path]] = {}
    for cubin in _cubin_files(out):
        by_arch.setdefault(cubin.relative_to(out).parts[1], []).append(cubin)
    assert set(by_arch) == {"sm_90a", "sm_100a", "sm_103a"}
    cuobjdump = shutil.which("cuobjdump") or _pip_cuobjdump()
    for arch, cubins in by_arch.items():
        for cubin in cubins:
            assert _elf_sm(cubin) == int(arch[3:-1])
            if cuobjdump:
                header = subprocess.run(
                    [cuobjdump, "-elf", str(cubin)], capture_output=True, text=True
                ).stdout
                assert f"sm={arch[3:]}" in header, header[:200]
    # Relocatable: the bundle works from another place, as a prebuilt dir.
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    env = {
        **os.environ,
        "FLASHINFER_JIT_CUBIN_PATH": str(moved),
        "FLASHINFER_JIT_CACHE_DIR": str(tmp_path / "empty"),
    }
    verify = subprocess.run(
        [sys.executable, "-m", "flashinfer_jit.cli", "cache", "verify"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "0 bad" in verify.stdout


def _pip_cuobjdump() -> str | None:
    try:
        import nvidia.cu13  # noqa: F401  (the cuobjdump wheel installs its binary here)
    except ImportError:
        return None
    path = Path(nvidia.cu13.__path__[0]) / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def test_cache_verify_reports_bad_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(tmp_path))
    env = {**os.environ}
    from flashinfer_jit._version import __version__

    _builder(tmp_path, version=__version__).build(SPEC, "sm_90a")
    (cubin,) = _cubin_files(tmp_path)
    run = [sys.executable, "-m", "flashinfer_jit.cli", "cache", "verify"]
    assert subprocess.run(run, cwd=REPO, env=env, capture_output=True).returncode == 0
    cubin.write_bytes(b"\x7fELF garbage")
    bad = subprocess.run(run, cwd=REPO, env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "1 bad" in bad.stdout


def test_max_active_clusters_before_sm90_is_zero(monkeypatch):
    """No clusters before sm_90: the answer is 0 without loading anything on the device (the
    QSA one-wave split then keeps its table)."""
    from jit_kernels import occupancy

    occupancy.max_active_clusters.cache_clear()
    monkeypatch.setattr(occupancy, "capability", lambda device: (8, 9))
    monkeypatch.setattr(occupancy, "_probe_function", lambda device: pytest.fail("loaded"))
    assert occupancy.max_active_clusters(0, 4, 256, 144 * 1024) == 0
    occupancy.max_active_clusters.cache_clear()
