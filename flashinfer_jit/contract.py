"""The op contract: what every op supplies, and the one call path all ops share.

An op is an ``Op`` subclass. It declares its arguments (``TensorArg`` / ``ScalarArg``, in
the public order) and supplies:

- ``prepare(args)``: check every argument (``ValueError``/``TypeError`` naming it and the
  rule) and allocate the outputs the caller left as None; return the completed args;
- ``refusal(args)``: why its kernels cannot serve a checked call (None: they can);
- ``plan(args, options)``: a ``LaunchPlan`` (a typed, slotted object holding everything
  but the tensors' addresses), or ``KernelUnavailable``;
- ``reference(args)``: the torch implementation that defines the semantics;
- ``result(args)``: what the public function returns;
- ``prebuild_specs(workloads, options)``: the specializations the shipped workloads reach
  (``prebuilt_on``: on which archs, where the dispatcher launches some on some only).

``Runner`` is the call path, written once: replay fast path -> checks -> plan -> launch,
or the torch path with the reason reported once (``jit_kernels.fall_back``). The replay
key and guard come from the declared tensor arguments (``jit_kernels.plan_cache``); the
code that reads them out of a call is generated once per op (``contract_args``, beside
the argument declarations), so a repeat call costs what a hand-written one did: a tuple
display, the guard, a dict lookup and the launch.
Each op is registered as a torch custom op with a fake (``torch.compile`` keeps it).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch
from torch.compiler import is_compiling as _is_compiling  # one global, not two lookups

from jit_kernels import KernelSpec, KernelUnavailable, fall_back, kernels_disabled
from jit_kernels.plan_cache import PlanCache

from . import workload_format
from .contract_args import (
    CALL_PATH,
    READERS,
    REQUIRED,
    Arg,
    ScalarArg,
    TensorArg,
    key_parts,
    readers,
)
from .workload_format import Fields

__all__ = ["REQUIRED", "Arg", "LaunchPlan", "Op", "Options", "Runner", "ScalarArg", "TensorArg"]


@dataclasses.dataclass(frozen=True)
class Options:
    """An op's variant choices (frozen, typed). The defaults are the shipped choices; tests
    and tools pass others to ``Op.runner`` to compare variants."""


class LaunchPlan(Protocol):
    """A checked call's launch with everything but the addresses fixed by its metadata."""

    replay: bool  # whether a repeat call may replay it

    def run(self, *args: Any) -> Any:
        """Launch for ``args`` (the op's, in the declared order) on the current stream and
        return the op's result; None, with nothing launched, when an address breaks what the
        metadata cannot fix (alignment)."""


PlanT = TypeVar("PlanT", bound=LaunchPlan)
OptionsT = TypeVar("OptionsT", bound=Options)


