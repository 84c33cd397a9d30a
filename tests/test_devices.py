"""Per-device kernel bookkeeping, without GPUs: the loader and the arch query are faked."""

from __future__ import annotations

import threading

import pytest

import jit_kernels.family as family_mod
from jit_kernels import PTR, CubinCache, KernelBuilder, KernelFamily, KernelUnavailable

from .test_engine import TEMPLATES


class _FakeLoaded:
    loads: list[tuple[str, int]] = []

    threads: list[str] = []

    def __init__(self, compiled, device, packer, name):
        self.compiled, self.device = compiled, device
        _FakeLoaded.loads.append((name, device))
        _FakeLoaded.threads.append(threading.current_thread().name)


@pytest.fixture
def two_devices(monkeypatch, tmp_path):
    _FakeLoaded.loads = []
    archs = {0: "sm_90a", 1: "sm_90a", 2: "sm_100a"}
    monkeypatch.setattr(family_mod, "LoadedKernel", _FakeLoaded)
    monkeypatch.setattr(family_mod, "device_arch", lambda device: archs[device])
    builder = KernelBuilder(TEMPLATES, "9.9.9", CubinCache(tmp_path, [], "9.9.9"))
    compiled = []
    real_build = builder.build

    def counting_build(spec, arch):
        result = real_build(spec, arch)
        if result[1]:
            compiled.append((spec.label, arch))
        return result

    builder.build = counting_build
    fam = KernelFamily(
        builder,
        "mla_kv_pack",
        "mla_kv_pack/sm90_warp_cvt.cuh",
        "fij_mla::concat_mla_kv_quant_fp8",
        ("num_heads", "unroll"),
        (PTR,),
    )
    return fam, compiled


def test_one_compile_per_arch_one_load_per_device(two_devices):
    fam, compiled = two_devices
    for device in (0, 1, 0, 1, 2):
        kernel = fam.get((0, 4), device)
        assert kernel.device == device  # a handle is only ever the one loaded on that device
    assert sorted(compiled) == sorted(
        [
            ("mla_kv_pack[num_heads=0,unroll=4]", "sm_90a"),
            ("mla_kv_pack[num_heads=0,unroll=4]", "sm_100a"),
        ]
    )
    assert sorted(d for _, d in _FakeLoaded.loads) == [0, 1, 2]


def test_threads_share_compiles(two_devices):
    fam, compiled = two_devices
    results: list = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        results.append(fam.get((12, 6), i % 2))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(k.device in (0, 1) for k in results)
    assert compiled == [("mla_kv_pack[num_heads=12,unroll=6]", "sm_90a")]
    assert len({id(k) for k in results if k.device == 0}) == 1


def test_jit_disabled_uses_only_prebuilt(two_devices, monkeypatch):
    fam, compiled = two_devices
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")
    with pytest.raises(KernelUnavailable, match="not prebuilt"):
        fam.get((0, 4), 0)
    assert compiled == []
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE")
    fam.get((0, 4), 0)  # compiles into the cache
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")
    assert fam.get((0, 4), 1).device == 1  # found in the cache, no compiler needed
    assert len(compiled) == 1


def test_prepare_builds_at_once(two_devices, monkeypatch):
    fam, compiled = two_devices
    counting_build, arrived = fam.builder.build, threading.Barrier(2, timeout=120)

    def build(spec, arch):
        arrived.wait()  # both compiles are in flight together, or this times out
        return counting_build(spec, arch)

    monkeypatch.setattr(fam.builder, "build", build)
    _FakeLoaded.threads = []
    family_mod.prepare([(fam, (0, 4)), (fam, (12, 6)), (fam, (0, 4))], 0)
    # Loaded in the caller's thread, where its CUDA context is current: a new thread has
    # none (cuKernelGetFunction: CUDA_ERROR_INVALID_CONTEXT on the H200).
    assert _FakeLoaded.threads == [threading.current_thread().name] * 2
    assert sorted(compiled) == [
        ("mla_kv_pack[num_heads=0,unroll=4]", "sm_90a"),
        ("mla_kv_pack[num_heads=12,unroll=6]", "sm_90a"),
    ]
    loads = list(_FakeLoaded.loads)
    monkeypatch.setattr(family_mod, "ThreadPoolExecutor", None)  # no thread may start now
    family_mod.prepare([(fam, (0, 4)), (fam, (12, 6))], 0)  # both loaded
    assert fam.get((12, 6), 0).device == 0 and _FakeLoaded.loads == loads
    family_mod.prepare([(fam, (0, 4)), (fam, (12, 6))], 1)  # both cached: the gets load them
    assert len(compiled) == 2


def test_prepare_raises_the_first_failure_in_order(two_devices, monkeypatch):
    fam, compiled = two_devices
    counting_build = fam.builder.build

    def build(spec, arch):
        if dict(spec.params)["num_heads"] == 0:
            raise ImportError("no NVRTC here")
        return counting_build(spec, arch)

    monkeypatch.setattr(fam.builder, "build", build)
    with pytest.raises(KernelUnavailable, match="no NVRTC here"):
        family_mod.prepare([(fam, (0, 4)), (fam, (12, 6))], 1)
    assert compiled == [("mla_kv_pack[num_heads=12,unroll=6]", "sm_90a")]  # built all the same
    assert _FakeLoaded.loads == [("mla_kv_pack[num_heads=12,unroll=6]", 1)]
