"""Which logits kernel serves a call and how it launches: the TMA kernel (sm_90 at its
head dims; its config for small calls when ``tma.small_work`` says so), else the ring/direct
specialization, else the generic kernel. Small calls stream their KV with an L2
evict-first policy (the kernels' kv_evict_first argument, see KvPolicy in
templates/mqa_logits/ring.cuh)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Protocol

import torch

from jit_kernels import (
    KernelSpec,
    KernelUnavailable,
    LoadedKernel,
    arch_capability,
    capability,
    sm_count,
)
from jit_kernels.plan_cache import PlanCache

from .._jit import cuda_device_index
from ..contract import Options
from .checks import kernel_smem
from .clean import clean_specs
from .generic import generic_family, generic_plan
from .launch import KernelPlan, Launch
from .ring import RingConfig, kernel_dtypes, logits_flags, ring_family, ring_params
from .schedule import SCHEDULE_THREADS, schedule_family
from .tma import (
    TABLE_PREFETCH,
    TMA_DIMS,
    TmaConfig,
    kv_evict_first,
    kv_tensor_map,
    small_work,
    tma_config,
    tma_family,
    tma_smem_bytes,
    tma_stages,
    tma_threads,
)

log = logging.getLogger("flashinfer_jit.mqa_logits")


class TmaFamily(Protocol):
    """What builds the TMA kernel: ``tma.tma_family``, or a tool's build of it."""

    def get(self, params: tuple, device: int) -> LoadedKernel: ...


@dataclasses.dataclass(frozen=True)
class MqaLogitsOptions(Options):
    """Variants the tests and tools/bench_mqa_logits.py compare (defaults: the shipped).

    ``config``: a ring/direct (warpgroups, stages, portable, ring) turns the TMA kernel off
    (stages 0: as many as fit the ring); a ``TmaConfig`` forces that kernel's config
    (stages 0: as many as fit). ``force_generic``: always the generic kernel. ``pdl``: the
    TMA kernel goes out as a programmatic dependent launch (its launch and prologue overlap
    the previous kernel's tail; it waits for that kernel's results before reading anything).
    ``tma_family``: another build of the TMA kernel with its parameters (an instrumented one
    or a timing probe, tools/). ``l2_promotion``: the KV tensor map's L2 fill size in bytes
    (tma.kv_tensor_map). ``kv_evict_first``: the KV stream's L2 policy (None: as the
    dispatcher decides, tma.kv_evict_first). ``table_prefetch``: the TMA kernel prefetches
    the block table into L2 beside its read of the lengths (None: tma.TABLE_PREFETCH)."""

    config: RingConfig | TmaConfig | None = None
    force_generic: bool = False
    pdl: bool = True
    tma_family: TmaFamily | None = None
    l2_promotion: int = 128
    kv_evict_first: bool | None = None
    table_prefetch: bool | None = None


def _launchable(plan: KernelPlan, what: str) -> KernelPlan:
    """``plan`` if one block fits an SM (registers x threads, shared memory), else
    KernelUnavailable: a config that cannot launch is refused here, never at launch time."""
    if plan.kernel.blocks_per_sm(plan.block[0], plan.smem) < 1:
        raise KernelUnavailable(
            f"{what} cannot launch: {plan.kernel.num_regs()} registers x {plan.block[0]} "
            f"threads, {plan.smem} bytes of shared memory do not fit one SM"
        )
    return plan


def _tma_plan(
    geometry, dtypes, device: int, small: int, evict: int, options: MqaLogitsOptions
) -> KernelPlan:
    next_n, heads, dim, block_size = geometry
    n = next_n * heads
    forced = options.config
    config = forced if isinstance(forced, TmaConfig) else tma_config(n, small, dim, next_n)
    if config.stages == 0:
        config = config._replace(
            stages=tma_stages(
                n, dim, config.warpgroups, config.producers, config.qbuf, pair=config.pair
            )
        )
        if config.stages < config.warpgroups:
            raise KernelUnavailable(f"forced TMA config {forced}: no ring stage fits")
    family = tma_family if options.tma_family is None else options.tma_family
    kernel = family.get((*geometry, *kernel_dtypes(dtypes), *config), device)
    promotion = options.l2_promotion
    smem = tma_smem_bytes(n, dim, config.warpgroups, config.stages, config.qbuf)
    threads = tma_threads(config.warpgroups, config.producers)

    def kv_map(kv_ptr: int, kv_fused: torch.Tensor) -> tuple[bytes]:
        return (kv_tensor_map(kv_ptr, kv_fused.shape[0], block_size, dim, promotion),)

    grid = (sm_count(device), 1, 1)
    flags = (logits_flags(dtypes, evict),)
    table = TABLE_PREFETCH if options.table_prefetch is None else options.table_prefetch
    return KernelPlan(kernel, grid, (threads, 1, 1), smem, flags, kv_map, options.pdl, table)


