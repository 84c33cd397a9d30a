"""FP8 paged MQA logits (the DeepSeek sparse-attention indexer): ``fp8_paged_mqa_logits``.

    logits[b*next_n + t, pos] = scale[pos] * sum_h weights[b*next_n + t, h] * relu(q[b,t,h] . k[pos])

Read top to bottom: helpers of the public contract, argument checks, the kernel
families and their launch, the op. The torch path (CPU tensors and everything the
kernels cannot serve) lives in ``mqa_logits_ref``.
"""

from __future__ import annotations

import itertools
import logging

import torch
from torch.compiler import is_compiling as _is_compiling  # one global, not two lookups

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    capability,
    fall_back,
    kernels_disabled,
    sm_count,
    validate_inputs,
)
from jit_kernels.args import require_no_overlap
from jit_kernels.plan_cache import PlanCache, absent

from ._jit import cuda_device_index, kernel_family
from .mqa_logits_checks import (
    check_args,
    check_dtypes,
    check_out,
    check_schedule,
    kernel_smem,
    launch_config,
    min_block_table_width,
    padded_seq_len,
    reg_cap,
    ring_regs,
    ring_stages,
    validate_preconditions,
)
from .mqa_logits_clean import clean_specs  # DeepGEMM's clean_logits (flashinfer_jit.deep_gemm)
from .mqa_logits_generic import generic_plan, generic_specs
from .mqa_logits_launch import Launch
from .mqa_logits_ref import paged_mqa_logits_torch
from .mqa_logits_schedule import (
    _SCHEDULE_THREADS,
    _schedule_family,
    compute_paged_mqa_logits_schedule,
)
from .mqa_logits_tma import (
    TMA_DIMS,
    TmaConfig,
    kv_tensor_map,
    small_work,
    tma_config,
    tma_family,
    tma_smem_bytes,
    tma_stages,
    tma_threads,
)

__all__ = [
    "compute_paged_mqa_logits_schedule",
    "fp8_paged_mqa_logits",
    "min_block_table_width",
    "padded_seq_len",
]
OP = "fp8_paged_mqa_logits"
log = logging.getLogger("flashinfer_jit.mqa_logits")
WORKLOADS = "mqa_logits_workloads.json"


# -- the logits kernel family -------------------------------------------------------------
_PARAMS = (
    "next_n",
    "num_heads",
    "head_dim",
    "block_size",
    "output_dtype",
    "epi_dtype",
    "acc_dtype",
)
_logits_family = kernel_family(
    "mqa_logits",
    "mqa_logits.cuh",
    "fij_mqa::paged_mqa_logits",
    (*_PARAMS, "warpgroups", "stages", "portable", "ring"),
    ("P", "P", "P", "P", "q", "P", "q", "P", "P", "q", "i", "i"),
)

# (warpgroups, stages, portable, ring) forced by tools/bench_mqa_logits.py and the tests
# to compare variants; stages 0 means "as many as fit" for the ring kernel. `portable`
# (mma.sync on widened fragments, the sm_100a/sm_103a code path) is never chosen on
# sm_90a: it exists so the H200 tests cover what the other arches run. A 4-tuple turns
# the TMA kernel off; a TmaConfig forces that kernel's config (stages 0: as many as fit;
# probe 1/2/3: the benchmark's timing probes, see templates/mqa_logits_tma.cuh; they write
# no valid logits).
_config_override: tuple | TmaConfig | None = None
_force_generic = False  # tests and the benchmark: always use the generic kernel
# The TMA kernel goes out as a programmatic dependent launch: its launch and prologue
# overlap the previous kernel's tail (it waits for that kernel's results before reading
# anything). Read per call, part of the plan key; the benchmark compares both.
PDL = True


def _params(next_n: int, heads: int, dim: int, block_size: int, output_dtype, epi_dtype, acc_dtype):
    """The specialization's template parameters: the dispatcher's choice (launch_config)
    unless ``_config_override`` forces a variant."""
    n = next_n * heads
    if _config_override is None:
        warpgroups, stages, ring = launch_config(n, dim)
        portable = False
    else:
        warpgroups, stages, portable, ring = _config_override
        # Forced configs whose accumulators cannot fit the block's register cap would fail
        # to compile (ptxas C7602) or spill: refuse them (the generic kernel serves).
        need, cap = (
            ring_regs(n, dim) if ring else n // 2 + 40,
            reg_cap(128 * warpgroups + 32 * ring),
        )
        if need > cap:
            raise KernelUnavailable(
                f"forced config {_config_override}: ~{need} registers a thread exceed the cap "
                f"of {warpgroups} warpgroups ({cap})"
            )
        if ring and stages == 0:
            stages = ring_stages(n, dim, warpgroups)
        if ring and (stages < 1 or stages % warpgroups):
            raise KernelUnavailable(
                f"ring stages {stages} must be a positive multiple of {warpgroups}"
            )
    geometry = (next_n, heads, dim, block_size, output_dtype, epi_dtype, acc_dtype)
    return (*geometry, warpgroups, stages, portable, ring)


