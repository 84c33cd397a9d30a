"""The ``flashinfer-jit`` command as users and operators drive it (issue 19, items 1, 5-10):
one line on stderr and a non-zero exit for every bad input, honest prebuild summaries,
workers that die with their parent, workloads files that round-trip, a complete ``env``."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashinfer_jit import cli, workload_format
from flashinfer_jit.registry import OPS
from jit_kernels import CompiledKernel, build, cache

REPO = Path(__file__).resolve().parent.parent


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("flashinfer-jit: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- item 8: bad arguments ------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, words",
    [
        (["prebuild", "--arch", "bogus"], "--arch"),
        (["prebuild", "--arch", ","], "no arch"),
        (["prebuild", "--arch", "sm90a"], "sm90a"),
        (["prebuild", "--arch", "9.0+PTX"], "9.0+PTX"),
        (["prebuild", "--ops", ","], "--ops"),
        (["prebuild", "--ops", "mqa_logits,nope"], "nope"),
        (["prebuild", "-j", "0"], "positive"),
        (["prebuild", "-j", "-1"], "positive"),
        (["prebuild", "-j", "two"], "positive"),
        (["prebuild", "--dry-run", "--output", ""], "--output is empty"),  # not the cwd
        (["prebuild", "--dry-run", "--workloads", " "], "--workloads is empty"),  # not all ops
        (["cache", "clear", "--arch", "../.."], "--arch"),
        (["cache", "clear", "--arch", "sm90a"], "sm90a"),
        (["cache", "verify", "--arch", "sm_90a"], "only applies"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, jit_cache, argv, words):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and words in _one_error_line(err)
    assert not jit_cache.exists() or not any(jit_cache.rglob("*.cubin"))


@pytest.mark.parametrize("arch", ["sm_80", "sm_50", "sm_999", "sm_89", "sm_89a", "sm_90f", "8.6"])
def test_an_arch_the_package_cannot_build_is_refused(capsys, jit_cache, arch):
    """sm_80 and the like were listed by --dry-run, then failed kernel by kernel."""
    code, _, err = _run(capsys, "prebuild", "--dry-run", "--arch", arch)
    line = _one_error_line(err)
    assert code == 2 and "cannot build sm_" in line and "the package builds sm_90, sm_100," in line


@pytest.mark.parametrize("value", ["sm_xx", "9.0a,bogus", ", ,", "sm90a", "8.6"])
def test_a_bad_arch_variable_is_one_line(capsys, jit_cache, monkeypatch, value):
    monkeypatch.setenv("FLASHINFER_JIT_ARCHS", value)
    code, _, err = _run(capsys, "prebuild", "--ops", "mla_kv_pack")
    assert code == 2 and "FLASHINFER_JIT_ARCHS" in _one_error_line(err)


def test_torch_arch_syntax_is_accepted(monkeypatch):
    from jit_kernels import target_archs

    assert target_archs("9.0a 10.0a") == ("sm_90a", "sm_100a")
    assert target_archs("9.0a;10.3a,sm_90a") == ("sm_90a", "sm_103a")
    assert target_archs("9.0 sm_100f 12.0a") == ("sm_90", "sm_100f", "sm_120a")
    monkeypatch.setenv("FLASHINFER_JIT_ARCHS", "9.0a 10.0a")
    assert target_archs() == ("sm_90a", "sm_100a")


def test_without_nvrtc_archs_from_9_0_are_accepted(monkeypatch):
    """A machine whose NVRTC does not load cannot ask it which archs it compiles for."""
    from jit_kernels import nvrtc_lib, target_archs

    def no_nvrtc() -> tuple[int, ...]:
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc_lib, "supported_archs", no_nvrtc)
    assert target_archs("sm_999,sm_90") == ("sm_999", "sm_90")
    with pytest.raises(ValueError, match=r"cannot build sm_89: the package builds sm_90 and newer"):
        target_archs("sm_89")


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read"),
        ("folder", "cannot read"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_heads": [1]}', '"op" key naming one of mla_kv_pack, mqa_logits, qsa'),
        ('{"op": "mla_kv_pack", "num_heads": [0]}', "num_heads"),
        ('{"op": "mla_kv_pack", "num_heads": [true]}', "num_heads"),
        ('{"op": "mla_kv_pack", "num_heads": ["8"]}', "num_heads"),
        ('{"op": "mla_kv_pack"}', "num_heads"),
        ('{"op": "mla_kv_pack", "num_heads": [8], "heads": [1]}', "unknown key(s) heads for"),
        ('{"op": "qsa", "configs": [{"head_dims": [96]}]}', "keys group_sizes, head_dims, page"),
        ('{"op": "mqa_logits", "next_n": [3], "num_heads": [4], "head_dim": [128],'
         ' "block_size": [64], "output_dtype": ["float32"]}', "next_n*num_heads"),
    ],
)  # fmt: skip
def test_bad_workloads_files_are_one_line(capsys, jit_cache, tmp_path, content, words):
    path = tmp_path / "w.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    code, _, err = _run(capsys, "prebuild", "--arch", "sm_90a", "--workloads", str(path))
    assert code == 2 and words in _one_error_line(err)


def test_a_workloads_file_for_another_op_names_the_ops_as_given(capsys, jit_cache, tmp_path):
    argv = ["prebuild", "--dry-run", "--ops", "mla_kv_pack,qsa", "--workloads"]
    code, _, err = _run(capsys, *argv, str(OPS["mqa_logits"].workloads))
    assert code == 2 and _one_error_line(err).endswith("not --ops mla_kv_pack,qsa")


# -- item 9: one workloads format; the shipped files round-trip -----------------------------
@pytest.mark.parametrize("op", sorted(OPS))
def test_each_shipped_workloads_file_round_trips(op):
    shipped = OPS[op].workloads
    assert workload_format.load(shipped, OPS)["op"] == op
    default = cli._tasks([op], ("sm_90a", "sm_100a"), None)
    passed_back = cli._tasks(None, ("sm_90a", "sm_100a"), str(shipped))
    assert default and passed_back == default


# -- item 5: prebuild counts what it did not store ------------------------------------------
@pytest.fixture
def fake_compile(monkeypatch):
    """Compiling returns a stand-in cubin at once: these tests are about storing."""
    monkeypatch.setattr(build, "compile_cubin", lambda rendered, arch: CompiledKernel(
        b"\x7fELF stand-in entry\0 for " + arch.encode(), "entry", 0.0))  # fmt: skip


def _mla_workloads(tmp_path: Path) -> str:
    path = tmp_path / "mla.json"
    path.write_text(json.dumps({"op": "mla_kv_pack", "num_heads": [1, 12]}))
    return str(path)


def test_prebuild_into_a_file_fails_every_kernel_with_one_cause(
    capsys, jit_cache, tmp_path, monkeypatch, fake_compile
):
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(blocker))
    argv = ["prebuild", "--arch", "sm_90a", "-j", "1", "--workloads", _mla_workloads(tmp_path)]
    code, out, err = _run(capsys, *argv)
    failed = [line for line in err.splitlines() if line.startswith("FAILED")]
    assert code == 1 and len(failed) == 1, err
    assert "cannot write the cache" in failed[0] and "6 kernel(s)" in failed[0]
    assert "0 of 6 kernels stored" in out


def test_a_full_file_system_is_a_failure(capsys, jit_cache, tmp_path, monkeypatch, fake_compile):
    real = cache._atomic_write

    def full_for_cake(path: Path, data: bytes) -> None:
        if "cake" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(path, data)

    monkeypatch.setattr(cache, "_atomic_write", full_for_cake)
    out_dir = tmp_path / "bundle"
    argv = ["prebuild", "--arch", "sm_90a", "-j", "1", "--output", str(out_dir)]
    code, out, err = _run(capsys, *argv, "--workloads", _mla_workloads(tmp_path))
    failed = [line for line in err.splitlines() if line.startswith("FAILED")]
    assert code == 1 and len(failed) == 1 and "No space left" in failed[0], err
    assert "2 of 6 kernels stored" in out and len(list(out_dir.rglob("*.cubin"))) == 2


def test_a_read_only_cache_fails_at_once(capsys, jit_cache, tmp_path, monkeypatch, fake_compile):
    """EROFS (or an immutable folder) fails every kernel with one cause, without waiting
    on filelock's retries."""

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(cache.tempfile, "mkstemp", read_only)
    start = time.monotonic()
    argv = ["prebuild", "--arch", "sm_90a", "-j", "1", "--workloads", _mla_workloads(tmp_path)]
    code, out, err = _run(capsys, *argv)
    failed = [line for line in err.splitlines() if line.startswith("FAILED")]
    assert code == 1 and len(failed) == 1 and "Read-only file system" in failed[0], err
    assert "0 of 6 kernels stored" in out and time.monotonic() - start < 60


