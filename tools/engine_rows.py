"""The eager calls the host-cost tools time (tools/profile_host.py, tools/bench_engine.py):
one table of rows, each an op's call on tiny or empty inputs (zero valid counts), so the
kernels take a few microseconds and the host path dominates.

A row's ``make(device)`` builds its inputs and returns the call; the ops are imported
there, so a process that times one row's first call imports nothing else first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from jit_kernels import PTR, KernelFamily, current_stream

D = 128  # head_dim of the MQA and QSA rows

Call = Callable[[], object]


class Row(NamedTuple):
    op: str  # "mqa" (and its DeepGEMM surface), "qsa", "pack" or "torch" (the empty op)
    outputs: str  # "allocated", "given" or "" (the op has no output argument to leave out)
    make: Callable[[str], Call]


def mqa_inputs(batch: int, length: int, device: str, block: int = 64, heads: int = 64) -> tuple:
    blocks = batch * -(-length // block)
    q = torch.zeros(batch, 1, heads, D, device=device).to(torch.float8_e4m3fn)
    kv = torch.zeros(blocks, block, 1, D + 4, dtype=torch.uint8, device=device)
    kv[..., D:] = torch.ones(1).view(torch.uint8).to(device)  # fp32 scales 1.0
    w = torch.ones(batch, heads, device=device)
    table = torch.arange(blocks, dtype=torch.int32, device=device).view(batch, -1)
    lens = torch.full((batch,), length, dtype=torch.int32, device=device)
    return q, kv, w, table, lens


def qsa_inputs(rows: int, device: str, hq: int = 64, hkv: int = 4, topk: int = 2048) -> tuple:
    """Serving-shaped QSA arguments (k/v views of one combined cache), zero valid counts."""
    page, blocks, requests = 64, 256, 16
    kv = torch.zeros(blocks, hkv, page, 2 * D, dtype=torch.uint8, device=device)
    k_cache, v_cache = kv.transpose(1, 2).split(D, dim=-1)
    indices = torch.zeros(rows, topk + 1, dtype=torch.int32, device=device)
    table = torch.zeros(requests, blocks // requests, dtype=torch.int32, device=device)
    t2r = torch.zeros(rows, dtype=torch.int32, device=device)
    q = torch.zeros(rows, hq, D, dtype=torch.bfloat16, device=device)
    out, gate = torch.empty_like(q), torch.zeros_like(q)
    return q, k_cache, v_cache, indices, table, t2r, out, gate, 1 / math.sqrt(D), 1.0


def _mqa(length: int, given: bool) -> Callable[[str], Call]:
    def make(device: str) -> Call:
        from flashinfer_jit import fp8_paged_mqa_logits, padded_seq_len

        args = mqa_inputs(1, length, device)
        if not given:
            return lambda: fp8_paged_mqa_logits(*args, length)
        out = torch.empty(1, padded_seq_len(length), device=device)
        return lambda: fp8_paged_mqa_logits(*args, length, out=out)

    return make


def _deep_gemm_call(dg, device: str, metadata_in_call: bool = False) -> Call:
    """``dg`` (flashinfer_jit.deep_gemm or DeepGEMM itself) called as vLLM calls it at B=1
    L=8192: 2-D lens, the metadata computed once (or, ``metadata_in_call``, in each call)."""
    q, kv, w, table, lens = mqa_inputs(1, 8192, device)
    lens2d = lens.view(1, 1)  # [B, next_n], as vLLM passes them

    def metadata() -> torch.Tensor:
        return dg.get_paged_mqa_logits_metadata(lens2d, 64, dg.get_num_sms())

    given = None if metadata_in_call else metadata()

    def call() -> object:
        schedule = metadata() if given is None else given
        return dg.fp8_fp4_paged_mqa_logits(
            (q, None), kv, w, lens2d, table, schedule, 8192, False, torch.float32
        )

    return call


def _deep_gemm(device: str) -> Call:
    import flashinfer_jit.deep_gemm as deep_gemm

    return _deep_gemm_call(deep_gemm, device)


def _qsa(rows: int, entry: str) -> Callable[[str], Call]:
    def make(device: str) -> Call:
        import flashinfer_jit.qsa as qsa

        fn, args = getattr(qsa, entry), qsa_inputs(rows, device)
        return lambda: fn(*args)

    return make


def pack_inputs(device: str) -> tuple:
    """(kv_nope, k_pe as a view of the latent rows as serving passes it, key, value), 1x16."""
    kv = torch.zeros(1, 16, 256, dtype=torch.bfloat16, device=device)
    pe = torch.zeros(1, 576, dtype=torch.bfloat16, device=device)[:, 512:]
    key = torch.empty(1, 16, 192, dtype=torch.float8_e4m3fn, device=device)
    value = torch.empty(1, 16, 128, dtype=torch.float8_e4m3fn, device=device)
    return kv, pe, key, value


def _pack(given: bool) -> Callable[[str], Call]:
    def make(device: str) -> Call:
        from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8 as pack

        kv, pe, key, value = pack_inputs(device)
        return (lambda: pack(kv, pe, key, value)) if given else (lambda: pack(kv, pe))

    return make


def _empty_op(device: str) -> Call:
    small = torch.zeros(16, device=device)
    return lambda: small.add_(1)


def _empty_alloc_op(device: str) -> Call:
    small = torch.zeros(16, device=device)
    return lambda: small + 1


def _launch_floor(kernels: int, programmatic: bool = True) -> Callable[[str], Call]:
    """``kernels`` bound launches of an empty kernel on the current stream, programmatic as
    the ops launch theirs (tools/kernels/empty_kernel.cuh): the host floor of a cached call
    that launches that many kernels, before any argument is read off a tensor. Plain
    (``programmatic`` False): what the launch attribute costs the host."""

    def make(device: str) -> Call:
        from qsa_bench_util import TOOLS_BUILDER

        family = KernelFamily(
            TOOLS_BUILDER, "empty_kernel", "empty_kernel.cuh", "fij_tools::empty_kernel",
            ("waits",), (PTR,),
        )  # fmt: skip
        index = torch.device(device).index or 0
        go = family.get((1,), index).bind((1, 1, 1), (32, 1, 1), 0, programmatic)
        buffer = torch.zeros(1, dtype=torch.int32, device=device).data_ptr()

        def call() -> None:
            for _ in range(kernels):
                go(current_stream(index), (buffer,))

        return call

    return make


EMPTY_OP = "empty torch op (x.add_(1))"
# The same op with an output to allocate: what a row that allocates its outputs (out=None)
# can be read against besides EMPTY_OP.
EMPTY_ALLOC_OP = "empty torch op allocating (x + 1)"
ROWS: dict[str, Row] = {
    "mqa B=1 L=8192 out=None": Row("mqa", "allocated", _mqa(8192, False)),
    "mqa B=1 L=8192 out=given": Row("mqa", "given", _mqa(8192, True)),
    "mqa B=1 L=8000 out=None (a view)": Row("mqa", "allocated", _mqa(8000, False)),
    "mqa B=1 via deep_gemm (fp8_fp4 entry), 2-D lens": Row("mqa", "allocated", _deep_gemm),
    "qsa attention rows=4 (cluster)": Row("qsa", "", _qsa(4, "qsa_sparse_paged_attention")),
    "qsa attention rows=512 (slots+1 pass)": Row(
        "qsa", "", _qsa(512, "qsa_sparse_paged_attention")
    ),
    "qsa decode rows=4 (slots+1 pass)": Row("qsa", "", _qsa(4, "qsa_sparse_paged_decode")),
    "concat 1x16 out=given": Row("pack", "given", _pack(True)),
    "concat 1x16 out=None": Row("pack", "allocated", _pack(False)),
    "launch floor: 1 empty kernel (bound, programmatic)": Row("engine", "", _launch_floor(1)),
    "launch floor: 2 empty kernels (bound, programmatic)": Row("engine", "", _launch_floor(2)),
    "launch floor: 1 empty kernel (bound, plain)": Row("engine", "", _launch_floor(1, False)),
    "launch floor: 2 empty kernels (bound, plain)": Row("engine", "", _launch_floor(2, False)),
    EMPTY_OP: Row("torch", "", _empty_op),
    EMPTY_ALLOC_OP: Row("torch", "allocated", _empty_alloc_op),
}


def calls(device: str, rows: dict[str, Row] = ROWS) -> dict[str, Call]:
    """Row name -> one eager call, every row's inputs built on ``device``."""
    return {name: row.make(device) for name, row in rows.items()}


