"""From a KernelSpec to cubin bytes for an arch: render, key, disk cache, compile."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .cache import CubinCache, default_cache_root, prebuilt_roots
from .compile import CompiledKernel, compile_cubin, compiler_identity
from .ptxas import SharedPtx, ptxas_path
from .render import RenderedSource, render
from .spec import KernelSpec, sha256_hex

log = logging.getLogger("flashinfer_jit.jit")


class KernelBuilder:
    """Builds specializations of the kernels under one template root.

    In-process results are memoized per (spec, arch), so a specialization is compiled
    once per arch however many devices or threads ask for it. ``on_compile`` (if set) is
    called before each compile this builder runs, not on cache hits.
    """

    def __init__(self, template_root: Path, version: str, cache: CubinCache | None = None):
        self.template_root = template_root
        self.version = version
        self.on_compile: Callable[[], None] | None = None
        self._cache = cache
        self._built: dict[tuple[KernelSpec, str], CompiledKernel] = {}
        self._locks: dict[tuple[KernelSpec, str], threading.Lock] = {}
        self._guard = threading.Lock()

    @property
    def cache(self) -> CubinCache:
        # Resolved lazily so the environment variables are read when first needed.
        if self._cache is None:
            self._cache = CubinCache(default_cache_root(), prebuilt_roots(), self.version)
        return self._cache

    def cache_key(self, spec: KernelSpec, arch: str) -> str:
        return self._key(render(spec, self.template_root), compiler_identity(spec.compiler), arch)

    def _key(self, rendered: RenderedSource, identity: str, arch: str) -> str:
        return sha256_hex(*rendered.digest_parts(), identity, arch, self.version)

    def lookup(self, spec: KernelSpec, arch: str) -> CompiledKernel | None:
        """The kernel for ``spec`` on ``arch`` from memory or disk; None where only a compile
        gives it. Memoized when found, so ``build`` returns it at once."""
        memo = (spec, arch)
        found = self._built.get(memo)
        if found is None:
            found = self.cache.lookup(arch, spec.family, self.cache_key(spec, arch), spec.label)
            if found is not None:
                found = self._built.setdefault(memo, found)
        return found

    def shared_ptx(self, spec: KernelSpec, archs: Sequence[str]) -> SharedPtx | None:
        """One PTX for ``archs`` (twins: ptxas.ptx_source alike) where two or more of them
        need a compile and the installed NVRTC's ptxas is there (``prebuild``); else None,
        and each arch is compiled by NVRTC alone."""
        need = [arch for arch in archs if self.lookup(spec, arch) is None]
        if spec.compiler != "nvrtc" or len(need) < 2 or ptxas_path() is None:
            return None
        return SharedPtx(render(spec, self.template_root), need)  # (refuses non-twins)

    def build(
        self, spec: KernelSpec, arch: str, shared: SharedPtx | None = None
    ) -> tuple[CompiledKernel, bool]:
        """(kernel, compiled_now) for ``spec`` on ``arch``, from memory, disk or NVRTC (with
        ``shared``, where it covers ``arch``: from its PTX, through ptxas)."""
        memo = (spec, arch)
        if memo in self._built:
            return self._built[memo], False
        with self._guard:
            lock = self._locks.setdefault(memo, threading.Lock())
        with lock:
            if memo in self._built:
                return self._built[memo], False
            if shared is not None and arch not in shared.archs:
                shared = None
            # the key hashes exactly what the shared PTX was compiled from
            rendered = shared.rendered if shared else render(spec, self.template_root)
            identity = compiler_identity(spec.compiler)
            try:
                kernel, compiled = self._get_or_build(spec, arch, rendered, identity, shared)
            except _OtherCompiler as exc:  # the wheel's metadata named another NVRTC
                log.warning("%s; keying %s by the loaded one", exc, spec.label)
                kernel, compiled = self._get_or_build(spec, arch, rendered, exc.identity, shared)
            self._built[memo] = kernel
            return kernel, compiled

    def _get_or_build(
        self,
        spec: KernelSpec,
        arch: str,
        rendered: RenderedSource,
        identity: str,
        shared: SharedPtx | None = None,
    ) -> tuple[CompiledKernel, bool]:
        """From disk, or compiled and stored, under the key of the compiler ``identity``; a
        compile first checks that the loaded compiler is that one. The key is the same
        whether ``shared`` assembles the cubin or NVRTC compiles it: the SASS is."""
        key = self._key(rendered, identity, arch)
        meta = {
            "key": key,
            "family": spec.family,
            "label": spec.label,
            "arch": arch,
            "compiler": identity,
            "version": self.version,
        }

        def compile_now() -> CompiledKernel:
            if self.on_compile is not None:  # first: the library load below then overlaps it
                self.on_compile()
            loaded = compiler_identity(spec.compiler, loaded=True)
            if loaded != identity:  # before any compile: the stored key must name its compiler
                raise _OtherCompiler(identity, loaded)
            log.info("compiling %s for %s", spec.label, arch)
            start = time.perf_counter()
            kernel = shared.compile(arch) if shared else compile_cubin(rendered, arch)
            log.info("compiled %s for %s in %.2f s", spec.label, arch, time.perf_counter() - start)
            if kernel.messages:  # a warning nobody reads is a slow kernel nobody sees
                log.warning("compiling %s for %s: %s", spec.label, arch, kernel.messages)
            return kernel

        return self.cache.get_or_build(arch, spec.family, key, meta, compile_now)


class _OtherCompiler(Exception):
    """The installed NVRTC wheel is not the library cuda-bindings loaded."""

    def __init__(self, installed: str, loaded: str):
        super().__init__(f"the installed NVRTC is {installed!r} but the loaded one {loaded!r}")
        self.identity = loaded