def test_cache_verify_of_a_malformed_record_is_a_row_not_a_traceback(
    capsys, jit_cache, tmp_path, fake_compile
):
    assert _run(capsys, "prebuild", "--arch", "sm_90a", "-j", "1",
                "--workloads", _mla_workloads(tmp_path))[0] == 0  # fmt: skip
    record = next(jit_cache.rglob("*.json"))
    record.write_text("null")
    code, out, err = _run(capsys, "cache", "verify")
    assert code == 1 and "1 bad" in out and "Traceback" not in err
    assert "not an object" in out


@pytest.mark.parametrize(
    "argv",
    [["cache", "list"], ["cache", "verify"], ["cache", "clear"],
     ["prebuild", "--arch", "sm_90a", "--ops", "mla_kv_pack", "-j", "1"]],
)  # fmt: skip
def test_a_cache_path_the_system_refuses_is_one_line(capsys, jit_cache, monkeypatch, argv):
    """An OSError (here ENAMETOOLONG; an unreadable or immutable folder alike) is a user
    error like the rest: one line naming the path, exit 2, no traceback."""
    monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(jit_cache.parent / ("x" * 300)))
    code, _, err = _run(capsys, *argv)
    line = _one_error_line(err)
    assert code == 2 and "x" * 300 in line and line.endswith(": File name too long")


