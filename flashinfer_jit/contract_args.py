"""The op contract's argument declarations (``TensorArg``, ``ScalarArg``) and the source
text generated from them: the readers of a call's replay scalars, key and guard tensors,
and the call path a ``contract.Runner`` and each public function run
(``flashinfer_jit.contract``; the replay rules are ``jit_kernels.plan_cache``'s)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jit_kernels.plan_cache import absent

REQUIRED = object()  # a ScalarArg without a default


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A tensor argument. ``dense``: the kernels read it densely (a contiguous copy if not),
    so the replay key holds its contiguity, not its strides. ``optional``: None allowed.
    ``mutated``: an output (allocated by ``prepare`` when given as None)."""

    name: str
    dense: bool = False
    optional: bool = False
    mutated: bool = False

    def schema(self, alias: str) -> str:
        if self.mutated:
            return f"Tensor({alias}!) {self.name}"
        return f"Tensor{'?' if self.optional else ''} {self.name}"


@dataclasses.dataclass(frozen=True)
class ScalarArg:
    """A scalar argument; ``schema_type`` is its torch schema type (int, float, bool, str,
    ScalarType); ``default`` what ``Runner.call`` passes when it is not named (REQUIRED:
    it must be). ``typed``: the replay compares its type too (True == 1 == 1.0, but the
    checks may accept one and refuse another); not needed where only equal values of one
    type compare equal (str, torch.dtype)."""

    name: str
    schema_type: str
    default: Any = dataclasses.field(default_factory=lambda: REQUIRED)
    typed: bool = True

    def schema(self, alias: str) -> str:
        default = self.default
        if isinstance(default, bool | int | float | str) and self.schema_type != "ScalarType":
            return f"{self.schema_type} {self.name}={default!r}"  # older callers may omit it
        return f"{self.schema_type} {self.name}"


Arg = TensorArg | ScalarArg


def readers(args: Sequence[Arg], refs: Sequence[str]) -> tuple[str, str, str, dict]:
    """(scalars, tensors, guarded, stand-ins): the expressions that read a call's replay
    scalars, its key's tensors and its guard's (``refs``: each declared argument's
    expression), and the ``absent()`` stand-ins the key's name. The guard's leave out an
    optional tensor given as None (the scalars say which are): a stand-in there would cost
    each such call a tensor check (~0.1 us, CPU)."""
    scalars, tensors, env = [], [], {}
    required, optional = [], []
    for i, (arg, ref) in enumerate(zip(args, refs, strict=True)):
        if isinstance(arg, ScalarArg):
            scalars.append(f"type({ref}), {ref}" if arg.typed else ref)
        elif arg.optional:
            env[f"_none{i}"] = absent()  # one stand-in each: a guard refuses one twice
            scalars.append(f"{ref} is None")
            tensors.append(f"_none{i} if {ref} is None else {ref}")
            optional.append(ref)
        else:
            tensors.append(ref)
            required.append(ref)
    return tuple_display(scalars), tuple_display(tensors), present(required, optional), env


def present(given: list[str], optional: list[str]) -> str:
    """A tuple of ``given`` and those of ``optional`` that are not None: one tuple display
    per None pattern, chosen by nested conditionals (concatenating a tuple per optional
    would cost a call whose optionals are all given ~0.03 us each)."""
    if not optional:
        return tuple_display(given)
    first, rest = optional[0], optional[1:]
    given_first, missing = present([*given, first], rest), present(given, rest)
    return f"({given_first} if {first} is not None else {missing})"


def tuple_display(items: list[str]) -> str:
    return f"({', '.join(items)},)" if items else "()"


def key_parts(args: Sequence[Arg]) -> str:
    """The key's per-tensor parts (jit_kernels.plan_cache) of the tensors ``t``."""
    dense = [arg.dense for arg in args if isinstance(arg, TensorArg)]
    parts = []
    for j, is_dense in enumerate(dense):
        layout = "is_contiguous()" if is_dense else "stride()"
        parts.append(f"t[{j}].shape, t[{j}].{layout}, t[{j}].dtype, t[{j}].get_device()")
    return ", ".join(parts)


# A runner's call path, generated per op with its argument readers inlined: a loop over
# the declaration, or a helper call per step, would cost a repeat call ~0.1-1 us more.
# ``{args}`` are the call's args in the declared order (``_a``'s items in ``_run``, the
# parameters themselves in a public function); every name starts with an underscore, so
# none is shadowed by a public function's parameter (entry).
CALL_PATH = """
    if _is_compiling():
        return _traced(({args},))
    _s, _t = {scalars}, {guarded}
    _plan, _k = _recall(_s, _t), None
    if _plan is None:
        _k = _key(_s, {tensors})
        _plan = _get(_k, _t)
    if _plan is not None:
        _r = _plan.run({args})
        if _r is not None:
            return _r
        if _k is None:  # a recalled plan declined these addresses: the full path decides
            _k = _key(_s, {tensors})
    return _full(({args},), _k, _t)
"""
READERS = """
def _inputs(_a):
    return {scalars}, {tensors}

def _key(s, t):
    try:
        return (s, {parts})
    except (AttributeError, TypeError, IndexError):
        return None

def _run(_a):"""
