"""flashinfer-jit: GPU kernels for LLM serving, specialized and compiled on first use.

- ``flashinfer_jit.mla_kv_pack.concat_mla_kv_quant_fp8``: fused MLA K/V pack, e4m3.
- ``flashinfer_jit.fp8_paged_mqa_logits`` and its helpers: the sparse-attention indexer.
- ``flashinfer_jit.qsa``: QSA fp8 sparse paged decode.
"""

from . import mla_kv_pack, qsa
from ._version import __version__
from .mqa_logits import (
    compute_paged_mqa_logits_schedule,
    fp8_paged_mqa_logits,
    min_block_table_width,
    padded_seq_len,
)

__all__ = [
    "__version__",
    "compute_paged_mqa_logits_schedule",
    "fp8_paged_mqa_logits",
    "min_block_table_width",
    "mla_kv_pack",
    "padded_seq_len",
    "qsa",
]
