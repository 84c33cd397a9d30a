"""concat_mla_kv_quant_fp8 on the GPU: each fused backend forced, bit-exact with the
composable torch path and the independent e4m3 reference (tests/test_mla_kv_pack.py).

Strict mode (FLASHINFER_JIT_STRICT=1) is on unless a test says otherwise, so a forced
backend that silently fell back to torch would fail. On a machine without CuTe DSL the
cake programs must come from a prebuilt bundle named by FLASHINFER_JIT_CUBIN_PATH.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashinfer_jit import mla_kv_pack as mkp
from flashinfer_jit.mla_kv_pack import MlaKvPackOptions, cake, concat_mla_kv_quant_fp8
from flashinfer_jit.mla_kv_pack.op import BACKENDS, Plan
from flashinfer_jit.mla_kv_pack.reference import pack_torch
from jit_kernels import FallbackError

from .test_mla_kv_pack import codes, make_inputs, ref_pack

pytestmark = pytest.mark.gpu

HEADS = [1, 2, 3, 12, 16, 17, 64, 127, 128]
TOKENS = [1, 2, 31, 32, 33, 257]
POISON = 0x5A


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", raising=False)


def poisoned(tokens: int, heads: int, width: int) -> torch.Tensor:
    return torch.full((tokens, heads, width), POISON, dtype=torch.uint8, device="cuda").view(
        torch.float8_e4m3fn
    )


def torch_path(kv, pe):
    key, value = poisoned(*kv.shape[:2], 192), poisoned(*kv.shape[:2], 128)
    pack_torch(kv, pe.reshape(kv.shape[0], -1), key, value, 128)
    return key, value


def forced(kv, pe, key, value, backend: str, **plan) -> None:
    """One call of ``backend`` with a forced plan (MlaKvPackOptions)."""
    runner = mkp.OP.runner(MlaKvPackOptions(**plan))
    runner.call(kv_nope=kv, k_pe=pe, key=key, value=value, nope_dim=128, backend=backend)


def check(kv, pe, key, value):
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key), "key differs from the reference"
    assert torch.equal(codes(value), want_value), "value differs from the reference"
    t_key, t_value = torch_path(kv, pe)
    assert torch.equal(codes(key), codes(t_key)) and torch.equal(codes(value), codes(t_value))


@pytest.mark.parametrize("backend", ["specialized", "cake", "auto"])
@pytest.mark.parametrize("heads", HEADS)
def test_fused_bit_exact(backend, heads):
    for tokens in TOKENS:
        kv, pe = make_inputs(tokens, heads, device="cuda", seed=heads * 1000 + tokens)
        key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
        got = concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
        assert got[0] is key and got[1] is value
        torch.cuda.synchronize()
        check(kv, pe, key, value)


@pytest.mark.parametrize("heads", [1, 5, 12, 16, 128])
def test_every_plan_variant(heads):
    """Every cake head group and several specialized head splits give the same bytes."""
    for tokens in (1, 33, 700):
        kv, pe = make_inputs(tokens, heads, device="cuda", seed=tokens + heads)
        for group in cake.HEAD_GROUPS:
            key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
            forced(kv, pe, key, value, "cake", head_group=group)
            torch.cuda.synchronize()
            check(kv, pe, key, value)
        for per_warp in sorted({1, 3, 4, 8, heads}):
            key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
            forced(kv, pe, key, value, "specialized", heads_per_warp=per_warp)
            torch.cuda.synchronize()
            check(kv, pe, key, value)


@pytest.mark.parametrize("backend", ["specialized", "cake"])
@pytest.mark.parametrize("layout", ["latent_slice", "three_d"])
def test_strided_k_pe(backend, layout):
    tokens, heads = 77, 16
    kv, pe = make_inputs(tokens, heads, device="cuda", seed=5)
    latent = torch.randn(tokens, 576, device="cuda").to(torch.bfloat16)
    latent[:, 512:] = pe
    arg = latent[:, 512:] if layout == "latent_slice" else latent[:, None, 512:]
    key, value = concat_mla_kv_quant_fp8(kv, arg, backend=backend)
    torch.cuda.synchronize()
    check(kv, pe, key, value)


def test_misaligned_and_odd_inputs_take_a_path_that_can_serve(monkeypatch):
    tokens, heads = 40, 12
    kv, pe = make_inputs(tokens, heads, device="cuda", seed=9)
    # 16-byte aligned but not 32: cake refuses, auto serves with the specialized kernel.
    store16 = torch.empty(tokens * heads * 256 + 8, dtype=torch.bfloat16, device="cuda")
    kv16 = store16[8:].view(tokens, heads, 256)
    kv16.copy_(kv)
    assert cake.refusal(kv16, pe, *torch_path(kv, pe)) is not None
    key, value = concat_mla_kv_quant_fp8(kv16, pe, backend="auto")
    torch.cuda.synchronize()
    check(kv, pe, key, value)
    # 2-byte aligned: no fused backend can serve; strict mode says so, else torch serves.
    store2 = torch.empty(tokens * heads * 256 + 1, dtype=torch.bfloat16, device="cuda")
    kv2 = store2[1:].view(tokens, heads, 256)
    kv2.copy_(kv)
    for backend in ("auto", "specialized", "cake"):
        with pytest.raises(FallbackError):
            concat_mla_kv_quant_fp8(kv2, pe, backend=backend)
    monkeypatch.delenv("FLASHINFER_JIT_STRICT")
    for backend in ("auto", "specialized", "cake"):
        key, value = concat_mla_kv_quant_fp8(kv2, pe, backend=backend)
        torch.cuda.synchronize()
        check(kv, pe, key, value)
    # Non-contiguous kv_nope, fp16, a k_pe stride the kernels cannot take.
    wide = torch.empty(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    wide[..., :256] = kv
    key, value = concat_mla_kv_quant_fp8(wide[..., :256], pe)
    check(kv, pe, key, value)
    odd = torch.empty(tokens, 70, dtype=torch.bfloat16, device="cuda")
    odd[:, :64] = pe
    key, value = concat_mla_kv_quant_fp8(kv, odd[:, :64], backend="cake")
    check(kv, pe, key, value)
    half_kv, half_pe = kv.half(), pe.half()  # the encoder (ref_pack) and the torch path
    check(half_kv, half_pe, *concat_mla_kv_quant_fp8(half_kv, half_pe))


def test_zero_tokens_and_device_errors():
    kv, pe = make_inputs(0, 16, device="cuda")
    key, value = concat_mla_kv_quant_fp8(kv, pe)
    assert key.shape == (0, 16, 192) and value.shape == (0, 16, 128) and key.is_cuda
    kv, pe = make_inputs(4, 16, device="cuda")
    with pytest.raises(ValueError, match="k_pe"):
        concat_mla_kv_quant_fp8(kv, pe.cpu())
    with pytest.raises(ValueError, match="key"):
        concat_mla_kv_quant_fp8(kv, pe, key=torch.empty(4, 16, 192, dtype=torch.float8_e4m3fn))


def test_env_switch_forces_torch_path(monkeypatch):
    def boom(*_, **__):
        raise AssertionError("a fused backend ran with the env switch set")

    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    for name, (refusal, _) in BACKENDS.items():
        monkeypatch.setitem(BACKENDS, name, (refusal, boom))
    kv, pe = make_inputs(64, 16, device="cuda")
    for backend in ("auto", "specialized", "cake"):
        key, value = concat_mla_kv_quant_fp8(kv, pe, backend=backend)
        check(kv, pe, key, value)


@pytest.mark.parametrize("backend", ["specialized", "cake"])
def test_large_offsets(backend):
    """Row offsets past 2**31 elements (and 4 GiB of kv_nope) into poisoned outputs: the last
    tokens against the reference, every other code zero (+0.0's), checked on the device."""
    tokens, heads = 66000, 128
    kv = torch.zeros(tokens, heads, 256, dtype=torch.bfloat16, device="cuda")
    pe = torch.zeros(tokens, 64, dtype=torch.bfloat16, device="cuda")
    tail_kv, tail_pe = make_inputs(3, heads, device="cuda", seed=3)
    kv[-3:], pe[-3:] = tail_kv, tail_pe
    key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
    torch.cuda.synchronize()
    want_key, want_value = ref_pack(tail_kv, tail_pe)
    assert torch.equal(codes(key[-3:]), want_key) and torch.equal(codes(value[-3:]), want_value)
    for name, out in (("key", key), ("value", value)):
        nonzero = torch.count_nonzero(out[:-3].view(torch.uint8)).item()  # one int to the host
        assert nonzero == 0, f"{name}: {nonzero} codes of the zero tokens are not 0x00"


@pytest.mark.parametrize("backend", ["specialized", "cake", "auto"])
def test_fast_path_replays_the_plan(backend, monkeypatch):
    """A repeated call replays the cached plan with new addresses; a misaligned one, or
    one with the env switch set, still takes the path that can serve it."""
    tokens, heads = 33, 16
    replays = mkp.OP.default.replays
    replays.clear()
    for seed in (1, 2):
        kv, pe = make_inputs(tokens, heads, device="cuda", seed=seed)
        key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
        concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
        torch.cuda.synchronize()
        check(kv, pe, key, value)
    assert len(replays) == 1
    # Same shapes and strides, 16-byte but not 32-byte aligned kv_nope: cake's plan
    # refuses the addresses; the full path serves (auto/specialized) or strict mode says so.
    store = torch.empty(tokens * heads * 256 + 8, dtype=torch.bfloat16, device="cuda")
    kv16 = store[8:].view(tokens, heads, 256)
    kv16.copy_(kv)
    key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
    if backend == "cake":
        with pytest.raises(FallbackError):
            concat_mla_kv_quant_fp8(kv16, pe, key, value, backend=backend)
    else:
        concat_mla_kv_quant_fp8(kv16, pe, key, value, backend=backend)
        torch.cuda.synchronize()
        check(kv, pe, key, value)
    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    monkeypatch.setattr(
        Plan, "run", lambda *_: pytest.fail("the fast path ran with the env switch set")
    )
    key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
    check(kv, pe, key, value)


@pytest.mark.parametrize("backend", ["specialized", "cake", "auto"])
def test_cuda_graph_capture(backend):
    tokens, heads = 48, 16
    kv, pe = make_inputs(tokens, heads, device="cuda", seed=1)
    key, value = poisoned(tokens, heads, 192), poisoned(tokens, heads, 128)
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)  # load before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        concat_mla_kv_quant_fp8(kv, pe, key, value, backend=backend)
    new_kv, new_pe = make_inputs(tokens, heads, device="cuda", seed=2)
    kv.copy_(new_kv)
    pe.copy_(new_pe)
    key.view(torch.uint8).fill_(POISON)
    value.view(torch.uint8).fill_(POISON)
    graph.replay()
    torch.cuda.synchronize()
    check(new_kv, new_pe, key, value)


