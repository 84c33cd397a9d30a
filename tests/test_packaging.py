"""A built wheel, installed outside the source tree, finds its templates and compiles."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from jit_kernels import native

REPO = Path(__file__).resolve().parent.parent

_CHECK = """
import sys
sys.path.insert(0, {site!r})
import flashinfer_jit, flashinfer_jit._jit as jit
assert flashinfer_jit.__file__.startswith({site!r}), flashinfer_jit.__file__
assert str(jit.TEMPLATE_ROOT).startswith({site!r}), jit.TEMPLATE_ROOT
from flashinfer_jit.cli import main
sys.exit(main(["prebuild", "--ops", "mla_kv_pack", "--arch", "sm_90a", "-j", "1", "--output", {out!r}]))
"""


def test_wheel_installs_and_builds_outside_the_tree(tmp_path):
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(REPO)],
        check=True,
    )
    (wheel,) = wheel_dir.glob("flashinfer_jit-*.whl")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
    )
    assert (site / "flashinfer_jit" / "templates" / "mla_kv_pack/sm90_warp_cvt.cuh").is_file()
    script = _CHECK.format(site=str(site), out=str(tmp_path / "bundle"))
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert list((tmp_path / "bundle").rglob("*.cubin"))
    # prebuild also builds the native launcher (its C source ships in the wheel) into the
    # bundle where this machine has a C compiler, and says it skipped it where it has none
    # (jit_kernels.prebuild.build_native's status and detail, printed by the CLI).
    lines = [line for line in run.stdout.splitlines() if line.startswith("native launcher: ")]
    assert len(lines) == 1, run.stdout + run.stderr
    if os.environ.get(native.NATIVE_ENV) == "0":
        assert lines[0] == f"native launcher: skipped ({native.NATIVE_ENV}=0)"
    elif shutil.which(native.compiler()[0]):
        launcher = (tmp_path / "bundle").resolve() / native.FOLDER / native.file_name()
        assert lines[0] == f"native launcher: built ({launcher})"
    else:
        assert lines[0].startswith("native launcher: skipped (no C compiler ("), lines[0]
    assert (site / "jit_kernels" / "_launcher.c").is_file()