class Op(Generic[PlanT, OptionsT]):
    """One op: its arguments, checks, refusal reasons, planner, reference and specs."""

    name: ClassVar[str]  # the CLI's and the registry's name
    log_name: ClassVar[str]  # what fallbacks are reported as
    custom_op: ClassVar[str]  # torch.ops.flashinfer_jit.<custom_op>
    workloads: ClassVar[Path]  # the shipped workloads (the op package's workloads.json)
    workload_fields: ClassVar[Fields]  # the fields of its workloads files, with their rules
    args: ClassVar[tuple[Arg, ...]]
    options_type: ClassVar[type[Options]] = Options

    def __init__(self) -> None:
        self._runners: dict[Options, Runner] = {}
        self._lock = threading.Lock()
        self.default = self.runner(self.options_type())
        self._register()

    # -- what each op supplies ---------------------------------------------------------------
    def prepare(self, args: tuple) -> tuple:
        raise NotImplementedError

    def empty(self, args: tuple) -> bool:
        """Nothing to compute (no rows): neither kernels nor the torch path run."""
        return False

    def kernel_call(self, args: tuple) -> bool:
        """Whether the kernels are meant for this checked call at all (False: the torch
        path without a report, e.g. CPU tensors)."""
        first = args[0]
        return first.device.type == "cuda"

    def refusal(self, args: tuple) -> str | None:
        raise NotImplementedError

    def plan(self, args: tuple, options: OptionsT) -> PlanT:
        raise NotImplementedError

    def reference(self, args: tuple) -> None:
        raise NotImplementedError

    def result(self, args: tuple) -> Any:
        raise NotImplementedError

    def prebuild_specs(self, workloads: dict, options: OptionsT) -> list[KernelSpec]:
        raise NotImplementedError

    def prebuilt_on(self, spec: KernelSpec, arch: str) -> bool:
        """Whether prebuild builds ``spec`` for ``arch``: every arch it compiles for."""
        return spec.supports(arch)

    # -- shared ----------------------------------------------------------------------------
    def check_workloads(self, data: dict, where: str) -> None:
        """Rules across a workloads file's fields, beyond each field's own (WorkloadError)."""

    def load_workloads(self) -> dict:
        """The shipped workloads, validated (workload_format)."""
        return workload_format.load(self.workloads, {self.name: self})

    def runner(self, options: OptionsT) -> Runner[PlanT, OptionsT]:
        """The call path with ``options`` (one per distinct options, each with its own
        replay cache, so options never enter a replay key)."""
        found = self._runners.get(options)
        if found is None:
            if not isinstance(options, self.options_type):
                raise TypeError(f"{self.name} takes {self.options_type.__name__}, got {options!r}")
            with self._lock:
                found = self._runners.setdefault(options, Runner(self, options))
        return found

    def entry(self, **fixed: Any) -> Callable[[Callable], Callable]:
        """Decorate the op's public function: its signature (parameters named as the declared
        args) and docstring are kept, its body is the shipped options' call path. ``fixed``:
        declared args the public function does not take (e.g. an entry point's flag)."""
        return lambda fn: self.default.entry(fn, fixed)

    def serve(self, args: tuple, options: OptionsT) -> PlanT | None:
        """Run a checked call on the kernels, else the torch path; return the plan a repeat
        call may replay (None: torch served, nothing to do, or not replayable)."""
        if self.empty(args):
            return None
        if not kernels_disabled() and self.kernel_call(args):
            reason = self.refusal(args)
            if reason is None:
                try:
                    plan = self.plan(args, options)
                except KernelUnavailable as exc:
                    reason = str(exc)
                else:
                    if plan.run(*args) is None:  # the refusal checked the addresses
                        raise ValueError(f"{self.log_name}: a tensor is misaligned for its kernel")
                    return plan if plan.replay else None
            fall_back(self.log_name, reason)
        self.reference(args)
        return None

    def _register(self) -> None:
        mutated = tuple(a.name for a in self.args if isinstance(a, TensorArg) and a.mutated)
        aliases = dict(zip(mutated, "abcdefghij", strict=False))  # one alias per output
        fields = ", ".join(a.schema(aliases.get(a.name, "")) for a in self.args)
        default = self.default
        # The dispatcher drops trailing arguments equal to their schema defaults: restore them.
        defaults = tuple(a.default if isinstance(a, ScalarArg) else None for a in self.args)

        # A compiled call's op runs the eager call path: its values checked, its launch
        # replayed after the first (the trace checked only the arguments' metadata).
        def impl(*args) -> None:
            default.run((*args, *defaults[len(args) :]))

        registered = torch.library.custom_op(
            f"flashinfer_jit::{self.custom_op}",
            impl,
            mutates_args=mutated,
            schema=f"({fields}) -> ()",
        )
        registered.register_fake(_writes_outputs_only)
        self.traced = registered


def _writes_outputs_only(*args) -> None:  # the op writes only outputs the caller holds
    return None


