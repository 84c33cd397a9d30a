"""Replaying a launch plan when an eager call repeats an earlier call's tensor metadata.

An op's checks and launch parameters depend only on its tensors' metadata and its scalar
arguments; a serving engine calls it every step with the same metadata and new addresses.
The op builds a key from that metadata, and a hit replays the plan a fully checked call
stored under it: only the addresses (and whatever the plan itself re-checks, such as their
alignment) are new. The op builds the key inline, in one tuple display, because a helper
call per tensor costs ~60 ns of host time (timeit, CPU): for each tensor ``t.shape``,
``t.stride()`` (``t.is_contiguous()`` where only density matters), ``t.dtype`` and
``t.get_device()`` (-1 on the CPU; the cheapest read, ~40 ns, though it does not name
the device type: a process mixing CUDA with another accelerator would need ``t.device``,
~0.1 us more a tensor with its hash); each scalar after its
``type`` (True == 1 == 1.0, but the checks may accept one and refuse another; keys are
compared element by element, and the type first keeps a tensor passed as a scalar from
being compared with a number); and every module-level switch the dispatch reads at call
time (tests and benchmarks flip them).

The environment switches are read on every ``get`` (``os.environ`` assignments and
``monkeypatch.setenv`` take effect on the next call): no replay while
FLASHINFER_SPECIALIZED_KERNEL_DISABLE=1 or FLASHINFER_VALIDATE_INPUTS=1 (the full path
must run), and plans stored while FLASHINFER_JIT_DISABLE=1 are kept apart from the
others (the full path may choose a prebuilt generic kernel then).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

from .dispatch import DISABLE_ENV, VALIDATE_ENV
from .family import JIT_DISABLE_ENV

Plan = TypeVar("Plan")

# ``os.environ.get(name)`` of an unset variable costs ~0.5 us (Mapping.get raises and
# catches a KeyError); CPython's os.environ keeps its contents in ``_data`` under encoded
# keys, which one dict lookup reads in ~20 ns. Where os.environ is some other mapping
# (replaced by a test), ``get`` misses and the full path reads the switches itself.
_OFF_KEY, _VALIDATE_KEY, _JIT_KEY = (
    os.environ.encodekey(name) for name in (DISABLE_ENV, VALIDATE_ENV, JIT_DISABLE_ENV)
)
_ONE = os.environ.encodevalue("1")


def _jit_disabled() -> bool:
    """FLASHINFER_JIT_DISABLE=1, read now."""
    try:
        return os.environ._data.get(_JIT_KEY) == _ONE
    except AttributeError:
        return os.environ.get(JIT_DISABLE_ENV) == "1"


class PlanCache(Generic[Plan]):
    """Metadata key -> launch plan, at most ``maxsize`` plans per FLASHINFER_JIT_DISABLE
    setting (the oldest is dropped first).

    ``replay=True`` (an op's fast path): ``get`` finds nothing while the kernels are
    disabled or input validation is on. ``replay=False`` (a memo inside the full path,
    which reads those switches itself): only FLASHINFER_JIT_DISABLE is honoured.
    """

    __slots__ = ("maxsize", "replay", "_tables", "_last", "_lock")

    def __init__(self, maxsize: int = 256, *, replay: bool = True):
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize, self.replay = maxsize, replay
        self._tables: tuple[dict[Hashable, Plan], dict[Hashable, Plan]] = ({}, {})
        # Per table the last (key, plan) found: a serving loop repeats one key (every layer
        # the same shapes), and comparing with it skips hashing the key (~0.25 us of ~40
        # elements). Replaced whole, so a concurrent reader sees one consistent pair.
        self._last: list[tuple[Hashable, Plan | None]] = [(None, None), (None, None)]
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Plan | None:
        """The plan stored under ``key`` for the current switches, else None."""
        try:
            env = os.environ._data
        except AttributeError:
            return None
        if self.replay and (env.get(_OFF_KEY) == _ONE or env.get(_VALIDATE_KEY) == _ONE):
            return None
        jit_off = env.get(_JIT_KEY) == _ONE
        last_key, plan = self._last[jit_off]
        if last_key == key:
            return plan
        plan = self._tables[jit_off].get(key)
        if plan is not None:
            self._last[jit_off] = (key, plan)
        return plan

    def put(self, key: Hashable, plan: Plan) -> None:
        """Store ``plan`` under ``key`` for the current FLASHINFER_JIT_DISABLE setting."""
        jit_off = _jit_disabled()
        table = self._tables[jit_off]
        with self._lock:  # the eviction iterates the dict: no other thread may resize it
            if len(table) >= self.maxsize and key not in table:
                del table[next(iter(table))]
            table[key] = plan
            self._last[jit_off] = (key, plan)  # never a dropped or replaced plan

    def clear(self) -> None:
        with self._lock:
            for table in self._tables:
                table.clear()
            self._last[:] = [(None, None), (None, None)]

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables)

    def values(self) -> list[Plan]:
        """Every stored plan (both FLASHINFER_JIT_DISABLE settings)."""
        return [plan for table in self._tables for plan in table.values()]
