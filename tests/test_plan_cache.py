"""jit_kernels.plan_cache: lookups, the environment switches per call, the bound."""

from __future__ import annotations

import os

import pytest

from jit_kernels.plan_cache import PlanCache

SWITCHES = ("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "FLASHINFER_VALIDATE_INPUTS")


@pytest.fixture(autouse=True)
def no_switches(monkeypatch):
    for name in (*SWITCHES, "FLASHINFER_JIT_DISABLE"):
        monkeypatch.delenv(name, raising=False)


def test_get_put_and_clear():
    cache = PlanCache()
    assert cache.get(("a", 1)) is None
    cache.put(("a", 1), "plan a")
    cache.put(("b", 1), "plan b")
    assert cache.get(("a", 1)) == "plan a" and cache.get(("b", 1)) == "plan b"
    assert cache.get(("a", 1)) == "plan a"  # again, through the last-hit shortcut
    assert cache.get(("a", True)) == "plan a"  # why keys put each scalar's type first
    assert cache.get(("a", 2)) is None and len(cache) == 2
    cache.put(("a", 1), "plan a2")  # replacing a plan also replaces the last hit
    assert cache.get(("a", 1)) == "plan a2"
    cache.clear()
    assert len(cache) == 0 and cache.get(("a", 1)) is None


@pytest.mark.parametrize("name", SWITCHES)
def test_switches_stop_replays_from_the_next_call(monkeypatch, name):
    cache, memo = PlanCache(), PlanCache(replay=False)
    for c in (cache, memo):
        c.put("key", "plan")
        assert c.get("key") == "plan"
    monkeypatch.setenv(name, "1")
    assert cache.get("key") is None  # a replay cache: the full path must run
    assert memo.get("key") == "plan"  # a memo of the full path: unaffected
    os.environ[name] = "0"  # only "1" switches
    assert cache.get("key") == "plan"
    os.environ[name] = "1"
    assert cache.get("key") is None
    monkeypatch.delenv(name)
    assert cache.get("key") == "plan"


@pytest.mark.parametrize("replay", [True, False])
def test_jit_disable_keeps_its_own_plans(monkeypatch, replay):
    cache = PlanCache(replay=replay)
    cache.put("key", "jit on")
    monkeypatch.setenv("FLASHINFER_JIT_DISABLE", "1")
    assert cache.get("key") is None  # the full path may choose differently without a compiler
    cache.put("key", "jit off")
    assert cache.get("key") == "jit off" and len(cache) == 2
    monkeypatch.delenv("FLASHINFER_JIT_DISABLE")
    assert cache.get("key") == "jit on"
    assert sorted(cache.values()) == ["jit off", "jit on"]


def test_bounded_oldest_first():
    cache = PlanCache(maxsize=4)
    for i in range(10):
        cache.put(i, f"plan {i}")
        assert len(cache) == min(i + 1, 4)
    assert [cache.get(i) for i in range(10)] == [None] * 6 + [f"plan {i}" for i in range(6, 10)]
    cache.put(9, "plan 9b")  # replacing drops nothing
    assert len(cache) == 4 and cache.get(6) == "plan 6"
    with pytest.raises(ValueError, match="maxsize"):
        PlanCache(maxsize=0)


def test_other_environ_mapping_never_replays(monkeypatch):
    """A test that replaces os.environ with a plain mapping gets no replay (the full path
    reads the switches itself), and storing still works."""
    cache = PlanCache()
    cache.put("key", "plan")
    with monkeypatch.context() as patch:
        patch.setattr(os, "environ", dict(os.environ))
        assert cache.get("key") is None
        cache.put("other", "plan")
    assert cache.get("key") == "plan" and cache.get("other") == "plan"
