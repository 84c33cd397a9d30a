"""The workloads file format: what ``prebuild`` compiles, shipped and user-written alike.

One JSON object per file. ``"op"`` names the op (a key of the registry); the other keys
are the fields that op declares (``Op.workload_fields``: lists of the values to prebuild
for, with the rules below); ``"description"`` (text) is allowed everywhere. The shipped
files (each op package's ``workloads.json``) are in this format, so any of them can be
passed back to ``flashinfer-jit prebuild --workloads`` as it is. Every field is checked
here, before anything is compiled: an unknown key, a missing field or a value outside its
rule is a WorkloadError naming the file, the field and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol


class WorkloadError(ValueError):
    """A workloads file that is not in the documented format (the message says where)."""


Check = Callable[[object], str | None]  # None when the value is fine, else the rule it breaks
Fields = dict[str, tuple[bool, Check]]  # field -> (required, check)


class Declares(Protocol):
    """What an op declares about its workloads files (flashinfer_jit.contract.Op)."""

    workload_fields: Fields

    def check_workloads(self, data: dict, where: str) -> None: ...


def int_list(low: int, high: int, allowed: tuple[int, ...] = (), multiple: int = 1) -> Check:
    def check(value: object) -> str | None:
        rule = f"a non-empty list of integers in [{low}, {high}]"
        rule += f" from {list(allowed)}" if allowed else ""
        rule += f" that are multiples of {multiple}" if multiple > 1 else ""
        if not isinstance(value, list) or not value:
            return rule
        for v in value:
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
                return rule
            if (allowed and v not in allowed) or v % multiple:
                return rule
        return None

    return check


def choice_list(*choices: str) -> Check:
    def check(value: object) -> str | None:
        ok = isinstance(value, list) and value and all(v in choices for v in value)
        return None if ok else f"a non-empty list of {list(choices)}"

    return check


def one_of(*choices: object) -> Check:
    def check(value: object) -> str | None:
        ok = any(value == c and type(value) is type(c) for c in choices)
        return None if ok else f"one of {list(choices)}"

    return check


def json_object(value: object) -> str | None:
    return None if isinstance(value, dict) else "a JSON object"


def validate(data: object, ops: Mapping[str, Declares], where: str = "workloads") -> dict:
    """``data`` when it is a workloads object of one of ``ops`` in the format above, else
    WorkloadError."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: must be a JSON object, got a {type(data).__name__}")
    op = data.get("op")
    if op not in ops:
        raise WorkloadError(f'{where}: needs an "op" key naming one of {", ".join(sorted(ops))}')
    fields = ops[op].workload_fields
    unknown = sorted(set(data) - set(fields) - {"op", "description"})
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {', '.join(unknown)} for op {op}")
    for name, (required, check) in fields.items():
        if name not in data:
            if required:
                raise WorkloadError(f"{where}: op {op} needs the field {name!r}")
            continue
        rule = check(data[name])
        if rule is not None:
            raise WorkloadError(f"{where}: {name} must be {rule}, got {data[name]!r}")
    if not isinstance(data.get("description", ""), str):
        raise WorkloadError(f"{where}: description must be text")
    ops[op].check_workloads(data, where)
    return data


def load(path: Path, ops: Mapping[str, Declares]) -> dict:
    """The validated workloads (of one of ``ops``) in the file ``path``; WorkloadError says
    what is wrong."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WorkloadError(f"{path}: cannot read the workloads file ({reason})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WorkloadError(f"{path}: not valid JSON ({exc})") from None
    return validate(data, ops, str(path))
