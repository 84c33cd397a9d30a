"""Opt-in variants of the QSA decode, for measurement: nothing here is dispatched.

``tools/bench_qsa.py --sweep-variants`` runs each variant of ``SINGLE_VARIANTS`` (on calls
the dispatcher gives the single pass) and ``CLUSTER_VARIANTS`` (calls it gives cluster
split-K) at the dispatcher's split count, checks it against the torch path and times it.
A variant is a set of feature bits of the ``qsa_decode_x`` / ``qsa_decode_cluster_x``
kernels (``FEATURES``, the kFeat* constants of templates/qsa_bulk.cuh) plus optional
launch shape overrides; ``run_variant`` launches it. Adopting a winner means routing the
dispatcher (``qsa._run_kernels``) to these families with its parameters.
"""

from __future__ import annotations

import dataclasses

import torch

from jit_kernels import current_stream, sm_count

from . import qsa
from ._jit import cuda_device_index, kernel_family
from .qsa_checks import kernel_refusal, offset_bits

# Feature bits (templates/qsa_bulk.cuh): what each one changes is documented there.
FEATURES = {
    "order": 1,  # single pass: rows sorted longest first by the slot pass (shorter tail)
    "spec": 2,  # single pass: prologue slot loads and copies do not wait for the count
    "gate": 4,  # gate fetched at kernel start (registers in clusters, else into L2)
    "tma": 8,  # cp.async.bulk rows + one mbarrier per warp stage (D = 128)
    "kv256": 16,  # with tma: one 256-byte copy per token (V must follow K in memory)
    "ilv": 32,  # split-K: chunk c to split c % CLUSTER (fused index loads skip a round trip)
    "qk2": 64,  # QK MMAs in two independent accumulator chains
    "lin": 128,  # token address = linear row * token stride (one multiply-add)
}
SINGLE_ONLY = {"order", "spec"}
CLUSTER_ONLY = {"ilv"}
WARPS = (4, 8, 16)
MAX_CLUSTER = 16  # 9..16: non-portable cluster sizes
BULK_STAGE_BYTES = 4224  # stage_bytes(128, true) in templates/qsa_util.cuh
SMEM_LIMIT = 227 * 1024  # per CTA
SM_SMEM, CTA_RESERVED = 228 * 1024, 1024  # per SM, and the system's share of each CTA


@dataclasses.dataclass(frozen=True)
class Variant:
    """Feature names plus optional overrides of the dispatcher's launch shape.

    ``config`` is (warps, stages, min CTAs per SM); ``cluster`` the split count of a
    cluster call (default: the dispatcher's). ``one_wave``: applies only to cluster calls
    whose dispatcher grid fits one CTA per SM (tiny batches), like ONE_WAVE_CLUSTER_128.
    """

    features: tuple[str, ...] = ()
    config: tuple[int, int, int] | None = None
    cluster: int | None = None
    one_wave: bool = False

    @property
    def feat(self) -> int:
        return sum(FEATURES[f] for f in set(self.features))


_OSG = ("order", "spec", "gate")
SINGLE_VARIANTS = {
    "x-base": Variant(),
    "order": Variant(("order",)),
    "spec": Variant(("spec",)),
    "gate": Variant(("gate",)),
    "lin": Variant(("lin",)),
    "qk2": Variant(("qk2",)),
    "tma": Variant(("tma",)),
    "tma256": Variant(("tma", "kv256")),
    "osg": Variant(_OSG),
    "osg+lin+qk2": Variant((*_OSG, "lin", "qk2")),
    "osg+tma256": Variant((*_OSG, "tma", "kv256")),
    "osg+tma256+qk2": Variant((*_OSG, "tma", "kv256", "qk2")),
    "osg+tma256 s4x3": Variant((*_OSG, "tma", "kv256"), config=(4, 4, 3)),
    "osg w8x2": Variant(_OSG, config=(8, 3, 2)),
    "osg+tma256 w8x2": Variant((*_OSG, "tma", "kv256"), config=(8, 3, 2)),
}
_IG = ("ilv", "gate")
CLUSTER_VARIANTS = {
    "x-base": Variant(),
    "ilv": Variant(("ilv",)),
    "gate": Variant(("gate",)),
    "ig": Variant(_IG),
    "ig+qk2": Variant((*_IG, "qk2")),
    "ig+lin": Variant((*_IG, "lin")),
    "ig+tma256": Variant((*_IG, "tma", "kv256")),  # 3 CTAs/SM: one-wave grids only
    "ig+tma256 s2": Variant((*_IG, "tma", "kv256"), config=(4, 2, 4)),
    "ig w8": Variant(_IG, config=(8, 3, 1), one_wave=True),
    "ig w16s2": Variant(_IG, config=(16, 2, 1), one_wave=True),
    "ig+tma256 w16s2": Variant((*_IG, "tma", "kv256"), config=(16, 2, 1), one_wave=True),
    "ig c16": Variant(_IG, cluster=16, one_wave=True),
    "ig+qk2 c16": Variant((*_IG, "qk2"), cluster=16, one_wave=True),
}

