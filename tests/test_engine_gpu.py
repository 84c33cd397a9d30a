"""The engine end to end on a GPU, through the first real kernel (the concat pack)."""

from __future__ import annotations

import pytest
import torch

from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8

from .test_mla_kv_pack import codes, ref_pack
from .test_mla_kv_pack_gpu import POISON, poisoned

pytestmark = pytest.mark.gpu


def _inputs(tokens: int, heads: int, device: str = "cuda"):
    kv = torch.randn(tokens, heads, 256, device=device).mul_(200).to(torch.bfloat16)
    pe = torch.randn(tokens, 64, device=device).mul_(200).to(torch.bfloat16)
    # Adversarial values in every call: saturation, rounding ties, NaN/inf, denormals.
    special = torch.tensor(
        [
            0.0,
            -0.0,
            448,
            -448,
            449,
            464,
            -465,
            1e30,
            float("inf"),
            -float("inf"),
            float("nan"),
            2.0**-9,
            2.0**-10,
            1.5 * 2.0**-9,
        ],
        device=device,
    ).to(torch.bfloat16)
    kv.view(-1)[: special.numel()] = special
    pe.view(-1)[: special.numel()] = special
    return kv, pe


def _check(kv, pe, key, value) -> None:
    """key and value bit-exact with the independent e4m3 encoder (tests/test_mla_kv_pack.py)."""
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key), "key differs from the reference"
    assert torch.equal(codes(value), want_value), "value differs from the reference"


@pytest.mark.parametrize("tokens,heads", [(1, 1), (33, 12), (300, 16), (64, 128), (4097, 5)])
def test_specialized_matches_reference_bit_exact(tokens, heads, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")  # a fallback would make this vacuous
    kv, pe = _inputs(tokens, heads)
    key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend="specialized")
    _check(kv, pe, key, value)


def test_cuda_graph_replay_sees_new_inputs(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    kv, pe = _inputs(40, 16)
    key, value = concat_mla_kv_quant_fp8(
        kv, pe, backend="specialized"
    )  # warm: load outside capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            concat_mla_kv_quant_fp8(kv, pe, key, value, backend="specialized")
    fresh_kv, fresh_pe = _inputs(40, 16)
    kv.copy_(fresh_kv)
    pe.copy_(fresh_pe)
    key.view(torch.uint8).fill_(POISON)  # what the replay leaves unwritten stays poisoned
    value.view(torch.uint8).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    _check(kv, pe, key, value)


def test_runs_on_a_side_stream(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    kv, pe = _inputs(500, 12)
    key, value = poisoned(500, 12, 192), poisoned(500, 12, 128)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs and the poison first
    with torch.cuda.stream(stream):
        concat_mla_kv_quant_fp8(kv, pe, key, value)
    torch.cuda.current_stream().wait_stream(stream)
    _check(kv, pe, key, value)


# A new process, so the kernel's first use (a compile or a cache read, its load, its launch)
# falls inside the capture, as when an engine captures a batch size it never ran eagerly.
FIRST_USE_IN_CAPTURE = """
import torch
from flashinfer_jit.mla_kv_pack import concat_mla_kv_quant_fp8
from tests.test_engine_gpu import _check, _inputs
from tests.test_mla_kv_pack_gpu import poisoned
kv, pe = _inputs(48, 7)
key, value = poisoned(48, 7, 192), poisoned(48, 7, 128)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # torch's default: a global-mode capture
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend="specialized")
graph.replay()
torch.cuda.synchronize()
_check(kv, pe, key, value)
print("served in the capture")
"""


def test_a_kernels_first_use_inside_a_graph_capture():
    """The driver refuses a module load during a global-mode capture unless the loading
    thread relaxes its capture mode (jit_kernels/_launcher_driver.h): strict, so a refusal
    would raise instead of falling back."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, FLASHINFER_JIT_STRICT="1")
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", FIRST_USE_IN_CAPTURE], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "served in the capture" in run.stdout, run.stderr[-3000:]


def test_arch_limits_table_matches_the_device():
    """Launch configs are sized from jit_kernels.arch's table (prebuild has no device): the
    device must report the same opt-in shared memory per block."""
    from jit_kernels import device_arch, device_smem_per_block, smem_per_block

    for device in range(torch.cuda.device_count()):
        assert smem_per_block(device_arch(device)) == device_smem_per_block(device)
