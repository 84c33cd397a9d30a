"""Every op the package ships, by its CLI name: what ``flashinfer-jit prebuild`` and the
tests iterate. Adding an op adds one line here (docs/adding_an_op.md)."""

from __future__ import annotations

from .contract import Op
from .mla_kv_pack import OP as MLA_KV_PACK
from .mqa_logits import OP as MQA_LOGITS
from .qsa import OP as QSA

OPS: dict[str, Op] = {op.name: op for op in (MLA_KV_PACK, MQA_LOGITS, QSA)}
