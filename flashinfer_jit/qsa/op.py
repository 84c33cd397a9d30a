"""The QSA fp8 sparse paged decode as an op of the contract (``flashinfer_jit.contract``).

    out[r, h] = output_scale * softmax(q[r, h] . K_sel * softmax_scale) V_sel * sigmoid(gate[r, h])

over the cache tokens row r selects (see ``reference.resolve_entries`` for what is
attended). ``dispatch`` (the attention entry point) lets small batches split the
selection over a thread block cluster (``plan.dispatch_split``); the decode entry point
always takes the single pass. Both take the short single pass (``short.py``) in place of
the single pass where ``short.takes_short`` says (sm_90: many rows, short selections).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from jit_kernels import KernelSpec

from .._jit import cuda_device_index
from ..contract import Op, ScalarArg, TensorArg
from .checks import WORKLOAD_FIELDS, check_args, kernel_refusal
from .kernels import ordered_prebuilt_on
from .launch import DecodeLaunch
from .plan import (
    QsaOptions,
    Variant,
    bulk_ok,
    decode_launch,
    dispatch_split,
    single_pass_variant,
)
from .reference import qsa_decode_torch
from .short import short_prebuilt_on
from .warmup import prebuild_specs


class Qsa(Op[DecodeLaunch, QsaOptions]):
    name = "qsa"
    log_name = "qsa"
    custom_op = "qsa_sparse_paged_decode"
    workloads = Path(__file__).parent / "workloads.json"
    workload_fields = WORKLOAD_FIELDS
    args = (
        *(TensorArg(n) for n in ("q", "k_cache", "v_cache", "logical_indices", "block_table")),
        TensorArg("token_to_req"),
        TensorArg("out", mutated=True),
        TensorArg("output_gate"),
        ScalarArg("softmax_scale", "float"),
        ScalarArg("output_scale", "float"),
        ScalarArg("dispatch", "bool", typed=False),  # set by the entry points,
    )
    options_type = QsaOptions

    def prepare(self, args: tuple) -> tuple:
        check_args(*args[:10])
        return args

    def empty(self, args: tuple) -> bool:
        return args[0].shape[0] == 0

    def refusal(self, args: tuple) -> str | None:
        q, k_cache, v_cache, logical_indices, _, _, out, output_gate = args[:8]
        return kernel_refusal(q, k_cache, v_cache, logical_indices, out, output_gate)

    def plan(self, args: tuple, options: QsaOptions) -> DecodeLaunch:
        q, k_cache, v_cache, indices = args[0], args[1], args[2], args[3]
        shape = (q.shape[0], k_cache.shape[2], indices.shape[1] - 1, q.shape[2])
        device = cuda_device_index(q)
        call = dict(group=q.shape[1] // k_cache.shape[2], bulk=bulk_ok(k_cache, v_cache, device))
        if args[10]:
            variant = dispatch_split(*shape, k_cache.dtype, device, options.short, **call)
        else:
            variant = single_pass_variant(*shape, device, options.short, **call)
        return decode_launch(args, options, variant, call["bulk"])

    def reference(self, args: tuple) -> None:
        qsa_decode_torch(*args[:10])

    def result(self, args: tuple) -> torch.Tensor:
        return args[6]

    def prebuild_specs(self, workloads: dict, options: QsaOptions) -> list[KernelSpec]:
        return prebuild_specs(workloads, options)

    def prebuilt_on(self, spec: KernelSpec, arch: str) -> bool:
        # the short single pass and the ordered 2-split where the dispatcher takes them
        return short_prebuilt_on(spec, arch) and ordered_prebuilt_on(spec, arch)


OP = Qsa()


def with_options(**fields) -> QsaOptions:
    """The shipped options with ``fields`` replaced."""
    return dataclasses.replace(OP.default.options, **fields)


def run_kernels(
    args: tuple,
    num_splits: int = 1,
    fused: bool | None = None,
    *,
    config: tuple[int, int, int] | None = None,
    bulk: bool | None = None,
    pair: bool | None = None,
    short: bool = False,
    order: bool | None = None,
    **options,
) -> None:
    """Launch one variant's kernels for a call (``args`` as the public functions take them;
    see ``plan.Variant``), unchecked: tools and tests compare variants the dispatcher would
    not pick (``short``/``order``: the short single pass, qsa/short.py). ``options`` replace
    fields of the shipped ``QsaOptions`` (pdl, slot_entries, tmma, lean)."""
    launch = decode_launch(
        args, with_options(**options), Variant(num_splits, fused, config, bulk, pair, short, order)
    )
    if launch.run(*args) is None:
        raise ValueError("q, k_cache, v_cache, out and output_gate must be 16-byte aligned")


# fmt: off
@OP.entry(dispatch=False)  # the body: the contract's call path (a repeat call replays)
def qsa_sparse_paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, logical_indices: torch.Tensor,
    block_table: torch.Tensor, token_to_req: torch.Tensor, out: torch.Tensor,
    output_gate: torch.Tensor, softmax_scale: float, output_scale: float,
) -> torch.Tensor:
    """Sparse GQA over an e4m3 paged cache, single pass: one CTA per (row, kv head) (on
    sm_90 over many rows with short selections, the short single pass's 1- or 2-warp CTAs).

    ``q``/``out``/``output_gate`` are [rows, Hq, D] bf16; ``k_cache``/``v_cache`` are
    [num_blocks, page_size, Hkv, D] e4m3 (float8_e4m3fn or uint8 codes) with any strides
    whose last is 1; ``logical_indices`` is [rows, TOPK + 1] int32 whose last column is the
    valid count; ``block_table`` is [num_requests, width] int32; ``token_to_req`` [rows].
    Writes ``out`` and returns it.
    """


@OP.entry(dispatch=True)
def qsa_sparse_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, logical_indices: torch.Tensor,
    block_table: torch.Tensor, token_to_req: torch.Tensor, out: torch.Tensor,
    output_gate: torch.Tensor, softmax_scale: float, output_scale: float,
) -> torch.Tensor:
    """``qsa_sparse_paged_decode``'s contract; small batches split the selection across CTAs.

    ``use_fp8_decode_kernel(rows * Hkv, cache dtype, topk=TOPK, head_dim=D)`` picks the single
    pass; below the crossover each (row, kv head)'s selection is split over a thread block cluster
    (``kernels.launch_split``: as many CTAs as keep every cluster resident at once, one
    per SM, where that holds) whose CTAs merge their partials through distributed shared
    memory. On sm_90, calls of many rows with short selections take the short single pass
    (``short.takes_short``; ``QsaOptions.short`` forces it off or on).
    """
# fmt: on
