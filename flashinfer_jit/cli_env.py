"""``flashinfer-jit env [--json]``: every setting the package reads and what it found."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version

from jit_kernels import (
    InsecureCacheError,
    alloc,
    arch,
    cache,
    cache_admin,
    dispatch,
    family,
    native,
)

from ._jit import BUILDER, TEMPLATE_ROOT
from ._version import __version__
from .cli_common import os_error_text

# Every environment variable the package reads (tests check the source names no other).
VARIABLES = (
    cache.CACHE_DIR_ENV,
    cache.CUBIN_PATH_ENV,
    arch.ARCH_ENV,
    family.JIT_DISABLE_ENV,
    dispatch.DISABLE_ENV,
    dispatch.STRICT_ENV,
    dispatch.VALIDATE_ENV,
    native.NATIVE_ENV,
    "CC",  # the C compiler of the native launcher
    alloc.UNCACHED_ENV,  # torch's: scratch memory then comes from torch.empty, as tensors do
)


def _package(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _first_line(command: list[str]) -> str:
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable ({exc})"
    lines = (run.stdout or run.stderr).strip().splitlines()
    return lines[0] if run.returncode == 0 and lines else f"unavailable (exit {run.returncode})"


def _unloaded(exc: Exception) -> str:
    """One line, each reason once, for why NVRTC did not load. cuda.pathfinder's error says
    'Failure finding "libnvrtc.so.13 or ...": No such file: ..., No such file: ...' (the
    same words for each search step) and lists the folders it searched on lines below."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    head, sep, reasons = (lines[0] if lines else type(exc).__name__).partition(": ")
    return f"unavailable ({head}{sep}{', '.join(dict.fromkeys(reasons.split(', ')))})"


def _compilers() -> dict[str, str]:
    from jit_kernels import nvrtc_version

    try:
        nvrtc = nvrtc_version()
    except Exception as exc:  # no NVRTC library is a state to report, not a crash
        nvrtc = _unloaded(exc)
    from jit_kernels.compile import cute_dsl_refusal
    from jit_kernels.ptxas import ptxas_path

    ptxas = ptxas_path()  # prebuild's one PTX for sm_100a and sm_103a needs it
    return {
        "nvrtc": nvrtc,
        "ptxas (prebuild)": str(ptxas) if ptxas else "none of NVRTC's release (the prebuild extra)",
        "nvidia-cutlass-dsl": _package("nvidia-cutlass-dsl"),
        "cake kernels": cute_dsl_refusal() or "compiled here",
        "c compiler": _first_line([*native.compiler(), "--version"]),
    }


def _nvrtc_warning(torch_cuda: str | None, nvrtc: str) -> str | None:
    """The NVRTC extra should follow torch's CUDA major (README, "Install: the extras")."""
    torch_major, nvrtc_major = (torch_cuda or "").split(".")[0], nvrtc.split(".")[0]
    if torch_major and nvrtc_major.isdigit() and nvrtc_major != torch_major:
        return (
            f"NVRTC {nvrtc} beside torch for CUDA {torch_cuda}: "
            f"pip install 'flashinfer-jit[cu{torch_major}]'"
        )
    return None


def _archs_and_gpus() -> tuple[list[str] | str, list[str]]:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            gpus.append(f"{torch.cuda.get_device_name(i)} ({arch.device_arch(i)})")
    try:
        archs: list[str] | str = list(arch.target_archs())
    except ValueError as exc:  # reported, not raised: env is what one runs to find out why
        archs = f"invalid: {exc}"
    return archs, gpus


def _cache_report() -> dict:
    """The cache's folder, its files and bytes, and why loading and prebuild refuse it
    (``problem``: reported, not raised, like the archs; files and bytes None if unread)."""
    store = BUILDER.cache
    report = {"dir": str(store.root), "files": None, "bytes": None,
              "prebuilt dirs": [str(p) for p in store.prebuilt], "problem": None}  # fmt: skip
    try:
        root = store.root
        size = cache_admin.clear(root, remove=False) if root.is_dir() else cache_admin.ClearReport()
        report.update(files=size.files, bytes=size.bytes)
        store.check_trusted()
    except InsecureCacheError as exc:
        report["problem"] = str(exc)
    except OSError as exc:  # a name too long, an unreadable folder...
        report["problem"] = os_error_text(exc)
    return report


def collect() -> dict:
    import torch

    archs, gpus = _archs_and_gpus()
    compilers = _compilers()
    return {
        "flashinfer-jit": __version__,
        "python": sys.version.split()[0],
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "cuda-python": f"{_package('cuda-python')} (cuda-bindings {_package('cuda-bindings')})",
        "compilers": compilers,
        "warning": _nvrtc_warning(torch.version.cuda, compilers["nvrtc"]),
        "variables": {name: os.environ.get(name) for name in VARIABLES},
        "target archs": archs,
        "gpus": gpus,
        "cache": _cache_report(),
        "templates": str(TEMPLATE_ROOT),
    }


def _print(report: dict, indent: str = "") -> None:
    width = max(len(name) for name in report) + 2
    for name, value in report.items():
        if isinstance(value, dict):
            print(f"{indent}{name}:")
            _print(value, indent + "  ")
            continue
        if isinstance(value, list):
            value = ", ".join(value) or "none"
        print(f"{indent}{name:<{width}}{'(unset)' if value is None else value}")


def cmd_env(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0