# -- item 6: --output others can write to -----------------------------------------------------
def test_a_world_writable_output_is_refused_before_writing(capsys, jit_cache, tmp_path):
    out_dir = tmp_path / "bundle"
    out_dir.mkdir()
    out_dir.chmod(0o777)
    argv = ["prebuild", "--arch", "sm_90a", "--ops", "mla_kv_pack", "--output", str(out_dir)]
    code, _, err = _run(capsys, *argv)
    line = _one_error_line(err)
    assert code == 2 and "writable by other users" in line and "point --output elsewhere" in line
    assert list(out_dir.iterdir()) == []


def test_cache_verify_reports_a_cache_folder_others_can_write_to(capsys, jit_cache):
    """verify said "0 bad" of an empty cache folder that prebuild and loading refuse, and
    of every bad entry that it is rebuilt on next use: loading raises on a refused one."""
    jit_cache.mkdir()
    jit_cache.chmod(0o777)
    code, out, err = _run(capsys, "cache", "verify")
    assert code == 1 and "writable by other users" in out and "1 entries, 1 bad" in out
    assert "1 refused: loading raises" in err and "rebuilt" not in err


# -- item 1: cache clear through the CLI ------------------------------------------------------
def test_cache_clear_reports_and_keeps_foreign_files(capsys, jit_cache, fake_compile, tmp_path):
    code, _, _ = _run(capsys, "prebuild", "--arch", "sm_90a", "-j", "1",
                      "--workloads", _mla_workloads(tmp_path))  # fmt: skip
    assert code == 0
    (jit_cache / "keep.txt").write_text("mine")
    code, out, _ = _run(capsys, "cache", "clear")
    assert code == 0 and re.search(r"removed \d+ files \(\d+ bytes\)", out), out
    assert (jit_cache / "keep.txt").read_text() == "mine"
    assert not list(jit_cache.rglob("*.cubin"))


def test_cache_clear_refuses_a_prebuilt_bundle(
    capsys, jit_cache, fake_compile, tmp_path, monkeypatch
):
    """FLASHINFER_JIT_CUBIN_PATH and FLASHINFER_JIT_CACHE_DIR naming one bundle: clear
    deleted the bundle."""
    from flashinfer_jit._jit import BUILDER

    assert _run(capsys, "prebuild", "--arch", "sm_90a", "-j", "1",
                "--workloads", _mla_workloads(tmp_path))[0] == 0  # fmt: skip
    bundle = sorted(jit_cache.rglob("*"))
    monkeypatch.setenv("FLASHINFER_JIT_CUBIN_PATH", str(jit_cache))
    BUILDER._cache = None
    code, _, err = _run(capsys, "cache", "clear")
    assert code == 2 and "prebuilt bundle" in _one_error_line(err)
    assert sorted(jit_cache.rglob("*")) == bundle


# -- item 10: env -----------------------------------------------------------------------------
_PARENT = """
import sys, time
sys.path.insert(0, {repo!r})
from jit_kernels.prebuild import worker_pool
pool = worker_pool(2)
for _ in range(2):
    pool.submit(time.sleep, 600)
print("submitted", flush=True)
time.sleep(600)
"""


def _workers(parent: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{parent}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pool_workers_die_with_the_parent():
    script = _PARENT.format(repo=str(REPO))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "submitted"
        deadline = time.monotonic() + 120
        while len(workers := _workers(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 60  # a worker still importing exits once it starts
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [w for w in workers if _alive(w)]
    for w in alive:
        os.kill(w, signal.SIGKILL)
    assert alive == []


# -- a compile that succeeds with a warning is reported, stored and recorded ----------------
def test_prebuild_reports_what_the_compiler_warned(capsys, jit_cache, tmp_path, monkeypatch):
    warning = "ptxas info : (C7518) Potential Performance Loss: wgmma.mma_async serialized"

    def warns_for_cake(rendered, arch: str) -> CompiledKernel:
        said = warning if "cake" in rendered.spec.family else ""
        return CompiledKernel(b"\x7fELF stand-in entry\0", "entry", 0.0, said)

    monkeypatch.setattr(build, "compile_cubin", warns_for_cake)
    out_dir = tmp_path / "bundle"
    argv = ["prebuild", "--arch", "sm_90a", "-j", "1", "--output", str(out_dir)]
    code, out, err = _run(capsys, *argv, "--workloads", _mla_workloads(tmp_path))
    warned = [line for line in err.splitlines() if line.startswith("WARNED")]
    assert code == 0 and "6 of 6 kernels stored" in out, err
    assert len(warned) == 1 and "4 kernel(s)" in warned[0] and "C7518" in warned[0], err
    records = [
        json.loads(p.read_text()) for p in out_dir.rglob("*.json") if "native" not in p.parts
    ]
    said = [r.get("compiler_messages", "") for r in records if "entry" in r]
    assert sorted(said) == sorted([warning] * 4 + [""] * 2)


# -- --version, and python -m flashinfer_jit ------------------------------------------------