def _kernel_refusal(q, kv_fused) -> str | None:
    """Why the kernels cannot serve this call (None when they can)."""
    if q.device.type != "cuda":
        return "tensors are not on a CUDA device"
    if capability(cuda_device_index(q)) < (8, 9):
        return "compute capability below 8.9 (no e4m3 conversions)"
    if kv_fused.data_ptr() % 16 or q.data_ptr() % 16:
        return "kv_fused or q is not 16-byte aligned"
    return None


# (geometry, dtypes, device, overrides) -> plan: a call that misses the replay (a new out
# layout, say) skips choosing the variant and sizing the launch.
_plans: PlanCache[tuple] = PlanCache(replay=False)


def _launchable(plan: tuple, what: str) -> tuple:
    """``plan`` if one block fits an SM (registers x threads, shared memory), else
    KernelUnavailable: a config that cannot launch is refused here, never at launch time."""
    kernel, _, block, smem = plan[:4]
    if kernel.blocks_per_sm(block[0], smem) < 1:
        raise KernelUnavailable(
            f"{what} cannot launch: {kernel.num_regs()} registers x {block[0]} threads, "
            f"{smem} bytes of shared memory do not fit one SM"
        )
    return plan


def _tma_eligible(dim: int, device: int) -> bool:
    """The TMA kernel serves sm_90 at its head dims unless a ring/direct config is forced."""
    if isinstance(_config_override, TmaConfig):
        return dim in TMA_DIMS
    return _config_override is None and dim in TMA_DIMS and capability(device) == (9, 0)


def _tma_plan(geometry, dtypes, device: int, small: int, kv_evict_first: int) -> tuple:
    _, next_n, heads, dim, block_size = geometry
    n = next_n * heads
    forced = isinstance(_config_override, TmaConfig)
    config = _config_override if forced else tma_config(n, small, dim)
    if config.stages == 0:
        config = config._replace(
            stages=tma_stages(n, dim, config.warpgroups, config.producers, config.qbuf)
        )
        if config.stages < config.warpgroups:
            raise KernelUnavailable(f"forced TMA config {_config_override}: no ring stage fits")
    kernel = tma_family.get((next_n, heads, dim, block_size, *dtypes, *config), device)
    smem = tma_smem_bytes(n, dim, config.warpgroups, config.stages, config.qbuf)
    threads = tma_threads(config.warpgroups, config.producers)

    def kv_map(kv_ptr: int, kv_fused) -> tuple[bytes]:
        return (kv_tensor_map(kv_ptr, kv_fused.shape[0], block_size, dim),)

    grid = (sm_count(device), 1, 1)
    return kernel, grid, (threads, 1, 1), smem, (kv_evict_first,), kv_map, PDL


def _specialized_plan(geometry, dtypes, device: int, small: int, kv_evict_first: int) -> tuple:
    """The TMA kernel where it applies and can be had, else the ring/direct kernel."""
    _, next_n, heads, dim, block_size = geometry
    if _tma_eligible(dim, device):
        try:
            plan = _tma_plan(geometry, dtypes, device, small, kv_evict_first)
            return _launchable(plan, "TMA kernel")
        except KernelUnavailable as exc:
            log.info("fp8_paged_mqa_logits: TMA kernel unavailable for %s (%s)", geometry, exc)
    params = _params(next_n, heads, dim, block_size, *dtypes)
    kernel = _logits_family.get(params, device)
    warpgroups, stages, _, ring = params[7:11]
    smem = kernel_smem(next_n * heads, dim, warpgroups, stages, ring)
    threads = 128 * warpgroups + (32 if ring else 0)  # the ring kernel's producer warp
    grid = (sm_count(device), 1, 1)
    plan = (kernel, grid, (threads, 1, 1), smem, (kv_evict_first,), None, False)
    return _launchable(plan, kernel.name)


