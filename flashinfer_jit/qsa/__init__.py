"""QSA fp8 sparse paged decode: a slot pass, a single-pass kernel and cluster split-K.

``op`` is the op (public entry points); ``checks`` (arguments, the kernels' refusals),
``kernels`` (families, configs, the split rule), ``short`` (the short single pass and the
rule that takes it), ``plan`` (a call's launches, the launch options), ``launch`` (their
arguments), ``warmup`` (warm-up, prebuild) and ``reference`` (the torch path, which defines
the semantics).
"""

from .op import OP, qsa_sparse_paged_attention, qsa_sparse_paged_decode
from .plan import QsaOptions, use_fp8_decode_kernel
from .warmup import warmup_qsa_fp8_decode


def prebuild_specs(workloads: dict) -> list:
    """Every specialization the workloads reach with the shipped options (the CLI's)."""
    return OP.prebuild_specs(workloads, OP.default.options)


__all__ = [
    "OP",
    "QsaOptions",
    "prebuild_specs",
    "qsa_sparse_paged_attention",
    "qsa_sparse_paged_decode",
    "use_fp8_decode_kernel",
    "warmup_qsa_fp8_decode",
]