_DECODE_X = (*qsa._DECODE_SIGNATURE, "P")  # + the row order
_single_x = kernel_family(
    "qsa_decode_x",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_x",
    (*qsa._DECODE_PARAMS, "slot_ahead", "feat"),
    _DECODE_X,
)
_cluster_x = kernel_family(
    "qsa_decode_cluster_x",
    "qsa_decode.cuh",
    "fij_qsa::qsa_decode_cluster_x",
    (*qsa._DECODE_PARAMS, "cluster", "slot_cap", "feat"),
    _DECODE_X,
)
_slots_order = kernel_family(
    "qsa_slots_order",
    "qsa_slots.cuh",
    "fij_qsa::qsa_slots_order",
    ("page_size",),
    ("P", "q", "q", "P", "q", "q", "P", "q", "P", "i", "i", "i", "i", "i", "i", "i", "P"),
)
_non_portable_allowed: set[int] = set()


def decode_smem_bytes(
    head_dim: int,
    warps: int,
    stages: int,
    min_ctas: int,
    cluster: int,
    slot_cap: int,
    bulk: bool,
) -> int:
    """DecodeSmem<...>::kBytes of templates/qsa_util.cuh (bulk: kFeatTma stages)."""
    q_in_smem = head_dim > 128 or warps * min_ctas >= 16
    q_bytes = (head_dim // 64) * 4 * 32 * 16 if q_in_smem else 0
    stage = warps * stages * (BULK_STAGE_BYTES if bulk else head_dim * 32)
    red = warps * 16 * (head_dim + qsa._RED_PAD) * 4 + warps * 16 * 2 * 4
    part = 16 * (head_dim + 2) * 4 if cluster else 0
    bars = warps * stages * 8 if bulk else 0
    return q_bytes + max(stage + slot_cap * 4, red + part) + bars


def splits_for(variant: Variant, args: tuple, splits: int | None = None) -> int:
    """The split count ``variant`` runs a call with: ``splits`` when given (1 = single
    pass), else the dispatcher's (1 from DECODE_MIN_PROGRAMS up, else split_count); a
    cluster call takes the variant's ``cluster`` override."""
    q, k_cache, _, logical_indices = args[:4]
    rows, num_kv_heads, topk = q.shape[0], k_cache.shape[2], logical_indices.shape[1] - 1
    if splits is None:
        single = qsa.use_fp8_decode_kernel(rows * num_kv_heads, torch.uint8)
        splits = 1 if single else qsa.split_count(rows, num_kv_heads, topk)
    return splits if splits == 1 else variant.cluster or splits


def refusal(
    variant: Variant, args: tuple, splits: int | None = None, device_sms: int | None = None
) -> str | None:
    """Why ``variant`` does not apply to the call ``args`` run with ``splits`` (see
    ``splits_for``), None when it does. ``device_sms`` (the SM count) decides
    ``one_wave``; None skips that rule."""
    q, k_cache, v_cache, logical_indices = args[:4]
    unknown = set(variant.features) - set(FEATURES)
    if unknown:
        return f"unknown features {sorted(unknown)}"
    rows, _, head_dim = q.shape
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    feats = set(variant.features)
    base = splits_for(Variant(), args, splits)
    splits = splits_for(variant, args, splits)
    if base == 1 and (feats & CLUSTER_ONLY or variant.cluster or variant.one_wave):
        return "cluster-only variant on a single-pass call"
    if splits > 1 and feats & SINGLE_ONLY:
        return "single-pass-only features on a cluster call"
    if not 1 <= splits <= MAX_CLUSTER:
        return f"cluster size {splits} not in [2, {MAX_CLUSTER}]"
    if variant.one_wave and device_sms is not None and rows * num_kv_heads * base > device_sms:
        return "one-wave variant on a grid of more than one CTA per SM"
    if "kv256" in feats and "tma" not in feats:
        return "kv256 needs tma"
    if "tma" in feats and head_dim != 128:
        return "bulk stages are laid out for head_dim 128"
    k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]
    if "kv256" in feats and (
        v_cache.data_ptr() != k_cache.data_ptr() + head_dim or v_strides != k_strides
    ):
        return "kv256 needs V right after K (the combined [blocks, Hkv, page, 2D] cache)"
    if "lin" in feats:
        k_block, k_token = k_strides[0], k_strides[1]
        per_page = k_block // k_token if k_token > 0 else 0
        if not per_page or k_block != per_page * k_token or v_strides[0] != per_page * v_strides[1]:
            return "lin needs block strides that are whole multiples of the token strides"
        if num_blocks * per_page + page_size >= 2**31:
            return "lin: linear token rows overflow int32"
    warps, stages, min_ctas = _config_of(variant, head_dim, splits)
    if warps not in WARPS or not 2 <= stages <= 8 or not 1 <= min_ctas <= 8:
        return f"config {variant.config} out of range (warps {WARPS}, stages 2-8, min CTAs 1-8)"
    cap = qsa.CLUSTER_SLOT_CAP if splits > 1 and qsa._fused_fits(topk, splits) else 0
    smem = decode_smem_bytes(head_dim, warps, stages, min_ctas, splits > 1, cap, "tma" in feats)
    if smem > SMEM_LIMIT:
        return f"{smem} bytes of shared memory"
    # A variant whose shared memory fits fewer CTAs per SM than its launch bound would be
    # measured at another occupancy than designed (unless its grid fits at that one anyway).
    fit = SM_SMEM // (smem + CTA_RESERVED)
    if (
        device_sms is not None
        and fit < min_ctas
        and rows * num_kv_heads * splits > fit * device_sms
    ):
        return f"{smem} bytes of shared memory fit {fit} CTAs per SM, not {min_ctas}"
    return None