# The peers' first calls, timed by tools/bench_engine.py --peers as ours are (a new process,
# the peer's own compile cache empty, then warm): the figure a cold first call is read
# against. Each imports its peer in ``make``; a peer that does not import is skipped there.
# DeepGEMM's call includes its metadata kernel (a first use needs both); ours computes its
# schedule in the kernel. The peers' caches: tools/bench_engine.py's PEER_CACHE_ENV.
def _peer_deepgemm(device: str) -> Call:
    import deep_gemm as dg  # on sys.path from $FIJ_BENCH_DEEPGEMM (bench_engine.py --peers)

    return _deep_gemm_call(dg, device, metadata_in_call=True)


def _peer_deepgemm_hot(device: str) -> Call:
    """DeepGEMM's call with its metadata computed once (a serving step reuses it across
    layers): the hot row read against ours."""
    import deep_gemm as dg

    return _deep_gemm_call(dg, device)


def _peer_seed_qsa(device: str) -> Call:
    import importlib.util
    import os

    path = os.environ["FIJ_BENCH_SEED_TRITON"]
    spec = importlib.util.spec_from_file_location("qsa_seed_triton", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = qsa_inputs(4, device)
    return lambda: module.qsa_sparse_paged_decode(*args)


def _peer_compiled_pack(device: str) -> Call:
    from flashinfer_jit.mla_kv_pack.reference import pack_torch

    kv, pe, key, value = pack_inputs(device)
    packed = torch.compile(pack_torch)
    return lambda: packed(kv, pe, key, value, 128)


PEER_ROWS: dict[str, Row] = {
    "peer DeepGEMM mqa B=1 L=8192 (+ metadata)": Row("peer", "allocated", _peer_deepgemm),
    "peer seed Triton qsa decode rows=4": Row("peer", "", _peer_seed_qsa),
    "peer torch.compile concat 1x16": Row("peer", "given", _peer_compiled_pack),
}
# The peers' hot calls (bench_engine.py --peers): each beside ours and the empty op, as a
# measure of what issue 21's 1.2x bar asks of a library on this host.
PEER_HOT_ROWS: dict[str, Row] = {
    "peer DeepGEMM mqa B=1 (metadata given)": Row("peer", "allocated", _peer_deepgemm_hot),
    "peer seed Triton qsa decode rows=4": PEER_ROWS["peer seed Triton qsa decode rows=4"],
    "peer torch.compile concat 1x16": PEER_ROWS["peer torch.compile concat 1x16"],
}
