"""jit_kernels.plan_cache: lookups, the environment switches per call, the bound."""

from __future__ import annotations

import os

import pytest
import torch

from jit_kernels import plan_cache
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


# -- recall: the last plan's guard ------------------------------------------------------------
needs_guard = pytest.mark.skipif(
    plan_cache._make_guard is None, reason="this torch has no usable tensor guard"
)


def _tensors():
    return (torch.zeros(4, 6), torch.zeros(3, dtype=torch.int32), plan_cache.absent())


def _stored(scalars=("s", 1)):
    cache, tensors = PlanCache(), _tensors()
    cache.put((scalars, "metadata"), "plan", tensors)
    return cache, tensors


@needs_guard
def test_recall_repeats_only_the_exact_metadata():
    cache, tensors = _stored()
    a, b, none = _tensors()
    assert cache.recall(("s", 1), (a, b, none)) == "plan"  # new tensors, same metadata
    changed = {
        "shape": torch.zeros(6, 4),
        "strides": torch.zeros(6, 4).t(),
        "dtype": torch.zeros(4, 6, dtype=torch.float16),
        "device type": torch.zeros(4, 6, device="meta"),
        "rank": torch.zeros(4, 6, 1),
        "requires_grad": torch.zeros(4, 6, requires_grad=True),
        "given for None": torch.empty(0, device="meta"),  # another object, same metadata
    }
    for name, t in changed.items():
        if name == "given for None":  # an optional tensor's None-ness is in the scalars
            assert cache.recall(("s", 1, "given"), (a, b, t)) is None
        else:
            assert cache.recall(("s", 1), (t, b, none)) is None, name
    assert cache.recall(("s", 2), (a, b, none)) is None  # other scalars
    assert cache.recall(("s", 1), (a.tolist(), b, none)) is None  # not a tensor: no error
    assert cache.recall(("s", 1), (a, b, none)) == "plan"


@needs_guard
def test_recall_follows_the_last_plan_found():
    cache, (a, b, none) = _stored(("s", 1))
    c = torch.zeros(5, 6)
    cache.put((("s", 2), "other"), "plan 2", (c, b, none))
    assert cache.recall(("s", 1), (a, b, none)) is None  # not the last plan
    assert cache.get((("s", 1), "metadata"), (a, b, none)) == "plan"
    assert cache.recall(("s", 1), (a, b, none)) == "plan"
    assert cache.recall(("s", 2), (c, b, none)) is None


@needs_guard
@pytest.mark.parametrize("name", [*SWITCHES, "FLASHINFER_JIT_DISABLE"])
def test_recall_honours_the_switches(monkeypatch, name):
    cache, tensors = _stored()
    monkeypatch.setenv(name, "1")
    assert cache.recall(("s", 1), tensors) is None
    monkeypatch.delenv(name)
    assert cache.recall(("s", 1), tensors) == "plan"


@needs_guard
def test_recall_never_returns_a_plan_stored_without_tensors():
    cache, tensors = PlanCache(), _tensors()
    cache.put((("s", 1), "metadata"), "plan")
    assert cache.recall(("s", 1), tensors) is None
    assert cache.get((("s", 1), "metadata"), tensors) == "plan"  # the key still serves
    assert cache.recall(("s", 1), tensors) is None


@needs_guard
def test_a_tensor_passed_twice_is_served_by_the_key():
    """The guard refuses one tensor object in two places: such calls replay through the key
    (and the guard is not rebuilt on every call)."""
    cache, (a, b, _) = PlanCache(), _tensors()
    cache.put((("s",), "metadata"), "plan", (a, a, b))
    for _ in range(2):
        assert cache.recall(("s",), (a, a, b)) is None
        assert cache.get((("s",), "metadata"), (a, a, b)) == "plan"
    assert cache._last[0][2] is plan_cache._never


@needs_guard
def test_guard_is_rebuilt_in_a_new_thread_mode():
    """Inference mode changes the dispatch keys a guard compares: the first call there
    misses, the key serves it and rebuilds the guard, and the next call recalls."""
    cache, tensors = _stored()
    with torch.inference_mode():
        fresh = _tensors()
        assert cache.recall(("s", 1), fresh) is None
        assert cache.get((("s", 1), "metadata"), fresh) == "plan"
        assert cache.recall(("s", 1), fresh) == "plan"


def test_without_a_guard_the_key_serves(monkeypatch):
    monkeypatch.setattr(plan_cache, "_make_guard", None)
    cache, tensors = _stored()
    assert cache.recall(("s", 1), tensors) is None
    assert cache.get((("s", 1), "metadata"), tensors) == "plan"
    assert cache.get((("s", [1]), "metadata"), tensors) is None  # unhashable: no error


def test_this_torch_has_a_guard():
    """The recall path is what makes repeat calls cheap: a torch upgrade that loses it
    should be noticed (the ops stay correct through the key)."""
    assert plan_cache._make_guard is not None
