"""Replaying a launch plan when an eager call repeats an earlier call's tensor metadata.

An op's checks and launch parameters depend only on its tensors' metadata and its scalar
arguments; a serving engine calls it every step with the same metadata and new addresses.
A hit replays the plan a fully checked call stored: only the addresses (and whatever the
plan itself re-checks, such as their alignment) are new. Two ways to a hit:

- ``recall(scalars, tensors)``, first: the plan last found or stored, when ``scalars``
  equal its scalars and ``tensors`` pass its guard, a C++ check (torch's dynamo
  ``TensorGuards``) that each tensor has exactly the stored one's Python type, dispatch
  keys (device type), dtype, device index, requires_grad, sizes and strides. That is
  stricter than the key below and reads no metadata into Python objects: ~0.35 us for 7
  tensors against ~1.3 us for building the key (timeit, CPU). The dispatch keys depend on
  the thread's mode (inference mode or not), so a guard built in one mode fails in the
  other; ``get`` then rebuilds it. A guard also refuses one tensor object passed in two
  places: such calls are served by the key alone. Where torch has no such guard (a version
  without it, or one whose guard fails the self-test below), ``recall`` finds nothing.
- ``get(key, tensors)``: the key, built in one tuple display (a helper call per tensor
  costs ~60 ns; flashinfer_jit.contract generates it from an op's declared arguments):
  first its ``scalars`` tuple, then for each tensor
  ``t.shape``, ``t.stride()`` (``t.is_contiguous()`` where only density matters),
  ``t.dtype`` and ``t.get_device()`` (-1 on the CPU; it does not name the device type, so
  a process mixing CUDA with another accelerator would need ``t.device``).

``scalars`` holds each scalar after its ``type`` (True == 1 == 1.0, but the checks may
accept one and refuse another; the type first also keeps a tensor passed as a scalar from
being compared with a number; scalars of types whose equal values share one type, such as
str and torch.dtype, may go without it), and whether each optional tensor is None. The
guard's ``tensors`` leave out the optional tensors given as None (the scalars, compared
first, fix which are present, so the positions agree); the key's hold an ``absent()``
stand-in for each (its metadata is a constant).

The environment switches are read on every lookup (``os.environ`` assignments and
``monkeypatch.setenv`` take effect on the next call): no replay while
FLASHINFER_SPECIALIZED_KERNEL_DISABLE=1 or FLASHINFER_VALIDATE_INPUTS=1 (the full path
must run), and plans stored while FLASHINFER_JIT_DISABLE=1 are kept apart from the
others (the full path may choose a prebuilt generic kernel then).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

from .dispatch import DISABLE_ENV, VALIDATE_ENV
from .family import JIT_DISABLE_ENV

Plan = TypeVar("Plan")
Guard = Callable[..., bool]

# ``os.environ.get(name)`` of an unset variable costs ~0.5 us (Mapping.get raises and
# catches a KeyError); CPython's os.environ keeps its contents in ``_data`` under encoded
# keys, which one dict lookup reads in ~20 ns. Where os.environ is some other mapping
# (replaced by a test), lookups miss and the full path reads the switches itself.
_OFF_KEY, _VALIDATE_KEY, _JIT_KEY = (
    os.environ.encodekey(name) for name in (DISABLE_ENV, VALIDATE_ENV, JIT_DISABLE_ENV)
)
_ONE = os.environ.encodevalue("1")


def absent() -> torch.Tensor:
    """A stand-in for an optional tensor argument passed as None, in a replay's ``tensors``:
    one per argument (a guard refuses the same tensor object twice)."""
    return torch.empty(0, device="meta")


def _jit_disabled() -> bool:
    """FLASHINFER_JIT_DISABLE=1, read now."""
    try:
        return os.environ._data.get(_JIT_KEY) == _ONE
    except AttributeError:
        return os.environ.get(JIT_DISABLE_ENV) == "1"


def _never(*tensors) -> bool:
    return False


def _guard_maker() -> Callable[[tuple], Guard] | None:
    """torch's C++ tensor guard as ``make(tensors) -> check(*tensors)``, if this torch has
    one that tells apart every change below (a private API: checked, never assumed)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(tensors: tuple) -> Guard:
            sizes = [list(t.shape) for t in tensors]
            return TensorGuards(
                *tensors,
                dynamic_dims_sizes=sizes,
                dynamic_dims_strides=[list(t.stride()) for t in tensors],
            ).check

        none = absent()
        check = make((torch.zeros(2, 3), none))
        changed = (
            torch.zeros(3, 2),  # shape
            torch.zeros(3, 2).t(),  # strides
            torch.zeros(2, 3, dtype=torch.int32),
            torch.zeros(2, 3, device="meta"),  # device type
            torch.zeros(2, 3, 1),
            torch.zeros(2, 3, requires_grad=True),
        )
        if check(torch.zeros(2, 3), none) and not any(check(t, none) for t in changed):
            return make
    except Exception:  # no usable guard: ``recall`` finds nothing
        pass
    return None


