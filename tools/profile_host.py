"""Host time per eager call of each op (MQA logits, QSA decode, MLA K/V pack), one table.

    python tools/profile_host.py [--calls 3000] [--profile ROW]   # on the GPU machine
    python tools/profile_host.py --stub [--profile ROW]           # anywhere (CPU tensors)

GPU: each call runs with the GPU idle (synchronized before it). "host us" is the median
wall time of the Python call (what precedes the launch and the launch itself); "eager us"
the median of one CUDA-event pair around one call, the figure the speed targets count
(host time + launch latency + kernel). The inputs are tiny or empty (zero valid counts),
so the kernels take a few microseconds and the host path dominates.

--stub (no GPU needed): CPU tensors, every kernel replaced by a stub that packs its
arguments but does not call cuLaunchKernel, and the ops' CUDA-device tests bypassed: the
figures are the Python overhead of each op's repeat-call path alone (through the native
launcher's branch unless FLASHINFER_JIT_NATIVE_LAUNCH=0 or it cannot be built).
--profile ROW runs cProfile over that row's calls and prints the top 25 functions by tottime.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flashinfer_jit.deep_gemm as deep_gemm  # noqa: E402
import flashinfer_jit.mla_kv_pack as mkp  # noqa: E402
import flashinfer_jit.qsa as qsa  # noqa: E402
from flashinfer_jit import fp8_paged_mqa_logits, padded_seq_len  # noqa: E402
from flashinfer_jit.qsa import kernels as qk  # noqa: E402
from flashinfer_jit.registry import OPS  # noqa: E402
from jit_kernels import KernelFamily, LoadedKernel, native  # noqa: E402

D = 128  # head_dim of the MQA and QSA rows


def mqa_inputs(batch: int, length: int, device: str, block: int = 64, heads: int = 64):
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


def rows(device: str) -> dict[str, Callable[[], object]]:
    """Row name -> one eager call."""
    mqa, mqa8000 = mqa_inputs(1, 8192, device), mqa_inputs(1, 8000, device)
    mqa_out = torch.empty(1, padded_seq_len(8192), device=device)
    lens2d = mqa[4].view(1, 1)  # [B, next_n], as vLLM passes them
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens2d, 64, deep_gemm.get_num_sms())
    qsa4, qsa512 = qsa_inputs(4, device), qsa_inputs(512, device)
    kv = torch.zeros(1, 16, 256, dtype=torch.bfloat16, device=device)
    pe = torch.zeros(1, 576, dtype=torch.bfloat16, device=device)[:, 512:]  # as serving passes it
    key = torch.empty(1, 16, 192, dtype=torch.float8_e4m3fn, device=device)
    value = torch.empty(1, 16, 128, dtype=torch.float8_e4m3fn, device=device)
    small = torch.zeros(16, device=device)
    return {
        "mqa B=1 L=8192 out=None": lambda: fp8_paged_mqa_logits(*mqa, 8192),
        "mqa B=1 L=8192 out=given": lambda: fp8_paged_mqa_logits(*mqa, 8192, out=mqa_out),
        "mqa B=1 L=8000 out=None (a view)": lambda: fp8_paged_mqa_logits(*mqa8000, 8000),
        "mqa B=1 via deep_gemm, 2-D lens": lambda: deep_gemm.fp8_paged_mqa_logits(
            mqa[0], mqa[1], mqa[2], lens2d, mqa[3], schedule, 8192
        ),
        "qsa attention rows=4 (cluster)": lambda: qsa.qsa_sparse_paged_attention(*qsa4),
        "qsa attention rows=512 (slots+1 pass)": lambda: qsa.qsa_sparse_paged_attention(*qsa512),
        "qsa decode rows=4 (slots+1 pass)": lambda: qsa.qsa_sparse_paged_decode(*qsa4),
        "concat 1x16 out=given": lambda: mkp.concat_mla_kv_quant_fp8(kv, pe, key, value),
        "concat 1x16 out=None": lambda: mkp.concat_mla_kv_quant_fp8(kv, pe),
        "empty torch op (x.add_(1))": lambda: small.add_(1),
    }


# -- the CPU stub ------------------------------------------------------------------------------
class StubKernel(LoadedKernel):
    """A loaded kernel whose launch packs the arguments and stops short of the driver."""

    def __init__(self, family: KernelFamily, params: tuple):
        self.name, self.device, self.packer = f"stub {family.family}{params}", 0, family.packer
        self._library = None
        # The launch path a GPU machine takes: the native launcher where it can be had
        # (FLASHINFER_JIT_NATIVE_LAUNCH), else cuda-python; stubs return success.
        launcher = native.launcher()
        self._bind(None, None)
        self._smem_limit = 1 << 30
        self._launch = self._launch_ex = lambda *args: (0,)  # cuda-python's (CUresult,)
        if launcher is not None:
            self._native = self._native_pdl = lambda *args: 0  # the launcher's CUresult

    def blocks_per_sm(self, threads: int, smem: int = 0) -> int:
        return 1

    def num_regs(self) -> int:
        return 0


def install_stub() -> None:
    """Make the ops' kernel paths run on CPU tensors (see the module docstring)."""
    stubs: dict[tuple, StubKernel] = {}

    def get(family, params, device):  # a dict lookup, as KernelFamily.get's hot path
        kernel = stubs.get((family.family, params))
        if kernel is None:
            kernel = stubs[(family.family, params)] = StubKernel(family, params)
        return kernel

    KernelFamily.get = get
    fakes = {
        "cuda_device_index": lambda tensor: 0,
        "current_stream": lambda device: 0,
        "sm_count": lambda device: 132,
        "capability": lambda device: (9, 0),
        "kv_tensor_map": lambda ptr, blocks, block_size, dim, promotion=128: bytes(128),  # TMA
        "wave_clusters": lambda device: qk.H200_WAVE_CLUSTERS.__getitem__,  # QSA's one-wave split
    }
    for name, module in list(sys.modules.items()):
        if name.startswith("flashinfer_jit"):
            for attr, fake in fakes.items():
                if hasattr(module, attr):
                    setattr(module, attr, fake)
    for op in (*OPS.values(), deep_gemm.OP):  # kernels serve CPU tensors: no device test
        op.kernel_call, op.refusal = (lambda args: True), (lambda args: None)


