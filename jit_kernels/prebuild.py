"""Compiling many specializations for many archs in worker processes."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import native
from .build import KernelBuilder
from .cache import CubinCache, default_cache_root, prebuilt_roots
from .spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class BuildTask:
    group: str  # what the summary groups by (the op name)
    spec: KernelSpec
    arch: str


@dataclasses.dataclass(frozen=True)
class BuildResult:
    task: BuildTask
    status: str  # "compiled", "cached" or "failed"
    seconds: float
    error: str = ""


def _builder(template_root: Path, version: str, output: Path | None) -> KernelBuilder:
    # A bundle must be self-contained, so it is built without reading other roots.
    if output is not None:
        cache = CubinCache(output, [], version)
    else:
        cache = CubinCache(default_cache_root(), prebuilt_roots(), version)
    return KernelBuilder(template_root, version, cache)


def _run(task: BuildTask, template_root: Path, version: str, output: Path | None) -> BuildResult:
    start = time.perf_counter()
    try:
        _, compiled = _builder(template_root, version, output).build(task.spec, task.arch)
    except Exception as exc:  # a failed kernel is reported, the others still build
        return BuildResult(
            task, "failed", time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
        )
    return BuildResult(task, "compiled" if compiled else "cached", time.perf_counter() - start)


def build_all(
    tasks: Iterable[BuildTask],
    template_root: Path,
    version: str,
    jobs: int,
    output: Path | None = None,
) -> Iterator[BuildResult]:
    """Build every task, ``jobs`` at a time, yielding results as they finish."""
    tasks = list(tasks)
    if jobs <= 1:
        for task in tasks:
            yield _run(task, template_root, version, output)
        return
    # spawn, not fork: the parent may hold a CUDA context, which a fork must not inherit.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_run, t, template_root, version, output) for t in tasks]
        for future in as_completed(futures):
            yield future.result()


def build_native(output: Path | None) -> tuple[str, str]:
    """(status, detail) of building the compiled launcher (jit_kernels.native) into
    ``output`` (a bundle) or the cache, and importing it: "built", "cached", "skipped" (no C
    compiler, or FLASHINFER_JIT_NATIVE_LAUNCH=0) or "failed". Kernels launch through
    cuda-python without it, so a failure is reported, not fatal."""
    if os.environ.get(native.NATIVE_ENV) == "0":
        return "skipped", f"{native.NATIVE_ENV}=0"
    try:
        path, built = native.build(output or default_cache_root())
        native.load(path)
    except native.NativeBuildError as exc:
        return ("skipped" if exc.no_compiler else "failed"), str(exc)
    except Exception as exc:  # an unwritable or insecure folder, a failed import
        return "failed", repr(exc)
    return ("built" if built else "cached"), str(path)
