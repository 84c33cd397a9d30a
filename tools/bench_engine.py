"""Engine costs on a GPU: cold compile, warm (disk) first call, hot-call host overhead.

Run on the GPU machine: ``python tools/bench_engine.py``. Prints a table last.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_FIRST_CALL = """
import time, torch, sys
sys.path.insert(0, {repo!r})
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8 as op
kv = torch.randn({tokens}, {heads}, 256, device="cuda", dtype=torch.bfloat16)
pe = torch.randn({tokens}, 64, device="cuda", dtype=torch.bfloat16)
start = time.perf_counter(); op(kv, pe, backend="specialized"); torch.cuda.synchronize()
print((time.perf_counter() - start) * 1e3)
"""


def first_call_ms(cache: str, heads: int) -> float:
    env = {**os.environ, "FLASHINFER_JIT_CACHE_DIR": cache, "FLASHINFER_JIT_STRICT": "1"}
    script = _FIRST_CALL.format(repo=str(REPO), tokens=64, heads=heads)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def hot_overhead_us() -> dict[str, float]:
    import torch

    sys.path.insert(0, str(REPO))
    from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8
    from flashinfer_jit.mla_kv_pack.specialized import family
    from jit_kernels import current_stream

    kv = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    pe = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    key, value = concat_mla_kv_quant_fp8(kv, pe)
    small = torch.zeros(16, device="cuda")
    kernel = family.get((0, 4), 0)
    args = (kv.data_ptr(), pe.data_ptr(), key.data_ptr(), value.data_ptr(), 1, 1, 1, 64)

    def per_call(fn, n=20000) -> float:
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(n // 5):
                fn()
            samples.append((time.perf_counter() - start) / (n // 5) * 1e6)
            torch.cuda.synchronize()
        return statistics.median(samples)

    # The same launch through a ctypes binding of libcuda's cuLaunchKernel, to see what the
    # cuda-bindings wrapper itself costs per call.
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    raw = libcuda.cuLaunchKernel
    raw.restype = ctypes.c_int
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    func = int(kernel.function)

    def ctypes_launch():
        params = kernel.packer.pack(args)
        err = raw(func, 1, 1, 1, 256, 1, 1, 0, current_stream(0), params, None)
        if err:
            raise RuntimeError(err)

    return {
        "ctypes cuLaunchKernel (same packing and stream lookup)": per_call(ctypes_launch),
        "empty torch op (x.add_(1), 16 elems)": per_call(lambda: small.add_(1)),
        "engine launch (LoadedKernel.launch)": per_call(
            lambda: kernel.launch((1, 1, 1), (256, 1, 1), current_stream(0), args)
        ),
        "op call, outputs given": per_call(lambda: concat_mla_kv_quant_fp8(kv, pe, key, value)),
        "op call, outputs allocated": per_call(lambda: concat_mla_kv_quant_fp8(kv, pe)),
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for heads in (12, 16):  # the two specialized variants (12 unrolled, runtime heads)
            rows.append(
                (
                    f"cold first call, heads={heads} (NVRTC compile + load)",
                    first_call_ms(cache, heads),
                    "ms",
                )
            )
            rows.append(
                (
                    f"warm first call, heads={heads} (disk cache + load)",
                    first_call_ms(cache, heads),
                    "ms",
                )
            )
        import json

        for meta in Path(cache).rglob("*.json"):
            record = json.loads(meta.read_text())
            rows.append(
                (
                    f"compile seconds {record['label']} {record['arch']}",
                    record["compile_seconds"],
                    "s",
                )
            )
    for name, value in hot_overhead_us().items():
        rows.append((f"host time per call: {name}", value, "us"))
    width = max(len(r[0]) for r in rows)
    print("\nengine measurements")
    for name, value, unit in rows:
        print(f"{name.ljust(width)}  {value:9.3f} {unit}")


if __name__ == "__main__":
    main()