def _config_of(variant: Variant, head_dim: int, splits: int) -> tuple[int, int, int]:
    if variant.config is not None:
        return variant.config
    return qsa.DECODE_CONFIG[head_dim] if splits > 1 else qsa._single_pass_config(head_dim)[:3]


def _allow_non_portable(kernel) -> None:
    """Let a kernel with a compile-time cluster of 9..16 CTAs launch (once per kernel)."""
    if id(kernel) in _non_portable_allowed:
        return
    from cuda.bindings import driver

    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    (err,) = driver.cuFuncSetAttribute(kernel.function, attr, 1)
    if int(err):
        raise RuntimeError(f"{kernel.name}: non-portable cluster size refused: {err!r}")
    _non_portable_allowed.add(id(kernel))


def _slots_and_order(logical_indices, block_table, token_to_req, k_cache):
    """The slot pass plus the longest-first row order, in one launch (qsa_slots_order)."""
    rows = logical_indices.shape[0]
    num_blocks, page_size, _, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    device = cuda_device_index(logical_indices)
    columns = -(-topk // qsa.CHUNK) * qsa.CHUNK
    buf = torch.empty(rows * columns + rows, dtype=torch.int32, device=logical_indices.device)
    slots, order = buf[: rows * columns].view(rows, columns), buf[rows * columns :]
    args = (logical_indices.data_ptr(), logical_indices.stride(0), logical_indices.stride(1))
    args += (block_table.data_ptr(), block_table.stride(0), block_table.stride(1))
    args += (token_to_req.data_ptr(), token_to_req.stride(0), slots.data_ptr(), topk, columns)
    args += (block_table.shape[1], block_table.shape[0], num_blocks, offset_bits(page_size))
    args += (rows, order.data_ptr())
    _slots_order.get((page_size,), device).launch(
        (rows + 1, max(1, -(-columns // qsa._SLOT_THREADS)), 1),
        (qsa._SLOT_THREADS, 1, 1),
        current_stream(device),
        args,
    )
    return slots, order


def run_variant(args: tuple, variant: Variant, splits: int | None = None) -> None:
    """Run one call (the public functions' ``args``) through ``variant``'s kernels, with
    ``splits`` as ``splits_for`` reads it (None: the dispatcher's path).

    Raises ValueError when the variant does not apply (``refusal``) or the kernels cannot
    serve the call; never falls back to the torch path (this is for measurement).
    """
    q, k_cache, v_cache, logical_indices, block_table, token_to_req, out, output_gate = args[:8]
    softmax_scale, output_scale = float(args[8]), float(args[9])
    reason = kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate)
    reason = reason or refusal(variant, args, splits, sm_count(cuda_device_index(q)))
    if reason:
        raise ValueError(f"variant {variant} does not apply: {reason}")
    rows, num_q_heads, head_dim = q.shape
    if rows == 0:
        return
    num_blocks, page_size, num_kv_heads, _ = k_cache.shape
    topk = logical_indices.shape[1] - 1
    device = cuda_device_index(q)
    splits = splits_for(variant, args, splits)
    feat = variant.feat
    config = _config_of(variant, head_dim, splits)
    group = num_q_heads // num_kv_heads
    slots = order = None
    cap = 0
    if splits == 1:
        if "order" in variant.features:
            slots, order = _slots_and_order(logical_indices, block_table, token_to_req, k_cache)
        else:
            slots = qsa._resolve_slots(logical_indices, block_table, token_to_req, k_cache)
        kernel = _single_x.get((group, head_dim, *config, 1, feat), device)
    else:
        cap = qsa.CLUSTER_SLOT_CAP if qsa._fused_fits(topk, splits) else 0
        if not cap:
            slots = qsa._resolve_slots(logical_indices, block_table, token_to_req, k_cache)
        kernel = _cluster_x.get((group, head_dim, *config, splits, cap, feat), device)
        if splits > 8:
            _allow_non_portable(kernel)
    k_strides, v_strides = k_cache.stride()[:3], v_cache.stride()[:3]  # bytes (e4m3: 1 B)
    counts = logical_indices.data_ptr() + topk * logical_indices.stride(1) * 4
    columns = -(-topk // qsa.CHUNK) * qsa.CHUNK
    launch = (q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), *k_strides)
    launch += (v_cache.data_ptr(), *v_strides, 0 if slots is None else slots.data_ptr())
    launch += (columns, counts, logical_indices.stride(0), topk, offset_bits(page_size))
    launch += (num_kv_heads, out.data_ptr(), out.stride(0), out.stride(1))
    launch += (output_gate.data_ptr(), output_gate.stride(0), output_gate.stride(1))
    launch += (softmax_scale * qsa._LOG2E, output_scale)
    launch += (logical_indices.data_ptr(), logical_indices.stride(1), block_table.data_ptr())
    launch += (block_table.stride(0), block_table.stride(1), block_table.shape[1])
    launch += (block_table.shape[0], token_to_req.data_ptr(), token_to_req.stride(0))
    launch += (num_blocks, page_size, 0 if order is None else order.data_ptr())
    smem = decode_smem_bytes(head_dim, *config, splits > 1, cap, "tma" in variant.features)
    kernel.launch(
        (rows * num_kv_heads, splits, 1),
        (32 * config[0], 1, 1),
        current_stream(device),
        launch,
        smem=smem,
    )


def variant_specs(group: int, head_dim: int, splits: int, topk: int) -> list:
    """The decode specs the variants use on a call of this shape (compile checks)."""
    specs = []
    table = SINGLE_VARIANTS if splits == 1 else CLUSTER_VARIANTS
    for variant in table.values():
        if "tma" in variant.features and head_dim != 128:
            continue
        k = variant.cluster or splits
        config = _config_of(variant, head_dim, k)
        if k == 1:
            specs.append(_single_x.spec((group, head_dim, *config, 1, variant.feat)))
        else:
            cap = qsa.CLUSTER_SLOT_CAP if qsa._fused_fits(topk, k) else 0
            specs.append(_cluster_x.spec((group, head_dim, *config, k, cap, variant.feat)))
    return specs
