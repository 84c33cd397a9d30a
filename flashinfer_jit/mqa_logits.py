"""FP8 paged MQA logits (the DeepSeek sparse-attention indexer): ``fp8_paged_mqa_logits``.

    logits[b*next_n + t, pos] = scale[pos] * sum_h weights[b*next_n + t, h] * relu(q[b,t,h] . k[pos])

Read top to bottom: helpers of the public contract, argument checks, the kernel
families and their launch, the op. The torch path (CPU tensors and everything the
kernels cannot serve) lives in ``mqa_logits_ref``.
"""

from __future__ import annotations

import itertools

import torch

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    current_stream,
    fall_back,
    kernels_disabled,
    validate_inputs,
)

from ._jit import cuda_device_index, kernel_family
from .mqa_logits_checks import (
    BLOCK_SIZES,
    CHECKED_MAX,
    TILE,
    capability,
    check_args,
    check_dtypes,
    check_out,
    check_schedule,
    checked,
    launch_config,
    min_block_table_width,
    padded_seq_len,
    signature,
    sm_count,
    smem_bytes,
    validate_preconditions,
)
from .mqa_logits_ref import paged_mqa_logits_torch

__all__ = [
    "compute_paged_mqa_logits_schedule",
    "fp8_paged_mqa_logits",
    "min_block_table_width",
    "padded_seq_len",
]
OP = "fp8_paged_mqa_logits"
WORKLOADS = "mqa_logits_workloads.json"
_SCHEDULE_THREADS = 256


_schedule_family = kernel_family(
    "mqa_logits_schedule",
    "mqa_logits_util.cuh",
    "fij_mqa::paged_mqa_schedule",
    ("threads",),
    ("P", "q", "i", "P"),
)


