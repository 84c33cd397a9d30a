"""``flashinfer-jit env`` and the command's own entry points: every variable and the
environment reported (also where the cache or NVRTC is unusable: a line each, exit 0),
``--version`` and ``python -m flashinfer_jit``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from flashinfer_jit import cli, cli_env

from .test_cli import REPO, _one_error_line, _run


def _variables_read() -> set[str]:
    """Every environment variable name the package's source reads."""
    names = set()
    for path in [*(REPO / "jit_kernels").glob("*.py"), *(REPO / "flashinfer_jit").rglob("*.py")]:
        text = path.read_text()
        names |= set(re.findall(r'environ(?:\.get)?[\[(]\s*"([A-Z_]+)"', text))
        names |= set(re.findall(r'_ENV\s*=\s*"([A-Z_]+)"', text))
    return names


def test_env_reports_every_variable_and_json(capsys, jit_cache, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    monkeypatch.setenv("FLASHINFER_JIT_ARCHS", "bogus")
    code, out, _ = _run(capsys, "env", "--json")
    report = json.loads(out)
    assert code == 0
    assert _variables_read() <= set(report["variables"]) and len(_variables_read()) >= 8
    assert report["variables"]["FLASHINFER_JIT_STRICT"] == "1"
    assert report["target archs"].startswith("invalid")
    assert {"nvrtc", "ptxas (prebuild)", "nvidia-cutlass-dsl", "c compiler"} <= set(
        report["compilers"]
    )
    assert report["cache"]["dir"] == str(jit_cache) and report["cache"]["bytes"] == 0
    assert report["cache"]["problem"] is None
    assert report["flashinfer-jit"] == cli.__version__
    code, text, _ = _run(capsys, "env")
    assert code == 0 and all(name in text for name in cli_env.VARIABLES)


@pytest.mark.parametrize("why", ["File name too long", "writable by other users"])
def test_env_reports_a_refused_cache_and_the_rest(capsys, jit_cache, monkeypatch, why):
    """env failed with one line where the cache was refused: it is what one runs to see why."""
    if why == "File name too long":
        monkeypatch.setenv("FLASHINFER_JIT_CACHE_DIR", str(jit_cache.parent / ("x" * 300)))
    else:
        jit_cache.mkdir()
        jit_cache.chmod(0o777)
    code, out, _ = _run(capsys, "env", "--json")
    assert code == 0 and why in json.loads(out)["cache"]["problem"]
    code, out, _ = _run(capsys, "env")
    assert code == 0 and why in out and "templates" in out


# The error cuda.pathfinder raises where it finds no NVRTC: each search step's reason, then
# the folders it listed, a line each (cuda/pathfinder/_dynamic_libs/search_steps.py).
_NOT_FOUND = "No such file: libnvrtc.so.13 or libnvrtc.so.12"
_PATHFINDER = f'Failure finding "libnvrtc.so.13 or libnvrtc.so.12": {_NOT_FOUND}, {_NOT_FOUND}\n'


@pytest.mark.parametrize(
    "message",
    [_PATHFINDER, _PATHFINDER + '  listdir("/x/lib"):\n    a.so'],
    ids=["reasons", "reasons and listings"],
)
def test_env_without_nvrtc_says_why_on_one_line_once(capsys, jit_cache, monkeypatch, message):
    """The nvrtc line named pathfinder's reason twice and broke onto the next line."""
    from jit_kernels import nvrtc_lib, nvrtc_version

    def no_nvrtc():
        raise RuntimeError(message)

    monkeypatch.setattr(nvrtc_lib, "version", no_nvrtc)
    monkeypatch.setattr(nvrtc_lib, "supported_archs", no_nvrtc)
    nvrtc_version.cache_clear()  # cached by an earlier test's compile, perhaps
    try:
        code, out, _ = _run(capsys, "env")
        code_json, out_json, _ = _run(capsys, "env", "--json")
    finally:
        nvrtc_version.cache_clear()
    line = next(line for line in out.splitlines() if line.strip().startswith("nvrtc "))
    assert code == 0 and line.split(None, 1)[1].endswith(f": {_NOT_FOUND})"), out
    assert out.count(_NOT_FOUND) == 1 and "listdir" not in out
    nvrtc = json.loads(out_json)["compilers"]["nvrtc"]
    assert code_json == 0 and nvrtc == line.split(None, 1)[1]


# -- item 7: pool workers die with the parent -------------------------------------------------


def test_version_prints_the_package_version(capsys):
    import flashinfer_jit

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"flashinfer-jit {flashinfer_jit.__version__}\n"


@pytest.mark.parametrize("argv, code", [(["--version"], 0), (["nonsense"], 2)])
def test_python_m_runs_the_command(jit_cache, argv, code):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "flashinfer_jit", *argv], env=env,
                         capture_output=True, text=True, timeout=300, cwd=jit_cache.parent)  # fmt: skip
    assert run.returncode == code, run.stderr
    if code == 0:
        assert run.stdout == f"flashinfer-jit {cli.__version__}\n"
    else:
        assert "invalid choice" in _one_error_line(run.stderr)
