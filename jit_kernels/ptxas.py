"""One NVRTC front end and optimizer for archs that share their PTX, then ptxas per arch.

NVRTC compiles a specialization in three steps: the C++ front end (5-15 % of it), the NVVM
optimizer (40-55 %) and ptxas (35-50 %; docs/prebuild-time.md). For sm_103a it emits the
PTX it emits for sm_100a, but for the ``.target`` line and the names of internal-linkage
constants (all 277 shipped NVRTC specializations compared, NVRTC 13.5), so ``prebuild``
runs the first two steps once for both and ptxas once for each (``SharedPtx``). sm_107a is
a twin of sm_100a only in the families that say so (``KernelSpec.ptx_twins``): NVRTC's PTX
for it loads kernel parameters differently in some kernels (qsa_slots), not in others.

Only the ptxas of NVIDIA's nvcc wheel of the installed NVRTC wheel's exact release is used:
it gives the SASS NVRTC gives (``cuobjdump -sass`` compared per family and arch,
tests/test_ptxas.py); nvJitLink does not (it assembles PTX as relocatable code). Without
it every arch is compiled by NVRTC alone, as on a first call.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import re
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .compile import CompiledKernel, CompileError, compile_ptx
from .render import RenderedSource
from .spec import KernelSpec

log = logging.getLogger("flashinfer_jit.jit")

# arch -> the arch whose PTX it takes (see the module docstring for the evidence)
PTX_TWINS = {"sm_103a": "sm_100a"}
# NVRTC wheel -> the nvcc wheel of the same CUDA major that ships ptxas
NVCC_WHEELS = {
    "nvidia-cuda-nvrtc": "nvidia-cuda-nvcc",
    "nvidia-cuda-nvrtc-cu12": "nvidia-cuda-nvcc-cu12",
}
# The code generation option among compile.NVRTC_OPTIONS (-O3 is ptxas's default, as NVRTC's).
PTXAS_OPTIONS = ("-lineinfo",)
PTXAS_TIMEOUT_S = 600.0
_TARGET = re.compile(rb"^\.target\s+\S+", re.MULTILINE)
_VERSION = re.compile(r"\bV(\d+\.\d+\.\d+)\b")


def ptx_source(arch: str, spec: KernelSpec | None = None) -> str:
    """The arch whose PTX ``arch``'s cubin is assembled from (itself unless a twin, of every
    specialization or of ``spec``'s family)."""
    return dict(spec.ptx_twins if spec else ()).get(arch) or PTX_TWINS.get(arch, arch)


@functools.cache
def ptxas_path() -> Path | None:
    """The nvcc wheel's ptxas where its release (``ptxas --version``) is the installed NVRTC
    wheel's; None otherwise (logged once at INFO)."""
    for nvrtc_wheel, nvcc_wheel in NVCC_WHEELS.items():
        try:
            release = importlib.metadata.version(nvrtc_wheel)
        except importlib.metadata.PackageNotFoundError:
            continue  # the first NVRTC wheel installed is the one loaded (compile.NVRTC_WHEELS)
        try:
            nvcc = importlib.metadata.distribution(nvcc_wheel)
        except importlib.metadata.PackageNotFoundError:
            log.info("no %s: prebuild compiles each arch with NVRTC alone", nvcc_wheel)
            return None
        found = [f for f in nvcc.files or () if f.name == "ptxas"]
        path = Path(str(nvcc.locate_file(found[0]))) if found else None
        reported = _reported_release(path) if path else None
        if reported != release:
            log.info("ptxas %s of %s is not NVRTC %s's: not used", reported, nvcc_wheel, release)
            return None
        return path
    return None


def _reported_release(path: Path) -> str | None:
    try:
        run = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = _VERSION.search(run.stdout)
    return match.group(1) if run.returncode == 0 and match else None


def assemble(ptx: bytes, arch: str, label: str) -> tuple[bytes, str]:
    """(cubin, ptxas's messages) of NVRTC's ``ptx`` assembled for ``arch`` (its ``.target``
    line set to ``arch``); CompileError where ptxas fails."""
    path = ptxas_path()
    if path is None:
        raise RuntimeError("no ptxas of the installed NVRTC's release")
    text = _TARGET.sub(f".target {arch}".encode(), ptx.rstrip(b"\0"), count=1)
    with tempfile.TemporaryDirectory(prefix="flashinfer-jit-ptxas-") as tmp:
        source, cubin = Path(tmp, "kernel.ptx"), Path(tmp, "kernel.cubin")
        source.write_bytes(text)
        command = [str(path), f"-arch={arch}", *PTXAS_OPTIONS, str(source), "-o", str(cubin)]
        run = subprocess.run(command, capture_output=True, text=True, timeout=PTXAS_TIMEOUT_S)
        if run.returncode != 0:
            raise CompileError(label, arch, run.stderr + run.stdout, None)
        return cubin.read_bytes(), run.stderr.strip()


class SharedPtx:
    """One specialization's PTX for a set of twin archs, compiled by NVRTC on first use and
    assembled by ptxas for each arch (``KernelBuilder.build(..., shared=)``)."""

    def __init__(self, rendered: RenderedSource, archs: Sequence[str]):
        sources = {ptx_source(arch, rendered.spec) for arch in archs}
        if len(sources) != 1:
            raise ValueError(f"{list(archs)} do not share one PTX")
        self.rendered, self.archs, self.source = rendered, tuple(archs), sources.pop()
        self._ptx: tuple[bytes, str, str] | None = None

    def compile(self, arch: str) -> CompiledKernel:
        """``arch``'s kernel; the first call also pays for the PTX (its seconds include it)."""
        if arch not in self.archs:
            raise ValueError(f"{arch} is not one of {self.archs}")
        start = time.perf_counter()
        if self._ptx is None:
            self._ptx = compile_ptx(self.rendered, self.source)
        ptx, entry, nvrtc_log = self._ptx
        cubin, messages = assemble(ptx, arch, self.rendered.spec.label)
        said = "\n".join(m for m in (nvrtc_log, messages) if m)
        return CompiledKernel(cubin, entry, time.perf_counter() - start, said)