def compute_paged_mqa_logits_schedule(
    seq_lens: torch.Tensor,
    block_size: int = 64,
    num_sms: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CTA schedule ``fp8_paged_mqa_logits`` derives from ``seq_lens``: ``[num_sms+1, 2]``
    int32, row c = (request, 64-token tile) where SM c's balanced share of the KV tiles
    begins; row num_sms = (batch, 0). One small GPU kernel (graph-capturable).

    ``block_size`` is accepted for API symmetry; the split is in 64-token tiles for every
    block size. Reuse the result only while the contents of ``seq_lens`` are unchanged.
    """
    if (
        not isinstance(seq_lens, torch.Tensor)
        or seq_lens.dim() != 1
        or seq_lens.dtype != torch.int32
    ):
        raise ValueError("seq_lens must be a 1-D int32 tensor [batch_size]")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    on_cuda = seq_lens.device.type == "cuda"
    if num_sms is None:
        num_sms = sm_count(cuda_device_index(seq_lens)) if on_cuda else 1
    if num_sms <= 0:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    if out is None:
        out = torch.empty(num_sms + 1, 2, dtype=torch.int32, device=seq_lens.device)
    elif out.shape != (num_sms + 1, 2) or out.dtype != torch.int32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 tensor of shape {(num_sms + 1, 2)}")
    if on_cuda and not kernels_disabled():
        try:
            device = cuda_device_index(seq_lens)
            kernel = _schedule_family.get((_SCHEDULE_THREADS,), device)
            args = (seq_lens.data_ptr(), seq_lens.stride(0), seq_lens.shape[0], out.data_ptr())
            kernel.launch(
                (num_sms + 1, 1, 1), (_SCHEDULE_THREADS, 1, 1), current_stream(device), args
            )
            return out
        except KernelUnavailable as exc:
            fall_back("compute_paged_mqa_logits_schedule", str(exc))
    out.copy_(schedule_torch(seq_lens, num_sms))
    return out


def schedule_torch(seq_lens: torch.Tensor, num_sms: int) -> torch.Tensor:
    """The schedule computed on the host (same rule as the kernel)."""
    tiles = (seq_lens.to("cpu", torch.int64).clamp_min(0) + TILE - 1) // TILE
    starts = torch.cumsum(tiles, 0) - tiles
    total = int(tiles.sum())
    rows = []
    for c in range(num_sms + 1):
        x = c * total // num_sms
        hit = ((starts <= x) & (x < starts + tiles)).nonzero()
        rows.append((int(hit[0]), x - int(starts[hit[0]])) if len(hit) else (len(tiles), 0))
    return torch.tensor(rows, dtype=torch.int32)


# -- the logits kernel family -------------------------------------------------------------
_logits_family = kernel_family(
    "mqa_logits",
    "mqa_logits.cuh",
    "fij_mqa::paged_mqa_logits",
    (
        "next_n",
        "num_heads",
        "head_dim",
        "block_size",
        "output_dtype",
        "epi_dtype",
        "acc_dtype",
        "warpgroups",
        "stages",
        "portable",
    ),
    ("P", "P", "P", "P", "q", "P", "q", "P", "P", "q", "i"),
)

# (warpgroups, stages, portable) forced by tools/bench_mqa_logits.py to compare variants.
_config_override: tuple[int, int, bool] | None = None


def _params(next_n: int, heads: int, dim: int, block_size: int, output_dtype, epi_dtype, acc_dtype):
    if _config_override is not None:
        warpgroups, stages, portable = _config_override
    else:
        warpgroups, stages = launch_config(next_n * heads, dim)
        portable = False
    return (
        next_n,
        heads,
        dim,
        block_size,
        output_dtype,
        epi_dtype,
        acc_dtype,
        warpgroups,
        stages,
        portable,
    )


def _kernel_refusal(q, kv_fused) -> str | None:
    """Why the kernels cannot serve this call (None when they can)."""
    if q.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if capability(cuda_device_index(q)) < (8, 9):
        return "compute capability below 8.9 (no e4m3 conversions)"
    if kv_fused.data_ptr() % 16 or q.data_ptr() % 16:
        return "kv_fused or q is not 16-byte aligned"
    return None


def _launch(
    q,
    kv_fused,
    weights,
    block_tables,
    seq_lens,
    schedule,
    out,
    output_dtype,
    epi_dtype,
    acc_dtype,
    geometry,
) -> None:
    batch, next_n, heads, dim, block_size = geometry
    device = cuda_device_index(q)
    params = _params(next_n, heads, dim, block_size, output_dtype, epi_dtype, acc_dtype)
    kernel = _logits_family.get(params, device)
    warpgroups = params[7]
    num_sms = sm_count(device)
    q = q if q.is_contiguous() else q.contiguous()
    weights = weights if weights.is_contiguous() else weights.contiguous()
    args = (
        q.data_ptr(),
        kv_fused.data_ptr(),
        weights.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        seq_lens.data_ptr(),
        seq_lens.stride(0),
        0 if schedule is None else schedule.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        batch,
    )
    smem = smem_bytes(next_n * heads, dim, warpgroups)
    kernel.launch((num_sms, 1, 1), (128 * warpgroups, 1, 1), current_stream(device), args, smem)


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads reach, plus the schedule kernel."""
    dtype = {"float32": torch.float32, "float16": torch.float16}
    specs = {_schedule_family.spec((_SCHEDULE_THREADS,))}
    for next_n, heads, dim, block, out_dt, epi_dt, acc_dt in itertools.product(
        workloads["next_n"],
        workloads["num_heads"],
        workloads["head_dim"],
        workloads["block_size"],
        workloads["output_dtype"],
        workloads.get("epi_dtype", ["float32"]),
        workloads.get("acc_dtype", ["float32"]),
    ):
        warpgroups, stages = launch_config(int(next_n) * int(heads), int(dim))
        specs.add(
            _logits_family.spec(
                (
                    int(next_n),
                    int(heads),
                    int(dim),
                    int(block),
                    dtype[out_dt],
                    dtype[epi_dt],
                    dtype[acc_dt],
                    warpgroups,
                    stages,
                    False,
                )
            )
        )
    return sorted(specs, key=str)


# -- the op ------------------------------------------------------------------------------
def _logits_impl(
    q,
    kv_fused,
    weights,
    block_tables,
    seq_lens,
    max_seq_len: int,
    output_dtype,
    epi_dtype,
    acc_dtype,
    schedule_meta,
    out,
) -> None:
    geometry = (q.shape[0], q.shape[1], q.shape[2], q.shape[3], kv_fused.shape[1])
    if q.shape[0] == 0 or max_seq_len == 0:
        return
    if not kernels_disabled():
        reason = _kernel_refusal(q, kv_fused)
        if reason is None:
            try:
                _launch(
                    q,
                    kv_fused,
                    weights,
                    block_tables,
                    seq_lens,
                    schedule_meta,
                    out,
                    output_dtype,
                    epi_dtype,
                    acc_dtype,
                    geometry,
                )
                return
            except KernelUnavailable as exc:
                reason = str(exc)
        if q.device.type == "cuda":
            fall_back(OP, reason)
    paged_mqa_logits_torch(q, kv_fused, weights, block_tables, seq_lens, out, epi_dtype, acc_dtype)


@torch.library.custom_op("flashinfer_jit::fp8_paged_mqa_logits", mutates_args=("out",))
def _logits_op(
    q: torch.Tensor,
    kv_fused: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    output_dtype: torch.dtype,
    epi_dtype: torch.dtype,
    acc_dtype: torch.dtype,
    schedule_meta: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    _logits_impl(
        q,
        kv_fused,
        weights,
        block_tables,
        seq_lens,
        max_seq_len,
        output_dtype,
        epi_dtype,
        acc_dtype,
        schedule_meta,
        out,
    )


@_logits_op.register_fake
def _(
    q,
    kv_fused,
    weights,
    block_tables,
    seq_lens,
    max_seq_len,
    output_dtype,
    epi_dtype,
    acc_dtype,
    schedule_meta,
    out,
) -> None:
    return None


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_fused: torch.Tensor,
    weights: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    *,
    output_dtype: torch.dtype = torch.float32,
    epi_dtype: torch.dtype = torch.float32,
    acc_dtype: torch.dtype = torch.float32,
    schedule_meta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted per-head ReLU scores of ``q`` against a paged FP8 KV pool.

    Returns the ``[batch_size*next_n, max_seq_len]`` view of ``out`` (or of an internal
    ``[batch_size*next_n, padded_seq_len(max_seq_len)]`` allocation). Row b*next_n + t is
    valid for positions 0 .. seq_lens[b] - next_n + t; the rest is unspecified, and rows of
    requests with seq_lens[b] == 0 are never written.
    """
    try:
        key = signature(
            q,
            kv_fused,
            weights,
            block_tables,
            seq_lens,
            max_seq_len,
            output_dtype,
            epi_dtype,
            acc_dtype,
            out,
        )
        geometry = checked.get(key)
    except (AttributeError, TypeError):  # not tensors: the full checks say what is wrong
        key, geometry = None, None
    if geometry is None:
        check_dtypes(output_dtype, epi_dtype, acc_dtype)
        geometry = check_args(q, kv_fused, weights, block_tables, seq_lens, max_seq_len)
        if out is not None:
            check_out(
                out, geometry[0] * geometry[1], padded_seq_len(max_seq_len), output_dtype, q.device
            )
        if key is not None and len(checked) < CHECKED_MAX:
            checked[key] = geometry
    batch, next_n, _, _, block_size = geometry
    rows = batch * next_n
    if out is None:
        out = torch.empty(rows, padded_seq_len(max_seq_len), dtype=output_dtype, device=q.device)
    if schedule_meta is not None:
        check_schedule(schedule_meta, q.device)
    if validate_inputs():
        validate_preconditions(kv_fused, block_tables, seq_lens, max_seq_len, block_size)
    if torch.compiler.is_compiling():
        _logits_op(
            q,
            kv_fused,
            weights,
            block_tables,
            seq_lens,
            max_seq_len,
            output_dtype,
            epi_dtype,
            acc_dtype,
            schedule_meta,
            out,
        )
    else:  # eager calls skip the custom-op dispatcher's host cost
        _logits_impl(
            q,
            kv_fused,
            weights,
            block_tables,
            seq_lens,
            max_seq_len,
            output_dtype,
            epi_dtype,
            acc_dtype,
            schedule_meta,
            out,
        )
    return out[:rows, :max_seq_len]
