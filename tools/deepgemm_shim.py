"""Helpers of tools/run_deepgemm_test.py: which of DeepGEMM's generated cases this package
serves, and a CPU stand-in for ``torch`` that lets DeepGEMM's CUDA-only test run shrunken
cases on the torch path (a smoke test of the substitution, not of the kernels)."""

from __future__ import annotations

import types

import torch

from flashinfer_jit.mqa_logits.checks import BLOCK_SIZES, launch_config

# The fields of a case test_paged_mqa_logits generates, in its order.
FIELDS = (
    "is_varlen",
    "is_fp4",
    "logits_dtype",
    "weights_dtype",
    "block_kv",
    "use_2d_context_lens",
    "clean_logits",
    "batch_size",
    "next_n",
    "max_tokens_per_batch",
    "num_heads",
    "head_dim",
    "avg_kv",
)


def served(case: tuple) -> str | None:
    """None when flashinfer_jit.deep_gemm serves the case, else why not."""
    c = dict(zip(FIELDS, case, strict=True))
    heads, dim, n = c["num_heads"], c["head_dim"], c["next_n"] * c["num_heads"]
    reasons = [
        (c["is_varlen"], "varlen batches (indices): not served"),
        (c["is_fp4"], "FP4 q and KV: no FP4 kernel"),
        (c["weights_dtype"] != torch.float32, "bfloat16 weights: weights must be float32"),
        (c["logits_dtype"] not in (torch.float32, torch.bfloat16), "logits dtype"),
        (c["block_kv"] not in BLOCK_SIZES, f"block_kv not in {BLOCK_SIZES}"),
        (heads % 4 or dim % 32, "num_heads % 4 or head_dim % 32"),
        (n % 8 or not 8 <= n <= 256, "next_n * num_heads not a multiple of 8 in [8, 256]"),
    ]
    for bad, why in reasons:
        if bad:
            return why
    if launch_config(n, dim) is None:
        return "next_n * num_heads with head_dim does not fit one CTA"
    return None


def shrink(case: tuple, batch_size: int = 16, avg_kv: int = 1024) -> tuple:
    """The case with a CPU-sized batch and lengths (everything else as generated). Not
    smaller: DeepGEMM's check (cosine-style diff against the unquantized reference under
    1e-3) measures FP8 quantization noise, whose spread grows as the case shrinks. Cases 4
    and 19, fresh inputs each run: at 3 x 200 the diff was 0.00066-0.00073 +- 0.00012-0.00015
    (25 runs; a run of both failed 1 in 40 here, and once in CI); at 16 x 1024 0.00067-0.00071
    +- 0.00006, at most 0.0008 (15 runs), ~2.4 s a case on this machine."""
    c = dict(zip(FIELDS, case, strict=True))
    c.update(batch_size=batch_size, avg_kv=avg_kv)
    return tuple(c[f] for f in FIELDS)


def _on_cpu(fn):
    def call(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return call


class _CpuCuda:
    """torch.cuda as the test uses it: memory statistics and synchronization, no-ops."""

    def __getattr__(self, name: str):
        if name in ("max_memory_allocated", "max_memory_reserved"):
            return lambda *a, **k: 0
        return lambda *a, **k: None


def cpu_torch() -> types.ModuleType:
    """A ``torch`` whose tensor factories put device='cuda' tensors on the CPU."""
    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # PEP 562: the rest is torch's
    factories = (
        "arange",
        "empty",
        "full",
        "rand",
        "randint",
        "randn",
        "randperm",
        "tensor",
        "zeros",
    )
    for name in factories:
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    proxy.cuda = _CpuCuda()
    return proxy