def _plan(geometry, output_dtype, epi_dtype, acc_dtype, device: int, max_seq_len: int) -> tuple:
    """(kernel, grid, block, smem, extra args, kv args, programmatic) of the kernel that
    serves: the TMA kernel (sm_90, head_dim 128; its config for small calls when
    mqa_logits_tma.small_work says so), else the ring/direct specialization, else the generic
    kernel. ``extra`` is appended to every launch's arguments; ``kv args``, when
    not None, maps (kv_fused address, kv_fused) to the per-pool arguments appended after
    them; ``programmatic``: launch as a programmatic dependent launch (the kernel waits for
    the preceding grid itself). Small calls stream their KV with an L2 evict-first policy
    (the kernels' kv_evict_first argument, see KvPolicy in templates/mqa_logits_ring.cuh)."""
    small = small_work(geometry[0], max_seq_len, sm_count(device))
    key = (
        geometry,
        output_dtype,
        epi_dtype,
        acc_dtype,
        device,
        small,
        _config_override,
        _force_generic,
        PDL,
    )
    plan = _plans.get(key)
    if plan is None:
        dtypes = (output_dtype, epi_dtype, acc_dtype)
        evict = int(small > 0)
        if _force_generic:
            plan = generic_plan(geometry, *dtypes, device, "forced", evict)
            plan = _launchable(plan, "generic kernel")
        else:
            try:
                plan = _specialized_plan(geometry, dtypes, device, small, evict)
            except KernelUnavailable as exc:
                plan = generic_plan(geometry, *dtypes, device, str(exc), evict)
                plan = _launchable(plan, "generic kernel")
        _plans.put(key, plan)
    return plan


def _launch(
    q, kv_fused, weights, block_tables, seq_lens, max_seq_len: int, output_dtype, epi_dtype,
    acc_dtype, schedule, out, geometry,
) -> Launch:  # fmt: skip
    """Launch; return the launch (what a repeat call replays)."""
    device = cuda_device_index(q)
    plan = _plan(geometry, output_dtype, epi_dtype, acc_dtype, device, max_seq_len)
    launch = Launch(plan, device, q, weights, block_tables, seq_lens, out, max_seq_len)
    launch.run(q, kv_fused, weights, block_tables, seq_lens, schedule, out)  # aligned: refusal
    return launch


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads reach, plus the schedule kernel."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    specs = {_schedule_family.spec((_SCHEDULE_THREADS,)), *generic_specs(), *clean_specs()}
    for next_n, heads, dim, block, out_dt, epi_dt, acc_dt in itertools.product(
        workloads["next_n"],
        workloads["num_heads"],
        workloads["head_dim"],
        workloads["block_size"],
        workloads["output_dtype"],
        workloads.get("epi_dtype", ["float32"]),
        workloads.get("acc_dtype", ["float32"]),
    ):
        geometry = (int(next_n), int(heads), int(dim), int(block))
        dtypes = (dtype[out_dt], dtype[epi_dt], dtype[acc_dt])
        specs.add(_logits_family.spec(_params(*geometry, *dtypes)))
        if geometry[2] in TMA_DIMS:  # sm_90a's kernels (the spec names its arch)
            for small in range(3):  # the classes of mqa_logits_tma.small_work
                config = tma_config(next_n * heads, small, geometry[2])
                specs.add(tma_family.spec((*geometry, *dtypes, *config)))
    return sorted(specs, key=str)


# -- the op ------------------------------------------------------------------------------
# Eager calls that repeat an earlier kernel call's metadata replay its launch; the key
# also holds the overrides the tests and benchmarks set.
_replays: PlanCache[Launch] = PlanCache()
_NO_SCHEDULE, _NO_OUT = absent(), absent()  # schedule_meta, out passed as None


def _logits_impl(
    q, kv_fused, weights, block_tables, seq_lens, max_seq_len: int, output_dtype, epi_dtype, acc_dtype,
    schedule_meta, out,
) -> Launch | None:  # fmt: skip
    """Write the logits into ``out``; return the kernel launch that served, None for torch."""
    geometry = (q.shape[0], q.shape[1], q.shape[2], q.shape[3], kv_fused.shape[1])
    if q.shape[0] == 0 or max_seq_len == 0:
        return None
    if not kernels_disabled():
        reason = _kernel_refusal(q, kv_fused)
        if reason is None:
            try:
                return _launch(
                    q, kv_fused, weights, block_tables, seq_lens, max_seq_len, output_dtype,
                    epi_dtype, acc_dtype, schedule_meta, out, geometry,
                )  # fmt: skip
            except KernelUnavailable as exc:
                reason = str(exc)
        if q.device.type == "cuda":
            fall_back(OP, reason)
    paged_mqa_logits_torch(q, kv_fused, weights, block_tables, seq_lens, out, epi_dtype, acc_dtype)
    return None


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
        q, kv_fused, weights, block_tables, seq_lens, max_seq_len, output_dtype, epi_dtype, acc_dtype,
        schedule_meta, out,
    )  # fmt: skip