# -- timing ------------------------------------------------------------------------------------
def gpu_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """(median host us, median eager us) of single calls on an idle GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, eager = [], []
    for i in range(calls + 50):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= 50:
            host.append((t1 - t0) * 1e6)
            eager.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), statistics.median(eager)


def cpu_us(fn: Callable[[], object], calls: int) -> float:
    """The best of 7 rounds' mean us per call, back to back."""
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return min(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--stub", action="store_true", help="CPU tensors, stubbed launches")
    parser.add_argument("--profile", metavar="ROW", help="cProfile the row whose name starts so")
    args = parser.parse_args()
    if args.stub:
        install_stub()
    elif not torch.cuda.is_available():
        parser.error("no GPU: run with --stub for the Python overhead alone")
    table = rows("cpu" if args.stub else "cuda")
    width = max(map(len, table))
    if args.stub:
        print(f"{'row':{width}}  host us (CPU, stubbed launches)")
    else:
        print(f"{'row':{width}}  host us  eager us   ({torch.cuda.get_device_name()})")
    for name, fn in table.items():
        if args.stub:
            print(f"{name:{width}}  {cpu_us(fn, args.calls):7.2f}")
        else:
            host, eager = gpu_us(fn, args.calls)
            print(f"{name:{width}}  {host:7.1f}  {eager:8.1f}")
    if args.profile:
        name = next(n for n in table if n.startswith(args.profile))
        sync = (lambda: None) if args.stub else torch.cuda.synchronize  # an idle GPU per call
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            table[name]()
            sync()
        prof.disable()
        print(f"\ncProfile over {args.calls} calls of {name!r}, top 25 by tottime:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