class Runner(Generic[PlanT, OptionsT]):
    """An op's call path with one set of options, and its replay cache.

    ``run(args)`` (``args`` in the op's declared order) is what the public function calls:
    a call whose tensors repeat an earlier kernel call's metadata (and scalars) replays
    that call's plan with the new addresses, skipping checks and planning; any other call
    is checked, planned and launched (or served by torch) and its plan stored. ``inputs``
    and ``key`` read a call's replay scalars, its key's tensors and its key
    (jit_kernels.plan_cache).
    """

    def __init__(self, op: Op[PlanT, OptionsT], options: OptionsT):
        self.op, self.options = op, options
        self.replays: PlanCache[PlanT] = PlanCache()  # bound below: clear it, never replace
        refs = [f"_a[{i}]" for i in range(len(op.args))]
        scalars, tensors, guarded, self._env = readers(op.args, refs)
        self._env.update(
            _is_compiling=_is_compiling,
            _traced=self._traced,
            _recall=self.replays.recall,
            _get=self.replays.get,
            _full=self._full,
        )
        source = READERS.format(scalars=scalars, tensors=tensors, parts=key_parts(op.args))
        path = CALL_PATH.format(args="*_a", scalars=scalars, tensors=tensors, guarded=guarded)
        self._exec(source + path)
        self.run: Callable[[tuple], Any] = self._env["_run"]
        self.inputs: Callable[[tuple], tuple] = self._env["_inputs"]
        self.key: Callable[[tuple, tuple], tuple | None] = self._env["_key"]

    def _exec(self, source: str) -> None:
        code = compile(source, f"<flashinfer_jit.contract {self.op.name}>", "exec")
        exec(code, self._env)  # noqa: S102 (the package's own generated source)

    def entry(self, fn: Callable, fixed: dict[str, Any]) -> Callable:
        """A public function with ``fn``'s signature and docstring whose body is this call
        path reading its parameters directly (one frame and a tuple index per argument less
        than calling ``run``)."""
        sig = inspect.signature(fn)
        names = [a.name for a in self.op.args]
        if set(sig.parameters) | set(fixed) != set(names) or set(sig.parameters) & set(fixed):
            raise TypeError(
                f"{fn.__name__}: parameters {list(sig.parameters)} + {fixed} != {names}"
            )
        if any(name.startswith("_") for name in names):
            raise TypeError(f"{self.op.name}: argument names may not start with '_' ({names})")
        params, star = [], False
        for p in sig.parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                params.append("*")
                star = True
            default = ""
            if p.default is not p.empty:  # names of their own: entries share the env
                self._env[f"_default_{fn.__name__}_{p.name}"] = p.default
                default = f"=_default_{fn.__name__}_{p.name}"
            params.append(p.name + default)
        for name, value in fixed.items():
            self._env[f"_fixed_{fn.__name__}_{name}"] = value
        refs = [n if n in sig.parameters else f"_fixed_{fn.__name__}_{n}" for n in names]
        scalars, tensors, guarded, _ = readers(self.op.args, refs)  # the same stand-ins
        path = CALL_PATH.format(
            args=", ".join(refs), scalars=scalars, tensors=tensors, guarded=guarded
        )
        self._exec(f"def {fn.__name__}({', '.join(params)}):" + path)
        return functools.update_wrapper(self._env.pop(fn.__name__), fn)

    def __call__(self, args: tuple) -> Any:
        return self.run(args)

    def _full(self, args: tuple, key: tuple | None, tensors: tuple) -> Any:
        """The full path: checks, then the kernels (or torch); the plan stored under ``key``."""
        op = self.op
        args = op.prepare(args)
        plan = op.serve(args, self.options)  # eager calls skip the custom-op dispatcher
        if plan is not None and key is not None:
            self.replays.put(key, plan, tensors)
        return op.result(args)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        """``__call__`` with the arguments as the public function takes them (tests and
        tools): positional in the declared order, then by name; optional tensors and
        scalars with a default may be left out."""
        names = [a.name for a in self.op.args]
        if len(args) > len(names) or any(n in kwargs for n in names[: len(args)]):
            raise TypeError(
                f"{self.op.name}: arguments {names}, got {len(args)} + {sorted(kwargs)}"
            )
        kwargs.update(zip(names, args, strict=False))
        args = []
        for arg in self.op.args:
            if arg.name in kwargs:
                args.append(kwargs.pop(arg.name))
            elif isinstance(arg, TensorArg) and arg.optional:
                args.append(None)
            elif isinstance(arg, ScalarArg) and arg.default is not REQUIRED:
                args.append(arg.default)
            else:
                raise TypeError(f"{self.op.name}: missing argument {arg.name!r}")
        if kwargs:
            raise TypeError(f"{self.op.name}: unknown arguments {sorted(kwargs)}")
        return self(tuple(args))

    def _traced(self, args: tuple) -> Any:
        if self is not self.op.default:
            raise RuntimeError(
                f"{self.op.name}: a runner with non-default options is eager-only "
                "(torch.compile records the op's custom op, which takes the shipped choices)"
            )
        args = self.op.prepare(args)
        self.op.traced(*args)
        return self.op.result(args)
