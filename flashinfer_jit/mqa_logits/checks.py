"""Argument checks and fit rules of ``fp8_paged_mqa_logits``.

Everything here is host-side and op-specific: the public size helpers, the kernel's
restrictions (which also decide its launch configuration), and the checks that raise
a clear exception naming the argument and the rule before any launch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from jit_kernels import shipped_smem_per_block, sm_count
from jit_kernels.args import require_int

from .._jit import cuda_device_index
from ..workload_format import Fields, WorkloadError, choice_list, int_list

STORE_GRANULARITY = 256  # output columns are padded to this (a multiple of every block size)
TILE = 64  # KV tokens per schedule unit (kTile in templates/mqa_logits/util.cuh)
BLOCK_SIZES = (32, 64, 128)
FLOAT_DTYPES = (torch.float32, torch.float16)
MAX_INT32 = 2**31
SMEM_LIMIT = shipped_smem_per_block()  # opt-in shared memory per block on every shipped arch
STATIC_SMEM = 2048  # the kernel's static shared memory (~1.3 KB with the reserved 1 KB), rounded up


# -- helpers of the public contract ----------------------------------------------------
def min_block_table_width(max_seq_len: int, block_size: int) -> int:
    """The narrowest legal ``block_tables`` width: ceil(max_seq_len / block_size)."""
    block_size = require_int("block_size", block_size, 1)
    max_seq_len = require_int("max_seq_len", max_seq_len, 0)
    return -(-max_seq_len // block_size)


def padded_seq_len(max_seq_len: int) -> int:
    """Output columns the kernel may write: max_seq_len rounded up to 256."""
    max_seq_len = require_int("max_seq_len", max_seq_len, 0)
    return -(-max_seq_len // STORE_GRANULARITY) * STORE_GRANULARITY


def smem_bytes(n: int, dim: int, warpgroups: int) -> int:
    """Dynamic shared memory of the direct kernel: per warpgroup Q (n x dim e4m3) + weights."""
    return warpgroups * (n * dim + 4 * n)


RING_MAX_STAGES = 12


def ring_smem_bytes(n: int, dim: int, warpgroups: int, stages: int) -> int:
    """Dynamic shared memory of the ring kernel (RingLayout in templates/mqa_logits/ring.cuh):
    stages of 64 tokens (values + fp32 scales), Q + weights per warpgroup, 32 B per stage of
    tile descriptor and mbarriers."""
    return stages * (TILE * dim + TILE * 4 + 32) + smem_bytes(n, dim, warpgroups)


def ring_stages(n: int, dim: int, warpgroups: int) -> int:
    """The most ring stages (capped at RING_MAX_STAGES) that fit next to Q, a multiple of
    ``warpgroups``: consumers take tiles round-robin, and a stage must always return to the
    same warpgroup, or a fast one could wait on a stage's parity one phase too early."""
    free = SMEM_LIMIT - STATIC_SMEM - smem_bytes(n, dim, warpgroups)
    stages = max(0, min(RING_MAX_STAGES, free // (TILE * dim + TILE * 4 + 32)))
    return stages // warpgroups * warpgroups


def direct_config(n: int, dim: int) -> tuple[int, int] | None:
    """(warpgroups, stages) of the direct kernel, or None when Q does not fit shared memory.

    Each warpgroup keeps 1-3 tiles of K loads in flight in registers; stages shrink as the
    accumulators (n/2 registers) and fragments (dim/8 registers a stage) grow.
    """
    if smem_bytes(n, dim, 1) + STATIC_SMEM > SMEM_LIMIT or n // 2 + dim // 8 > 224:
        return None  # Q does not fit shared memory, or accumulators + one stage the registers
    warpgroups = 2 if smem_bytes(n, dim, 2) + STATIC_SMEM <= SMEM_LIMIT else 1
    budget = 200 - n // 2  # registers left for K fragments below the 255 cap
    stages = max(1, min(3, budget // max(1, dim // 8)))
    return warpgroups, stages


def reg_cap(threads: int) -> int:
    """Registers per thread a block of ``threads`` can have (reg_cap in mqa_logits/util.cuh):
    each SM sub-partition has 16K registers and takes ceil(warps / 4) of the block's warps."""
    return min(255, 65536 // (-(-threads // 128) * 128) // 8 * 8)


def ring_regs(n: int, dim: int) -> int:
    """Registers a ring consumer thread needs (f32 accumulators, K fragments, ~48 of
    addressing and epilogue state); calibrated on ptxas: n=192/dim=128 uses 146."""
    return n // 2 + dim // 8 + 48


def launch_config(n: int, dim: int) -> tuple[int, int, bool] | None:
    """(warpgroups, stages, ring) for a geometry, or None when it cannot run at all.

    The ring kernel (a producer warp streaming 64-token tiles into a shared-memory ring,
    consumer warpgroups) is preferred whenever at least 4 stages fit beside Q: its bytes
    in flight come from shared memory, not registers. Consumers are latency-bound (H200
    round 2: 3 warpgroups beat 2 by 4-13% at next_n*num_heads 64..128, lost at 32), so
    the most warpgroups whose accumulators fit the register cap of the block size
    (13 warps: 128 a thread, 9: 168, 5: 255). Otherwise the direct kernel.
    """
    direct = direct_config(n, dim)
    if direct is None:
        return None
    for warpgroups in (3, 2, 1) if n >= 64 else (2, 1):
        if ring_regs(n, dim) > reg_cap(128 * warpgroups + 32):
            continue
        stages = ring_stages(n, dim, warpgroups)
        if stages >= 4:
            return warpgroups, stages, True
    return (*direct, False)


def kernel_smem(n: int, dim: int, warpgroups: int, stages: int, ring: bool) -> int:
    return ring_smem_bytes(n, dim, warpgroups, stages) if ring else smem_bytes(n, dim, warpgroups)


# -- argument checks -----------------------------------------------------------------
def _need(cond: bool, exc: type[Exception], message: Callable[[], str]) -> None:
    # The message is built only on failure: formatting it costs microseconds per call.
    if not cond:
        raise exc(message())


def check_dtypes(output_dtype, epi_dtype, acc_dtype, bf16_out: bool = False) -> None:
    """``bf16_out``: the DeepGEMM surface (flashinfer_jit.deep_gemm) stores bfloat16 logits,
    rounded once from the float32 epilogue; the seed's entry point keeps refusing them."""
    if output_dtype == torch.bfloat16 and bf16_out:
        output_dtype = torch.float32  # checked as the epilogue it is rounded from
    if output_dtype == torch.bfloat16:
        raise ValueError(
            "output_dtype=torch.bfloat16 is not supported: the FP8 epilogue has no bf16 "
            "branch and would silently miscompute; use torch.float32 or torch.float16"
        )
    for name, dt in (
        ("output_dtype", output_dtype),
        ("epi_dtype", epi_dtype),
        ("acc_dtype", acc_dtype),
    ):
        _need(
            dt in FLOAT_DTYPES,
            ValueError,
            lambda name=name, dt=dt: f"{name} must be torch.float32 or torch.float16, got {dt}",
        )


# size: every argument rule in the order the errors name them; a split would scatter the contract
def check_args(q, kv_fused, weights, block_tables, seq_lens, max_seq_len) -> tuple[int, ...]:
    """Validate shapes, dtypes, devices and the kernel restrictions; return the geometry."""
    _need(
        isinstance(q, torch.Tensor) and q.dim() == 4,
        ValueError,
        lambda: "q must be a 4-D tensor [batch_size, next_n, num_heads, head_dim]",
    )
    _need(
        q.dtype == torch.float8_e4m3fn,
        TypeError,
        lambda: f"q must be torch.float8_e4m3fn, got {q.dtype}",
    )
    batch, next_n, heads, dim = q.shape
    _need(
        isinstance(kv_fused, torch.Tensor) and kv_fused.dim() == 4,
        ValueError,
        lambda: "kv_fused must be a 4-D tensor [num_blocks, block_size, 1, head_dim + 4]",
    )
    block_size = kv_fused.shape[1]
    _need(
        kv_fused.shape[2] == 1 and kv_fused.shape[3] == dim + 4,
        ValueError,
        lambda: (
            f"kv_fused must be [num_blocks, block_size, 1, head_dim + 4 = {dim + 4}], got {tuple(kv_fused.shape)}"
        ),
    )
    _need(
        kv_fused.is_contiguous(),
        ValueError,
        lambda: (
            "kv_fused must be contiguous: each block is read as block_size*(head_dim+4) flat bytes"
        ),
    )
    _need(
        isinstance(weights, torch.Tensor) and tuple(weights.shape) == (batch * next_n, heads),
        ValueError,
        lambda: (
            f"weights must be [batch_size*next_n, num_heads] = {(batch * next_n, heads)}, "
            f"got {tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}"
        ),
    )
    _need(
        isinstance(block_tables, torch.Tensor)
        and block_tables.dim() == 2
        and block_tables.shape[0] == batch,
        ValueError,
        lambda: f"block_tables must be [batch_size={batch}, max_blocks_per_seq]",
    )
    _need(
        block_tables.stride(1) == 1 or block_tables.shape[1] <= 1,
        ValueError,
        lambda: "block_tables rows must be contiguous (stride(1) == 1); the row stride is free",
    )
    _need(
        isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 and seq_lens.shape[0] == batch,
        ValueError,
        lambda: f"seq_lens must be a 1-D tensor [batch_size={batch}]",
    )
    for name, t, dt in (
        ("kv_fused", kv_fused, torch.uint8),
        ("weights", weights, torch.float32),
        ("block_tables", block_tables, torch.int32),
        ("seq_lens", seq_lens, torch.int32),
    ):
        _need(t.dtype == dt, TypeError, lambda n=name, t=t, d=dt: f"{n} must be {d}, got {t.dtype}")
        _need(
            t.device == q.device,
            ValueError,
            lambda n=name, t=t: f"{n} is on {t.device}, q on {q.device}",
        )
    require_int("max_seq_len", max_seq_len, 0)
    # The kernel's restrictions (the same for every device, so behaviour does not depend on it).
    _need(
        dim > 0 and dim % 32 == 0,
        ValueError,
        lambda: f"head_dim must be a multiple of 32, got {dim}",
    )
    _need(
        heads > 0 and heads % 4 == 0,
        ValueError,
        lambda: f"num_heads must be a multiple of 4, got {heads}",
    )
    n = next_n * heads
    _need(
        n % 8 == 0 and 8 <= n <= 256,
        ValueError,
        lambda: f"next_n*num_heads must be a multiple of 8 in [8, 256], got {next_n}*{heads} = {n}",
    )
    _need(
        block_size in BLOCK_SIZES,
        ValueError,
        lambda: f"block_size (kv_fused.shape[1]) must be one of {BLOCK_SIZES}, got {block_size}",
    )
    _need(
        launch_config(next_n * heads, dim) is not None,
        ValueError,
        lambda: (
            f"head_dim={dim} with next_n*num_heads={n} does not fit the per-CTA shared memory "
            f"({n * dim} bytes of Q per warpgroup; at most {SMEM_LIMIT} bytes) and registers "
            "(next_n*num_heads/2 + head_dim/8 <= 224)"
        ),
    )
    rows, cols = batch * next_n, padded_seq_len(max_seq_len)
    _need(
        rows * cols < MAX_INT32,
        ValueError,
        lambda: (
            f"output size batch_size*next_n*padded_seq_len(max_seq_len) = {rows * cols} must be < 2**31"
        ),
    )
    return batch, next_n, heads, dim, block_size


def check_out(out, rows: int, cols: int, output_dtype, device) -> None:
    _need(
        isinstance(out, torch.Tensor) and out.dim() == 2,
        ValueError,
        lambda: f"out must be a 2-D tensor [>= {rows}, >= padded_seq_len(max_seq_len) = {cols}]",
    )
    _need(
        out.dtype == output_dtype,
        TypeError,
        lambda: f"out must have dtype output_dtype={output_dtype}, got {out.dtype}",
    )
    _need(out.device == device, ValueError, lambda: f"out is on {out.device}, q on {device}")
    _need(
        out.shape[0] >= rows and out.shape[1] >= cols,
        ValueError,
        lambda: (
            f"out must be at least [{rows}, {cols}] (size it with padded_seq_len), got {tuple(out.shape)}"
        ),
    )
    _need(out.stride(1) == 1, ValueError, lambda: "out rows must be contiguous (stride(1) == 1)")
    _need(
        out.stride(0) >= cols or rows <= 1,
        ValueError,
        lambda: (
            f"out rows overlap: stride(0) = {out.stride(0)} < padded_seq_len(max_seq_len) = {cols} "
            "(an as_strided pitch or an expand()ed row is rejected)"
        ),
    )
    _need(
        rows * out.stride(0) < MAX_INT32,
        ValueError,
        lambda: f"batch_size*next_n*out.stride(0) = {rows * out.stride(0)} must be < 2**31",
    )


def check_schedule(schedule, device) -> None:
    num_sms = sm_count(cuda_device_index(schedule)) if device.type == "cuda" else None
    want = "[num_sms+1, 2]" + (f" = [{num_sms}+1, 2]" if num_sms is not None else "")
    got = tuple(schedule.shape) if isinstance(schedule, torch.Tensor) else type(schedule).__name__
    _need(
        isinstance(schedule, torch.Tensor)
        and schedule.dim() == 2
        and schedule.shape[1] == 2
        and (num_sms is None or schedule.shape[0] == num_sms + 1),
        ValueError,
        lambda: f"schedule_meta must be {want} (compute_paged_mqa_logits_schedule), got {got}",
    )
    _need(
        schedule.dtype == torch.int32 and schedule.is_contiguous(),
        ValueError,
        lambda: "schedule_meta must be a contiguous int32 tensor",
    )
    _need(
        schedule.device == device,
        ValueError,
        lambda: f"schedule_meta is on {schedule.device}, q on {device}",
    )


def validate_preconditions(
    kv_fused, block_tables, seq_lens, max_seq_len: int, block_size: int
) -> None:
    """The caller's preconditions (jit_kernels.validate_values: CPU tensors, and on a GPU
    under FLASHINFER_VALIDATE_INPUTS=1, where it syncs; skipped in capture)."""
    lens = seq_lens.to("cpu", torch.int64)
    if lens.numel() == 0:
        return
    _need(
        int(lens.min()) >= 0,
        ValueError,
        lambda: f"seq_lens has a negative entry ({int(lens.min())})",
    )
    longest = int(lens.max())
    _need(
        longest <= max_seq_len,
        ValueError,
        lambda: f"max(seq_lens) = {longest} exceeds max_seq_len = {max_seq_len}",
    )
    width = min_block_table_width(longest, block_size)
    _need(
        block_tables.shape[1] >= width,
        ValueError,
        lambda: (
            f"block_tables has {block_tables.shape[1]} columns; min_block_table_width(max(seq_lens)={longest}, "
            f"{block_size}) = {width}"
        ),
    )
    table = block_tables.to("cpu", torch.int64)
    used = torch.arange(table.shape[1])[None, :] < ((lens + block_size - 1) // block_size)[:, None]
    ids = table[used]
    _need(
        ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < kv_fused.shape[0]),
        ValueError,
        lambda: (
            f"block_tables holds a block index outside [0, {kv_fused.shape[0]}) in a used entry"
        ),
    )


# -- workloads files (flashinfer_jit.workload_format) ---------------------------------------
_FLOATS = choice_list("float32", "float16")
WORKLOAD_FIELDS: Fields = {
    "next_n": (True, int_list(1, 32)),
    "num_heads": (True, int_list(4, 256, multiple=4)),
    "head_dim": (True, int_list(32, 256, multiple=32)),
    "block_size": (True, int_list(32, 128, BLOCK_SIZES)),
    # bfloat16 logits: the DeepGEMM surface (flashinfer_jit.deep_gemm) only.
    "output_dtype": (True, choice_list("float32", "float16", "bfloat16")),
    "epi_dtype": (False, _FLOATS),
    "acc_dtype": (False, _FLOATS),
}


def check_workload_rows(data: dict, where: str) -> None:
    """The kernels take next_n*num_heads query rows per sequence: a multiple of 8 in [8, 256]."""
    for next_n in data["next_n"]:
        for heads in data["num_heads"]:
            n = next_n * heads
            if n % 8 or not 8 <= n <= 256:
                raise WorkloadError(
                    f"{where}: next_n*num_heads must be a multiple of 8 in [8, 256], "
                    f"got {next_n}*{heads} = {n}"
                )
