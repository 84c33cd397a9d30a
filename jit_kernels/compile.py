"""Turning rendered sources into cubins: NVRTC for CUDA C++, CuTe DSL for generators."""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import tempfile
import time
from pathlib import Path

from . import nvrtc_lib
from .render import RenderedSource

# -lineinfo keeps SASS readable in profilers at no run-time cost; nothing here relaxes
# IEEE semantics (no --use_fast_math): several ops promise bit-exact results.
NVRTC_OPTIONS = ("-std=c++17", "-lineinfo", "--device-as-default-execution-space")


class CompileError(RuntimeError):
    """A specialization failed to compile; carries the compiler log and the kept source."""

    def __init__(self, label: str, arch: str, log: str, source_dir: Path | None):
        self.log = log
        self.source_dir = source_dir
        where = f"\nrendered source kept in {source_dir}" if source_dir else ""
        super().__init__(f"compiling {label} for {arch} failed:\n{log.strip()}{where}")


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    cubin: bytes
    entry: str  # the symbol to look up in the cubin
    seconds: float
    # What the compiler said of a compile that succeeded (ptxas's performance warnings, a
    # wgmma serialized, say): kept so a build can report it, empty when it said nothing.
    messages: str = ""


@functools.cache
def nvrtc_version() -> str:
    """major.minor of the NVRTC library cuda-bindings loads (``nvrtc_lib``). Asking the
    library costs its load (121 of the 127 ms of a warm first call on the H200 host,
    2026-12-02, when it came through cuda-python), so keys name ``installed_nvrtc_version``."""
    major, minor = nvrtc_lib.version()
    return f"{major}.{minor}"


@functools.cache
def nvrtc_release() -> str:
    """The full release of that library (``nvrtc_lib.release``): what a key names where no
    wheel's metadata names it, and what a compile checks the metadata against."""
    return nvrtc_lib.release()


# NVIDIA's NVRTC wheels, in the order cuda-bindings 13 loads their libraries (.so.13 first);
# cuda.pathfinder loads a wheel's library before a system one.
NVRTC_WHEELS = ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12")


@functools.cache
def installed_nvrtc_version() -> str | None:
    """The installed NVRTC wheel's version, from its metadata (under a millisecond, no
    library loaded); None without one. The full release (13.5.37), not major.minor: a patch
    release may compile other cubins (ptxas.py, too, takes the exact release only). A hint:
    the compile checks it against the library (``KernelBuilder.build``), so a hint that
    names another NVRTC costs a load, never a kernel keyed by the wrong compiler."""
    for name in NVRTC_WHEELS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# The CuTe-DSL release the package pins (pyproject.toml). A machine without the DSL (a
# GPU host that only loads prebuilt cubins) keys cute kernels with this version, so it
# computes the same cache keys as the build machine and finds the cubins it produced.
CUTE_DSL_PINNED_VERSION = "4.8.1"


@functools.cache
def cute_dsl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return CUTE_DSL_PINNED_VERSION


CUTE_DSL_EXTRA = "pip install 'flashinfer-jit[cake]'"


def cute_dsl_refusal() -> str | None:
    """Why this process does not compile CuTe-DSL kernels (None: it does). Only the pinned
    release compiles them: the cake kernels are built and tested with it, and an engine may
    pin another release beside this package (vLLM pins 4.7.1)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("nvidia-cutlass-dsl")
    except PackageNotFoundError:
        return f"nvidia-cutlass-dsl is not installed ({CUTE_DSL_EXTRA}) and no prebuilt cubin was found"
    if installed != CUTE_DSL_PINNED_VERSION:
        return (
            f"nvidia-cutlass-dsl {installed} is installed; the cake kernels are built with "
            f"{CUTE_DSL_PINNED_VERSION} only ({CUTE_DSL_EXTRA}, or ship a prebuilt bundle)"
        )
    return None


def compiler_identity(compiler: str, loaded: bool = False) -> str:
    """What the cache key records of the toolchain: the installed NVRTC wheel's release, or
    with ``loaded`` (or no wheel) the loaded library's."""
    if compiler == "cute":  # only the pinned release compiles them (cute_dsl_refusal)
        return f"cutlass-dsl {CUTE_DSL_PINNED_VERSION}"
    version = (None if loaded else installed_nvrtc_version()) or nvrtc_release()
    return f"nvrtc {version} {' '.join(NVRTC_OPTIONS)}"


def _keep_source(rendered: RenderedSource) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="flashinfer-jit-failed-"))
    (folder / rendered.filename).write_text(rendered.source)
    for name, text in rendered.headers:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def compile_cubin(rendered: RenderedSource, arch: str) -> CompiledKernel:
    """Compile one specialization for ``arch`` (e.g. ``sm_90a``); no GPU needed."""
    start = time.perf_counter()
    if rendered.spec.compiler == "cute":
        cubin, entry = _compile_cute(rendered, arch)
        messages = ""
    else:
        cubin, entry, messages = _compile_nvrtc(rendered, arch)
    return CompiledKernel(cubin, entry, time.perf_counter() - start, messages)


def compile_ptx(rendered: RenderedSource, arch: str) -> tuple[bytes, str, str]:
    """(PTX, lowered entry name, NVRTC's log) of one specialization for ``arch``'s virtual
    target (sm_100a: compute_100a); jit_kernels.ptxas assembles it."""
    return _compile_nvrtc(rendered, arch.replace("sm_", "compute_", 1), ptx=True)


def _compile_nvrtc(
    rendered: RenderedSource, arch: str, ptx: bool = False
) -> tuple[bytes, str, str]:
    """(cubin, or with ``ptx`` the PTX, lowered entry name, the compiler's log: empty unless
    it warned)."""
    options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
    binary, lowered, log_text = nvrtc_lib.compile_program(
        rendered.source.encode(),
        rendered.filename.encode(),
        [(n.encode(), t.encode()) for n, t in rendered.headers],
        rendered.spec.name_expression.encode(),
        options,
        "PTX" if ptx else "CUBIN",
    )
    if binary is None:
        raise CompileError(rendered.spec.label, arch, log_text, _keep_source(rendered))
    return binary, lowered, log_text.strip()


def _compile_cute(rendered: RenderedSource, arch: str) -> tuple[bytes, str]:
    """Run a CuTe-DSL generator module's ``build(params, arch) -> (cubin, entry)``."""
    refusal = cute_dsl_refusal()
    if refusal is not None:  # an ImportError: the family reports the kernel unavailable
        raise ImportError(refusal)
    module_name = "_fij_cute_" + Path(rendered.filename).stem
    # The file must outlive build(): the DSL reads the kernels' source back from it.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / rendered.filename
        path.write_text(rendered.source)
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        try:
            return module.build(rendered.spec.param_dict, arch)
        except Exception as exc:  # the DSL raises many types; surface them uniformly
            raise CompileError(
                rendered.spec.label, arch, repr(exc), _keep_source(rendered)
            ) from exc
