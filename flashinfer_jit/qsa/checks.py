"""Argument checks and kernel applicability of the QSA fp8 decode.

Host-side only: the checks that raise a clear exception naming the argument and the rule
before anything runs, and the reasons a valid call cannot take the kernels (it then takes
the torch path).
"""

from __future__ import annotations

import math

import torch

from jit_kernels import MIN_CAPABILITY, capability
from jit_kernels.args import require_no_overlap

from .._jit import cuda_device_index
from ..workload_format import Fields, int_list

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16
MAX_TOPK = 65535 * 256  # the slot pass's grid.y limit x its threads (kernels.SLOT_THREADS)


# -- argument checks -----------------------------------------------------------------------
def _tensor(name: str, value, dim: int, dtypes: tuple, what: str) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor {what}")
    if value.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {value.dtype}")


def _check_rows(q, out, output_gate) -> None:
    _tensor("q", q, 3, (torch.bfloat16,), "[rows, num_query_heads, head_dim]")
    for name, t in (("out", out), ("output_gate", output_gate)):
        _tensor(name, t, 3, (torch.bfloat16,), "[rows, num_query_heads, head_dim]")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")


def _check_caches(q, k_cache, v_cache) -> None:
    layout = "[num_blocks, page_size, num_kv_heads, head_dim]"
    _tensor("k_cache", k_cache, 4, FP8_CACHE_DTYPES, layout)
    _tensor("v_cache", v_cache, 4, FP8_CACHE_DTYPES, layout)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache must match k_cache's shape and dtype {tuple(k_cache.shape)}/{k_cache.dtype}, "
            f"got {tuple(v_cache.shape)}/{v_cache.dtype}"
        )
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"k_cache head_dim {cache_dim} differs from q's {head_dim}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_query_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if page_size < 1:
        raise ValueError("k_cache page_size (dim 1) must be at least 1")


def _check_selection(rows: int, logical_indices, block_table, token_to_req) -> None:
    what = "[rows, TOPK + 1] (last column: valid count)"
    _tensor("logical_indices", logical_indices, 2, (torch.int32,), what)
    if logical_indices.shape[0] != rows or logical_indices.shape[1] < 1:
        raise ValueError(
            f"logical_indices must be [rows={rows}, TOPK + 1], got {tuple(logical_indices.shape)}"
        )
    _tensor("block_table", block_table, 2, (torch.int32,), "[num_requests, width]")
    _tensor("token_to_req", token_to_req, 1, (torch.int32,), "[rows]")
    if token_to_req.shape[0] != rows:
        raise ValueError(
            f"token_to_req must have {rows} entries (one per row), got {token_to_req.shape[0]}"
        )


def check_args(
    q,
    k_cache,
    v_cache,
    logical_indices,
    block_table,
    token_to_req,
    out,
    output_gate,
    softmax_scale,
    output_scale,
) -> None:
    """Raise a ValueError/TypeError naming the argument and the rule it breaks."""
    _check_rows(q, out, output_gate)
    _check_caches(q, k_cache, v_cache)
    _check_selection(q.shape[0], logical_indices, block_table, token_to_req)
    named = (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("logical_indices", logical_indices),
        ("block_table", block_table),
        ("token_to_req", token_to_req),
        ("out", out),
        ("output_gate", output_gate),
    )
    for name, t in named:
        if t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device}, q on {q.device}: all tensors must share a device"
            )
    for name, value in (("softmax_scale", softmax_scale), ("output_scale", output_scale)):
        if torch.compiler.is_compiling():  # a traced float: the compiled call's op checks it
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name} must be a finite real number, got {value!r}")
    # out may be output_gate itself: the gate is read element by element where out is written.
    inputs = dict(named[:-2], q=q, output_gate=output_gate)
    require_no_overlap({"out": out}, inputs, in_place=("output_gate",))


def offset_bits(page_size: int) -> int:
    return max(1, (page_size - 1).bit_length())


def _rows_aligned(t: torch.Tensor, row_dims: tuple[int, ...], nbytes: int = 16) -> bool:
    """Unit last stride, 16-byte aligned base, and every listed stride a 16-byte multiple."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.data_ptr() % nbytes == 0
        and all(t.stride(d) * size % nbytes == 0 or t.shape[d] == 1 for d in row_dims)
    )


def kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate) -> str | None:
    """Why the kernels cannot serve this call (None when they can)."""
    if q.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if capability(cuda_device_index(q)) < MIN_CAPABILITY:
        return "compute capability below 9.0 (the kernels use Hopper's features)"
    rows, num_q_heads, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (kernels: {HEAD_DIMS})"
    if num_q_heads // num_kv_heads > MAX_GROUP:
        return f"group size {num_q_heads // num_kv_heads} > {MAX_GROUP}"
    if not all(_rows_aligned(t, (0, 1, 2)) for t in (k_cache, v_cache)):
        return "k_cache/v_cache token rows are not 16-byte aligned with a unit last stride"
    if not all(_rows_aligned(t, (0, 1)) for t in (q, out, output_gate)):
        return "q/out/output_gate head rows are not 16-byte aligned with a unit last stride"
    if max(*k_cache.stride()[:3], *v_cache.stride()[:3]) >= 2**32:
        return "a k_cache/v_cache stride of 2**32 bytes or more (the kernel keeps 32-bit strides)"
    if num_blocks << offset_bits(page_size) >= 2**31:
        return f"{num_blocks} blocks x page {page_size} overflow the int32 slot encoding"
    return grid_refusal(rows, num_kv_heads, logical_indices.shape[1] - 1)


def grid_refusal(rows: int, num_kv_heads: int, topk: int) -> str | None:
    """Why the launch grids cannot hold this call: grid.x is rows * Hkv (+ 1 for the slot
    pass's order), the slot pass's grid.y the TOPK columns over 256 threads of one entry
    each at most (QsaOptions.slot_entries >= 1), at most 65535."""
    if rows * num_kv_heads >= 2**31 - 1 or topk > MAX_TOPK:
        return "rows * num_kv_heads or TOPK too large for the launch grid"
    return None


def _configs(value: object) -> str | None:
    """The rule of a workloads file's ``configs``: geometries the kernels take."""
    fields = {
        "head_dims": int_list(64, 256, HEAD_DIMS),
        "group_sizes": int_list(1, MAX_GROUP),
        "page_sizes": int_list(1, 1024, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)),
    }
    if not isinstance(value, list) or not value:
        return "a non-empty list of objects with keys head_dims, group_sizes, page_sizes"
    for i, config in enumerate(value):
        if not isinstance(config, dict) or set(config) != set(fields):
            keys = ", ".join(sorted(fields))
            return f"a list of objects with exactly the keys {keys} (entry {i} is not)"
        for key, check in fields.items():
            rule = check(config[key])
            if rule is not None:
                return f"entry {i}: {key} must be {rule}"
    return None


# The fields of this op's workloads files (flashinfer_jit.workload_format).
WORKLOAD_FIELDS: Fields = {"configs": (True, _configs)}
