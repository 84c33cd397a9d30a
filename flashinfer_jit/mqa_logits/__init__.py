"""FP8 paged MQA logits (the DeepSeek sparse-attention indexer): ``fp8_paged_mqa_logits``.

``op`` is the op; ``checks`` (arguments, fit rules, the public size helpers), ``plan``
(which kernel serves, the options), the kernel families ``tma`` (sm_90a, head_dim 128),
``ring`` (ring / direct), ``generic`` (runtime geometry) and ``schedule``, ``launch``
(their arguments), ``clean`` (DeepGEMM's clean_logits kernel) and ``reference`` (the torch
path, which defines the semantics).
"""

from .checks import min_block_table_width, padded_seq_len
from .op import OP, fp8_paged_mqa_logits, paged_logits
from .plan import MqaLogitsOptions
from .schedule import compute_paged_mqa_logits_schedule

__all__ = [
    "OP",
    "MqaLogitsOptions",
    "compute_paged_mqa_logits_schedule",
    "fp8_paged_mqa_logits",
    "min_block_table_width",
    "padded_seq_len",
    "paged_logits",
]