_make_guard = _guard_maker()


def _guard(tensors: tuple) -> Guard:
    """The guard of ``tensors``; ``_never`` where torch has none, or it cannot be built or
    pass ``tensors`` (it refuses a tensor object passed twice): the key still serves."""
    if _make_guard is not None:
        try:
            guard = _make_guard(tensors)
            if guard(*tensors):
                return guard
        except Exception:  # e.g. a layout without strides
            pass
    return _never


# A stored plan: (key, its scalars, guard, plan); scalars ``_NEVER`` (equal to nothing)
# when the plan was stored without tensors, so ``recall`` never returns it.
_NEVER = object()
_EMPTY = (_NEVER, _NEVER, _never, None)


class PlanCache(Generic[Plan]):
    """Metadata key -> launch plan, at most ``maxsize`` plans per FLASHINFER_JIT_DISABLE
    setting (the oldest is dropped first).

    ``replay=True`` (an op's fast path): lookups find nothing while the kernels are
    disabled or input validation is on. ``replay=False`` (a memo inside the full path,
    which reads those switches itself): only FLASHINFER_JIT_DISABLE is honoured.
    """

    __slots__ = ("maxsize", "replay", "_tables", "_last", "_lock")

    def __init__(self, maxsize: int = 256, *, replay: bool = True):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize, self.replay = maxsize, replay
        self._tables: tuple[dict[Hashable, tuple], dict[Hashable, tuple]] = ({}, {})
        # Per table the entry last found or stored: a serving loop repeats one key (every
        # layer the same shapes). ``recall`` checks its guard; ``get`` compares its key
        # before hashing (~0.25 us of ~40 elements). Replaced whole, so a concurrent
        # reader sees one consistent entry.
        self._last: list[tuple] = [_EMPTY, _EMPTY]
        self._lock = threading.Lock()

    def _table(self) -> int | None:
        """The table of the current switches (1: FLASHINFER_JIT_DISABLE=1), None: no lookup."""
        try:
            env = os.environ._data
        except AttributeError:
            return None
        if self.replay and (env.get(_OFF_KEY) == _ONE or env.get(_VALIDATE_KEY) == _ONE):
            return None
        return env.get(_JIT_KEY) == _ONE

    def recall(self, scalars: tuple, tensors: tuple) -> Plan | None:
        """The last plan found or stored, if ``scalars`` equal its scalars and ``tensors``
        (in its order, the optional ones given as None left out) pass its guard; else None
        (then: ``get``)."""
        # _table inlined: this is the hot path of every repeat call.
        try:
            env = os.environ._data
        except AttributeError:
            return None
        if self.replay and (env.get(_OFF_KEY) == _ONE or env.get(_VALIDATE_KEY) == _ONE):
            return None
        _, last_scalars, guard, plan = self._last[env.get(_JIT_KEY) == _ONE]
        if last_scalars == scalars and guard(*tensors):
            return plan
        return None

    def get(self, key: Hashable, tensors: tuple = ()) -> Plan | None:
        """The plan stored under ``key`` for the current switches, else None. ``tensors``
        (as for ``recall``): the call's tensors, which the plan's guard is rebuilt from
        when they fail it (the key matched: a new thread mode)."""
        jit_off = self._table()
        if jit_off is None:
            return None
        entry = self._last[jit_off]
        if entry[0] != key:
            try:
                entry = self._tables[jit_off].get(key)
            except TypeError:  # unhashable: a scalar argument the op's checks will refuse
                return None
            if entry is None:
                return None
        if tensors and entry[2] is not _never and not entry[2](*tensors):
            entry = (key, key[0], _guard(tensors), entry[3])
            with self._lock:
                if key in self._tables[jit_off]:  # not dropped meanwhile
                    self._tables[jit_off][key] = entry
        self._last[jit_off] = entry
        return entry[3]

    def put(self, key: Hashable, plan: Plan, tensors: tuple = ()) -> None:
        """Store ``plan`` under ``key`` for the current FLASHINFER_JIT_DISABLE setting;
        with ``tensors`` (the call's, as for ``recall``; then ``key[0]`` is its scalars)
        ``recall`` may return it."""
        entry = (key, key[0], _guard(tensors), plan) if tensors else (key, _NEVER, _never, plan)
        jit_off = _jit_disabled()
        table = self._tables[jit_off]
        with self._lock:  # the eviction iterates the dict: no other thread may resize it
            if len(table) >= self.maxsize and key not in table:
                del table[next(iter(table))]
            table[key] = entry
            self._last[jit_off] = entry  # never a dropped or replaced plan

    def clear(self) -> None:
        with self._lock:
            for table in self._tables:
                table.clear()
            self._last[:] = [_EMPTY, _EMPTY]

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables)

    def values(self) -> list[Plan]:
        """Every stored plan (both FLASHINFER_JIT_DISABLE settings)."""
        return [entry[3] for table in self._tables for entry in table.values()]
