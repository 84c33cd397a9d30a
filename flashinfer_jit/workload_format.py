"""The workloads file format: what ``prebuild`` compiles, shipped and user-written alike.

One JSON object per file. ``"op"`` names the op (a key of ``OPS``); the other keys are
that op's fields below (lists of the values to prebuild for); ``"description"`` (text)
is allowed everywhere. The shipped files in ``workloads/`` are in this format, so any of
them can be passed back to ``flashinfer-jit prebuild --workloads`` as it is. Every field
is checked here, before anything is compiled: an unknown key, a missing field or a value
outside its rule is a WorkloadError naming the file, the field and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

# CLI op name -> module; each exposes WORKLOADS (its shipped file) and prebuild_specs().
OPS = {
    "mla_kv_pack": "flashinfer_jit.mla_kv_pack",
    "mqa_logits": "flashinfer_jit.mqa_logits",
    "qsa": "flashinfer_jit.qsa",
}


class WorkloadError(ValueError):
    """A workloads file that is not in the documented format (the message says where)."""


Check = Callable[[object], str | None]  # None when the value is fine, else the rule it breaks


def _int_list(low: int, high: int, allowed: tuple[int, ...] = (), multiple: int = 1) -> Check:
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


def _choice_list(*choices: str) -> Check:
    def check(value: object) -> str | None:
        ok = isinstance(value, list) and value and all(v in choices for v in value)
        return None if ok else f"a non-empty list of {list(choices)}"

    return check


def _one_of(*choices: object) -> Check:
    def check(value: object) -> str | None:
        ok = any(value == c and type(value) is type(c) for c in choices)
        return None if ok else f"one of {list(choices)}"

    return check


def _object(value: object) -> str | None:
    return None if isinstance(value, dict) else "a JSON object"


def _qsa_configs(value: object) -> str | None:
    fields = {
        "head_dims": _int_list(64, 256, (64, 128, 256)),
        "group_sizes": _int_list(1, 16),
        "page_sizes": _int_list(1, 1024, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    }
    if not isinstance(value, list) or not value:
        return "a non-empty list of objects with keys head_dims, group_sizes, page_sizes"
    for i, config in enumerate(value):
        if not isinstance(config, dict) or set(config) != set(fields):
            return f"a list of objects with exactly the keys {sorted(fields)} (entry {i} is not)"
        for key, check in fields.items():
            rule = check(config[key])
            if rule is not None:
                return f"entry {i}: {key} must be {rule}"
    return None


_FLOATS = _choice_list("float32", "float16")

# op -> field -> (required, check). Rules follow what the op's kernels accept.
FIELDS: dict[str, dict[str, tuple[bool, Check]]] = {
    "mla_kv_pack": {
        "num_heads": (True, _int_list(1, 128)),
        "num_tokens": (False, _int_list(1, 131072)),
        "dtype": (False, _one_of("bfloat16")),
        "nope_dim": (False, _one_of(128)),
        "rope_dim": (False, _one_of(64)),
        "v_dim": (False, _one_of(128)),
        "max_heads": (False, _one_of(128)),
        "max_tokens": (False, _one_of(131072)),
        "tuned": (False, _object),  # measurements; only the shipped file's are used
    },
    "mqa_logits": {
        "next_n": (True, _int_list(1, 32)),
        "num_heads": (True, _int_list(4, 256, multiple=4)),
        "head_dim": (True, _int_list(32, 256, multiple=32)),
        "block_size": (True, _int_list(32, 128, (32, 64, 128))),
        # bfloat16 logits: the DeepGEMM surface (flashinfer_jit.deep_gemm) only.
        "output_dtype": (True, _choice_list("float32", "float16", "bfloat16")),
        "epi_dtype": (False, _FLOATS),
        "acc_dtype": (False, _FLOATS),
    },
    "qsa": {"configs": (True, _qsa_configs)},
}


def validate(data: object, where: str = "workloads") -> dict:
    """``data`` when it is a workloads object in the format above, else WorkloadError."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: must be a JSON object, got a {type(data).__name__}")
    op = data.get("op")
    if op not in FIELDS:
        raise WorkloadError(f'{where}: needs an "op" key naming one of {sorted(FIELDS)}')
    fields = FIELDS[op]
    unknown = sorted(set(data) - set(fields) - {"op", "description"})
    if unknown:
        raise WorkloadError(f"{where}: unknown key(s) {unknown} for op {op}")
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
    if op == "mqa_logits":
        _check_mqa_rows(data, where)
    return data


def _check_mqa_rows(data: dict, where: str) -> None:
    # The kernels take next_n*num_heads query rows per sequence: a multiple of 8 in [8, 256].
    for next_n in data["next_n"]:
        for heads in data["num_heads"]:
            n = next_n * heads
            if n % 8 or not 8 <= n <= 256:
                raise WorkloadError(
                    f"{where}: next_n*num_heads must be a multiple of 8 in [8, 256], "
                    f"got {next_n}*{heads} = {n}"
                )


def load(path: Path) -> dict:
    """The validated workloads in the file ``path``; WorkloadError says what is wrong."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise WorkloadError(f"{path}: cannot read the workloads file ({reason})") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise WorkloadError(f"{path}: not valid JSON ({exc})") from None
    return validate(data, str(path))
