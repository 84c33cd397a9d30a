"""Compiling many specializations for many archs in worker processes."""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from . import native
from .build import KernelBuilder
from .cache import CacheWriteError, CubinCache, default_cache_root, prebuilt_roots
from .ptxas import SharedPtx, ptx_source
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
    cause: str = ""  # why it failed, without naming the kernel: summaries group by it
    messages: str = ""  # what the compiler said of a compile that succeeded (a warning)


def prebuild_cache(version: str, output: Path | None) -> CubinCache:
    """The cache ``prebuild`` writes: every kernel must land on disk (require_store)."""
    # A bundle must be self-contained, so it is built without reading other roots.
    if output is not None:
        return CubinCache(output, [], version, require_store=True, named_by="--output")
    return CubinCache(default_cache_root(), prebuilt_roots(), version, require_store=True)


def one_line(text: str, limit: int = 400) -> str:
    line = " | ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _run_job(
    job: list[BuildTask], template_root: Path, version: str, output: Path | None
) -> list[BuildResult]:
    """Build one spec for the archs of ``job``, which share their PTX (``_jobs``): NVRTC
    compiles it once and ptxas assembles each arch's cubin, where ptxas.SharedPtx applies."""
    builder = KernelBuilder(template_root, version, prebuild_cache(version, output))
    shared = None
    if len(job) > 1:
        try:
            shared = builder.shared_ptx(job[0].spec, [task.arch for task in job])
        except Exception:  # noqa: BLE001 (a cache that cannot be read: each build reports it)
            shared = None
    return [_run(task, builder, shared) for task in job]


def _jobs(tasks: list[BuildTask]) -> list[list[BuildTask]]:
    """The tasks by job: one spec's archs that take one PTX (ptxas.ptx_source) together."""
    jobs: dict[tuple[KernelSpec, str], list[BuildTask]] = {}
    for task in tasks:
        jobs.setdefault((task.spec, ptx_source(task.arch, task.spec)), []).append(task)
    return list(jobs.values())


def _run(task: BuildTask, builder: KernelBuilder, shared: SharedPtx | None) -> BuildResult:
    start = time.perf_counter()
    try:
        kernel, compiled = builder.build(task.spec, task.arch, shared)
    except CacheWriteError as exc:  # compiled, but not stored: the same cause for every kernel
        return BuildResult(task, "failed", time.perf_counter() - start, str(exc), exc.cause)
    except Exception as exc:  # a failed kernel is reported, the others still build
        error = f"{type(exc).__name__}: {exc}"
        return BuildResult(task, "failed", time.perf_counter() - start, error, one_line(error))
    status, seconds = "compiled" if compiled else "cached", time.perf_counter() - start
    return BuildResult(task, status, seconds, messages=kernel.messages if compiled else "")


def _init_worker(parent: int) -> None:
    """Pool initializer: the worker dies with its parent and exits without a teardown."""
    _watch_parent(parent)
    atexit.register(_exit_at_once)


def _exit_at_once() -> None:
    """A pool worker's last atexit handler to run: leave without the interpreter's teardown.

    It runs once the pool has shut the worker down, every result sent (multiprocessing has
    run its finalizers and flushed stdout and stderr by then). Tearing down torch, NVRTC and
    the CuTe DSL took the workers 0.7-1.6 s, which the pool's shutdown, the end of
    ``prebuild``, waited out (docs/prebuild-time.md, session 16). The atexit handlers of the
    modules the worker imported before its initializer (torch, logging) are skipped."""
    os._exit(0)


def _watch_parent(parent: int) -> None:
    """End this worker when the process that started it dies.

    A killed ``prebuild`` would otherwise leave its workers (hundreds of MB each, CuTe
    DSL loaded) compiling on. Linux delivers SIGKILL on the parent's death (prctl
    PR_SET_PDEATHSIG); elsewhere, and for a parent that died before the prctl, a daemon
    thread polls the parent id."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=poll, name="watch-parent", daemon=True).start()


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def worker_pool(jobs: int) -> ProcessPoolExecutor:
    """``jobs`` worker processes that die with this process."""
    # spawn, not fork: the parent may hold a CUDA context, which a fork must not inherit.
    context = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(
        max_workers=jobs, mp_context=context, initializer=_init_worker, initargs=(os.getpid(),)
    )


def build_all(
    tasks: Iterable[BuildTask],
    template_root: Path,
    version: str,
    jobs: int,
    output: Path | None = None,
) -> Iterator[BuildResult]:
    """Build every task, ``jobs`` at a time, yielding results as they finish."""
    grouped = _jobs(list(tasks))
    if jobs <= 1:
        for job in grouped:
            yield from _run_job(job, template_root, version, output)
        return
    with worker_pool(jobs) as pool:
        futures = [pool.submit(_run_job, job, template_root, version, output) for job in grouped]
        for future in as_completed(futures):
            yield from future.result()


def kernel_counts(tasks: Iterable[BuildTask]) -> list[tuple[str, str, int]]:
    """(group, arch, kernels) rows: what ``prebuild --dry-run`` prints, computed from the
    task list alone (nothing rendered, compiled or read from the cache). Groups and archs
    keep the order they first appear in (the archs as asked for: sm_90a before sm_100a)."""
    counts: dict[tuple[str, str], int] = {}
    for task in tasks:
        counts[(task.group, task.arch)] = counts.get((task.group, task.arch), 0) + 1
    groups = {g: i for i, g in enumerate(dict.fromkeys(g for g, _ in counts))}
    archs = {a: i for i, a in enumerate(dict.fromkeys(a for _, a in counts))}
    order = sorted(counts, key=lambda row: (groups[row[0]], archs[row[1]]))
    return [(group, arch, counts[(group, arch)]) for group, arch in order]


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
