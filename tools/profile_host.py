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
launcher's branch unless FLASHINFER_JIT_NATIVE_LAUNCH=0 or it cannot be built; QSA's slot
buffer through the raw-allocator branch a CUDA device takes, its allocator calls no-ops).
--profile ROW runs cProfile over that row's calls and prints the top 25 functions by tottime.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_rows

from engine_rows import calls  # noqa: E402

import flashinfer_jit.deep_gemm as deep_gemm  # noqa: E402
from flashinfer_jit.qsa import kernels as qk  # noqa: E402
from flashinfer_jit.registry import OPS  # noqa: E402 (every op, before install_stub)
from jit_kernels import KernelFamily, LoadedKernel, native  # noqa: E402
from jit_kernels.alloc import RawAllocator  # noqa: E402


# -- the CPU stub ------------------------------------------------------------------------------
class StubKernel(LoadedKernel):
    """A loaded kernel whose launches pack the arguments and stop short of the driver."""

    def __init__(self, family: KernelFamily, params: tuple):
        self.name, self.device, self.packer = f"stub {family.family}{params}", 0, family.packer
        self._library = None
        # The launch path a GPU machine takes: the native launcher where it can be had
        # (FLASHINFER_JIT_NATIVE_LAUNCH), its driver calls made no-ops; else cuda-python's,
        # stubbed to return success.
        launcher = native.launcher()
        if launcher is not None:
            launcher.use_null_driver()
        self._bind(None, launcher)
        self._smem_limit = 1 << 30
        self._launch = self._launch_ex = lambda *args: (0,)  # cuda-python's (CUresult,)

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
        # QSA's slots: the raw path a CUDA device takes, the allocator's calls made no-ops
        # (the allocator's own work is the same as a tensor's, and not timed here)
        "raw_allocator": lambda device: RawAllocator(lambda n, s: 1 << 40, id, lambda: 0),
    }
    for name, module in list(sys.modules.items()):
        if name.startswith("flashinfer_jit") or name == "engine_rows":  # + the launch-floor rows
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
    table = calls("cpu" if args.stub else "cuda")
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