def test_torch_compile_graph():
    kv, pe = make_inputs(32, 16, device="cuda", seed=4)

    @torch.compile(fullgraph=True)
    def step(kv, pe):
        key, value = concat_mla_kv_quant_fp8(kv, pe)
        return key, value

    key, value = step(kv, pe)
    torch.cuda.synchronize()
    check(kv, pe, key, value)


def test_cake_runs_from_prebuilt_cubins_without_the_dsl():
    """On the GPU host (no CuTe DSL) the cake programs come from the carried bundle."""
    try:
        import cutlass  # noqa: F401

        pytest.skip("CuTe DSL installed here: cake may compile in process")
    except ImportError:
        pass
    from flashinfer_jit._jit import BUILDER
    from jit_kernels import device_arch

    roots = BUILDER.cache.prebuilt
    assert roots, "FLASHINFER_JIT_CUBIN_PATH names no bundle"
    arch = device_arch(torch.cuda.current_device())
    for group in cake.HEAD_GROUPS:
        spec = cake.family.spec((group,))
        key = BUILDER.cache_key(spec, arch)
        found = [
            r
            for r in roots
            if BUILDER.cache._load_from(r, BUILDER.cache._relative(arch, spec.family, key))
        ]
        assert found, f"{spec.label} for {arch} is not in {roots}"
        print(f"{spec.label} {arch}: prebuilt in {found[0]} (key {key[:12]})")
    kv, pe = make_inputs(16, 16, device="cuda")
    key, value = concat_mla_kv_quant_fp8(kv, pe, backend="cake")
    check(kv, pe, key, value)
    assert os.environ.get("FLASHINFER_JIT_CUBIN_PATH")