@_logits_op.register_fake
def _(*args) -> None:  # writes only `out`, which the caller allocated: nothing to fake
    return None


def _replay_key(scalars, q, kv_fused, weights, block_tables, seq_lens, sched, dest) -> tuple | None:
    """The replay key of a call (jit_kernels.plan_cache); None: not tensors (the checks say
    what). The kernels read q, kv_fused and weights densely: only their density counts."""
    try:
        return (
            scalars,
            q.shape, q.is_contiguous(), q.dtype, q.get_device(),
            kv_fused.shape, kv_fused.is_contiguous(), kv_fused.dtype, kv_fused.get_device(),
            weights.shape, weights.is_contiguous(), weights.dtype, weights.get_device(),
            block_tables.shape, block_tables.stride(), block_tables.dtype,
            block_tables.get_device(),
            seq_lens.shape, seq_lens.stride(), seq_lens.dtype, seq_lens.get_device(),
            sched.shape, sched.stride(), sched.dtype, sched.get_device(),
            dest.shape, dest.stride(), dest.dtype, dest.get_device(),
        )  # fmt: skip
    except (AttributeError, TypeError, IndexError):
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
    return paged_logits(
        q, kv_fused, weights, block_tables, seq_lens, max_seq_len, output_dtype, epi_dtype,
        acc_dtype, schedule_meta, out, False,
    )  # fmt: skip


def paged_logits(
    q, kv_fused, weights, block_tables, seq_lens, max_seq_len: int, output_dtype, epi_dtype,
    acc_dtype, schedule_meta, out, bf16_out: bool,
) -> torch.Tensor:  # fmt: skip
    """``fp8_paged_mqa_logits`` with positional arguments; ``bf16_out`` admits bfloat16
    logits (the DeepGEMM surface, flashinfer_jit.deep_gemm)."""
    compiling = _is_compiling()
    key = tensors = None
    if not compiling:
        # The replay (jit_kernels.plan_cache): the guard of the last plan, else the key.
        scalars = (
            type(max_seq_len), max_seq_len, output_dtype, epi_dtype, acc_dtype,
            schedule_meta is None, out is None, _config_override, _force_generic, PDL, bf16_out,
        )  # fmt: skip
        sched = _NO_SCHEDULE if schedule_meta is None else schedule_meta
        dest = _NO_OUT if out is None else out
        tensors = (q, kv_fused, weights, block_tables, seq_lens, sched, dest)
        launch = _replays.recall(scalars, tensors)
        if launch is None:
            key = _replay_key(scalars, *tensors)
            launch = _replays.get(key, tensors)
        if launch is not None:
            logits = launch.run(q, kv_fused, weights, block_tables, seq_lens, schedule_meta, out)
            if logits is not None:
                return logits
            if key is None:  # a recalled launch declined these addresses: the full path's
                key = _replay_key(scalars, *tensors)  # launch replaces it
    check_dtypes(output_dtype, epi_dtype, acc_dtype, bf16_out)
    batch, next_n, _, _, block_size = check_args(
        q, kv_fused, weights, block_tables, seq_lens, max_seq_len
    )
    rows = batch * next_n
    if out is not None:
        check_out(out, rows, padded_seq_len(max_seq_len), output_dtype, q.device)
        inputs = dict(q=q, kv_fused=kv_fused, weights=weights, block_tables=block_tables,
                      seq_lens=seq_lens, schedule_meta=schedule_meta)  # fmt: skip
        require_no_overlap({"out": out}, inputs)
    else:
        out = torch.empty(rows, padded_seq_len(max_seq_len), dtype=output_dtype, device=q.device)
    if schedule_meta is not None:
        check_schedule(schedule_meta, q.device)
    if validate_inputs():
        validate_preconditions(kv_fused, block_tables, seq_lens, max_seq_len, block_size)
    args = (
        q, kv_fused, weights, block_tables, seq_lens, max_seq_len, output_dtype, epi_dtype, acc_dtype,
        schedule_meta, out,
    )  # fmt: skip
    if compiling:
        _logits_op(*args)
    else:  # eager calls skip the custom-op dispatcher's host cost
        launch = _logits_impl(*args)
        if launch is not None and key is not None:
            _replays.put(key, launch, tensors)
    # A view of the whole of `out` is `out` itself: skip the slicing (~2 us of host time).
    return out if out.shape == (rows, max_seq_len) else out[:rows, :max_seq_len]