def tma_serves(dim: int, cap: tuple[int, int]) -> bool:
    """Whether the shipped options give a call at head dim ``dim`` on compute capability
    ``cap`` the TMA kernel: sm_90 at TMA_DIMS."""
    return dim in TMA_DIMS and cap == (9, 0)


def prebuilt_on(spec: KernelSpec, arch: str) -> bool:
    """Whether prebuild builds ``spec`` for ``arch``: not the ring kernel where the TMA kernel
    serves its head dim. Every TMA config tma_config picks launches (its registers are
    capped by __maxnreg__ at the block's share, its shared memory sized to fit:
    test_configs_fit), so the ring kernel is reached there only by a forced config (tools)."""
    ring = spec.family == ring_family.family
    return spec.supports(arch) and not (
        ring and tma_serves(int(spec.param_dict["head_dim"]), arch_capability(arch))
    )


def _specialized_plan(
    geometry, dtypes, device: int, small: int, evict: int, options: MqaLogitsOptions
) -> KernelPlan:
    """The TMA kernel where it applies and can be had, else the ring/direct kernel."""
    next_n, heads, dim, _ = geometry
    forced = options.config
    tma = isinstance(forced, TmaConfig)
    # The TMA kernel serves sm_90 at its head dims unless a ring/direct config is forced.
    if (tma and dim in TMA_DIMS) or (forced is None and tma_serves(dim, capability(device))):
        try:
            return _launchable(_tma_plan(geometry, dtypes, device, small, evict, options), "TMA")
        except KernelUnavailable as exc:
            log.info("fp8_paged_mqa_logits: TMA kernel unavailable for %s (%s)", geometry, exc)
    params = ring_params(geometry, dtypes, None if tma else forced)
    kernel = ring_family.get(params, device)
    warpgroups, stages, _, ring = params[7:11]
    smem = kernel_smem(next_n * heads, dim, warpgroups, stages, ring)
    threads = 128 * warpgroups + (32 if ring else 0)  # the ring kernel's producer warp
    flags = (logits_flags(dtypes, evict),)
    plan = KernelPlan(kernel, (sm_count(device), 1, 1), (threads, 1, 1), smem, flags)
    return _launchable(plan, kernel.name)


# (geometry, dtypes, device, small, options) -> plan: a call that misses the replay (a
# new out layout, say) skips choosing the variant and sizing the launch.
_plans: PlanCache[KernelPlan] = PlanCache(replay=False)


def kernel_plan(
    geometry, dtypes, device: int, small: int, options: MqaLogitsOptions, evict_first: bool
) -> KernelPlan:
    """The kernel that serves ``geometry`` (next_n, num_heads, head_dim, block_size) and
    ``dtypes`` (output, epilogue, accumulator) for a call of small-work class ``small``
    (``tma.small_work``), and its launch; ``evict_first``: the dispatcher's KV policy for
    the call (tma.kv_evict_first), unless ``options`` names one."""
    key = (geometry, dtypes, device, small, options, evict_first)
    plan = _plans.get(key)
    if plan is None:
        evict = int(evict_first if options.kv_evict_first is None else options.kv_evict_first)
        why = "forced"
        if not options.force_generic:
            try:
                plan = _specialized_plan(geometry, dtypes, device, small, evict, options)
            except KernelUnavailable as exc:
                why = str(exc)
        if plan is None:
            plan = _launchable(generic_plan(geometry, *dtypes, device, why, evict), "generic")
        _plans.put(key, plan)
    return plan


def launch_for(args: tuple, options: MqaLogitsOptions, lens_offset: int = 0) -> Launch:
    """The launch of a checked call (nothing is launched here); ``lens_offset``: see
    ``Launch``."""
    q, kv_fused, weights, block_tables, seq_lens, max_seq_len = args[:6]
    device = cuda_device_index(q)
    geometry = (q.shape[1], q.shape[2], q.shape[3], kv_fused.shape[1])
    small = small_work(q.shape[0], max_seq_len, sm_count(device))
    evict_first = kv_evict_first(small, geometry)
    plan = kernel_plan(geometry, args[6:9], device, small, options, evict_first)
    out = args[10]
    return Launch(plan, device, q, weights, block_tables, seq_lens, out, max_seq_len, lens_offset)


def prebuild_specs(workloads: dict) -> list[KernelSpec]:
    """Every specialization the shipped workloads reach, plus the schedule kernel and the
    generic kernel of each of their dtype triples (any geometry without NVRTC)."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    # + DeepGEMM's clean_logits (flashinfer_jit.deep_gemm)
    specs = {schedule_family.spec((SCHEDULE_THREADS,)), *clean_specs()}
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
        specs.add(generic_family.spec(dtypes))
        specs.add(ring_family.spec(ring_params(geometry, dtypes)))  # (see prebuilt_on)
        if geometry[2] in TMA_DIMS:  # sm_90a's kernels (the spec names its arch)
            for small in range(3):  # the classes of tma.small_work
                config = tma_config(next_n * heads, small, geometry[2], next_n)
                specs.add(tma_family.spec((*geometry, *kernel_dtypes(dtypes), *config)))
    return sorted(specs, key=str)
