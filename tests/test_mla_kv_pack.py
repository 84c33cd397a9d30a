"""concat_mla_kv_quant_fp8: bit-exact against an e4m3 encoder written from the format.

The reference never uses torch's fp8 cast: ``encode_e4m3`` follows the OCP e4m3 ("fn")
definition (bias 7, 3 mantissa bits, no infinities, 0x7F/0xFF NaN, max 448) with the
op's saturating rule, and ``BF16_LUT`` applies it to all 65536 bf16 bit patterns.
CPU tests cover the composable path; ``gpu`` tests force each fused backend.
"""

# size: the independent e4m3 reference, its exhaustive bf16 table and every CPU rule of the op in one place

from __future__ import annotations

import math

import pytest
import torch

from flashinfer_jit import mla_kv_pack as mkp
from flashinfer_jit.mla_kv_pack import cake, concat_mla_kv_quant_fp8, heuristics

MIN_NORMAL = 2.0**-6
SUBNORMAL_STEP = 2.0**-9


# -- the independent reference ---------------------------------------------------------
def encode_e4m3(x: float) -> int:
    """The saturating e4m3 code of ``x``: round to nearest even at e4m3 precision, then
    clamp the magnitude to 448 (finite overflow and inf); NaN is 0x7F; sign kept."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    if math.isinf(a) or a >= 448.0:
        return sign | 0x7E
    # The spacing of e4m3 values around `a`: fixed below the smallest normal.
    step = SUBNORMAL_STEP if a < MIN_NORMAL else 2.0 ** (math.floor(math.log2(a)) - 3)
    q = round(a / step) * step  # Python's round() is half-to-even and exact here
    if q > 448.0:
        q = 448.0
    if q < MIN_NORMAL:
        return sign | int(q / SUBNORMAL_STEP)  # 0..8; 8 is the smallest normal's code
    exp = math.floor(math.log2(q))
    mantissa = int(q / 2.0**exp * 8) - 8
    return sign | ((exp + 7) << 3) | mantissa


def _bf16_lut() -> torch.Tensor:
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.bfloat16).float().tolist()
    return torch.tensor([encode_e4m3(v) for v in values], dtype=torch.uint8)


BF16_LUT = _bf16_lut()


def ref_codes(x: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) of a tensor, same shape, on CPU: bf16 through the table, other
    dtypes value by value through the encoder."""
    if x.dtype != torch.bfloat16:
        values = x.detach().cpu().double().flatten().tolist()
        return torch.tensor([encode_e4m3(v) for v in values], dtype=torch.uint8).view(x.shape)
    bits = x.detach().cpu().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    return BF16_LUT[bits]


def ref_pack(
    kv_nope: torch.Tensor, k_pe: torch.Tensor, nope: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """(key codes, value codes) as uint8 on CPU, from the table and explicit layout."""
    t, h, _ = kv_nope.shape
    k_pe = k_pe.reshape(t, k_pe.shape[-1])
    codes = ref_codes(kv_nope)
    pe = ref_codes(k_pe)
    key = torch.empty(t, h, nope + pe.shape[1], dtype=torch.uint8)
    key[:, :, :nope] = codes[:, :, :nope]
    key[:, :, nope:] = pe[:, None, :]
    return key, codes[:, :, nope:].clone()


def codes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.uint8).cpu()


ADVERSARIAL = [
    0.0,
    -0.0,
    2.0**-9,
    -(2.0**-9),
    2.0**-10,
    3 * 2.0**-10,
    2.0**-7,
    0.0078125,
    1e-40,
    448.0,
    449.0,
    464.0,
    465.0,
    -464.0,
    480.0,
    1e30,
    -1e30,
    math.inf,
    -math.inf,
    math.nan,
    -math.nan,
    1.0,
    -1.0,
    0.1,
    240.0,
    17.5,
    2.0**-6,
    -(2.0**-6),
]


def make_inputs(
    tokens: int, heads: int, device="cpu", dtype=torch.bfloat16, seed=0, adversarial=True
):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(tokens, heads, 256, generator=g) * 64).to(dtype)
    pe = (torch.randn(tokens, 64, generator=g) * 64).to(dtype)
    if adversarial and tokens:
        special = torch.tensor(ADVERSARIAL, dtype=torch.float32).to(dtype)
        flat = kv.view(-1)
        where = torch.randint(
            0, flat.numel(), (min(flat.numel(), 4 * len(ADVERSARIAL)),), generator=g
        )
        flat[where] = special.repeat(4)[: where.numel()]
        pe.view(-1)[: min(pe.numel(), len(ADVERSARIAL))] = special[: pe.numel()]
    return kv.to(device), pe.to(device)


# -- the reference itself --------------------------------------------------------------
@pytest.mark.parametrize(
    "value, code",
    [
        (0.0, 0x00),
        (-0.0, 0x80),
        (1.0, 0x38),
        (-2.0, 0xC0),
        (448.0, 0x7E),
        (-448.0, 0xFE),
        (449.0, 0x7E),
        (464.0, 0x7E),
        (465.0, 0x7E),
        (1e30, 0x7E),
        (math.inf, 0x7E),
        (-math.inf, 0xFE),
        (math.nan, 0x7F),
        (2.0**-9, 0x01),
        (2.0**-10, 0x00),
        (3 * 2.0**-10, 0x02),
        (2.0**-6, 0x08),
        (0.9375, 0x37),
        (0.96875, 0x38),
        (1.0625, 0x38),
        (1.1875, 0x3A),
        (-1e-30, 0x80),
        (240.0, 0x77),
    ],
)
def test_reference_encoder(value, code):
    assert encode_e4m3(value) == code


def test_reference_decodes_back():
    # Every finite code decodes to a value the encoder maps back to the same code.
    for c in range(256):
        if c & 0x7F == 0x7F:
            continue
        e, m = (c >> 3) & 0xF, c & 7
        v = (m * SUBNORMAL_STEP) if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        v = -v if c & 0x80 else v
        assert encode_e4m3(v) == c, hex(c)


# -- the composable path (CPU) ---------------------------------------------------------
def test_saturating_cast_every_bf16_pattern():
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    got = mkp.saturating_e4m3(bits.view(torch.bfloat16)).view(torch.uint8)
    assert torch.equal(got, BF16_LUT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_saturating_cast_other_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat(
        [
            torch.tensor(ADVERSARIAL),
            torch.randn(4000, generator=g) * 100,
            torch.rand(1000, generator=g) * 0.02,
        ]
    ).to(dtype)
    want = torch.tensor([encode_e4m3(v) for v in x.double().tolist()], dtype=torch.uint8)
    assert torch.equal(mkp.saturating_e4m3(x).view(torch.uint8), want)


def test_every_head_count_on_torch_path():
    for heads in range(1, 129):
        kv, pe = make_inputs(3, heads, seed=heads)
        key, value = concat_mla_kv_quant_fp8(kv, pe)
        want_key, want_value = ref_pack(kv, pe)
        assert key.shape == (3, heads, 192) and value.shape == (3, heads, 128)
        assert key.dtype == value.dtype == torch.float8_e4m3fn
        assert torch.equal(codes(key), want_key), heads
        assert torch.equal(codes(value), want_value), heads


@pytest.mark.parametrize("tokens", [0, 1, 2, 31, 32, 33, 2048])
def test_token_counts(tokens):
    kv, pe = make_inputs(tokens, 5, seed=tokens)
    key, value = concat_mla_kv_quant_fp8(kv, pe)
    assert key.shape == (tokens, 5, 192) and value.shape == (tokens, 5, 128)
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key) and torch.equal(codes(value), want_value)


def test_other_geometry_and_dtype_on_torch_path():
    kv = (torch.randn(4, 3, 96) * 10).to(torch.float16)
    pe = (torch.randn(4, 1, 32) * 10).to(torch.float16)
    key, value = concat_mla_kv_quant_fp8(kv, pe, nope_dim=40)
    assert key.shape == (4, 3, 72) and value.shape == (4, 3, 56)
    enc = [[[encode_e4m3(v) for v in row] for row in tok] for tok in kv.double().tolist()]
    enc = torch.tensor(enc, dtype=torch.uint8)
    pe_enc = torch.tensor(
        [[encode_e4m3(v) for v in r] for r in pe[:, 0].double().tolist()], dtype=torch.uint8
    )
    assert torch.equal(codes(key)[..., :40], enc[..., :40])
    assert torch.equal(codes(key)[..., 40:], pe_enc[:, None, :].expand(4, 3, 32))
    assert torch.equal(codes(value), enc[..., 40:])


def test_provided_outputs_written_in_place():
    kv, pe = make_inputs(7, 4)
    key = torch.full((7, 4, 192), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    value = torch.full((7, 4, 128), 0x5A, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got_key, got_value = concat_mla_kv_quant_fp8(kv, pe, key, value)
    assert got_key is key and got_value is value
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key) and torch.equal(codes(value), want_value)


def test_provided_outputs_may_be_views():
    kv, pe = make_inputs(5, 2)
    big = torch.zeros(5, 2, 400, dtype=torch.float8_e4m3fn)
    key, value = big[..., :192], big[..., 200:328]
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key) and torch.equal(codes(value), want_value)
    assert not codes(big)[..., 192:200].any() and not codes(big)[..., 328:].any()


@pytest.mark.parametrize("layout", ["latent_slice", "three_d", "three_d_slice"])
def test_k_pe_layouts(layout):
    kv, pe = make_inputs(9, 3)
    latent = torch.randn(9, 576).to(torch.bfloat16)
    latent[:, 512:] = pe
    arg = {
        "latent_slice": latent[:, 512:],
        "three_d": pe[:, None, :],
        "three_d_slice": latent[:, None, 512:],
    }[layout]
    key, value = concat_mla_kv_quant_fp8(kv, arg)
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key) and torch.equal(codes(value), want_value)


@pytest.mark.parametrize("backend", ["auto", "specialized", "cake"])
def test_each_backend_name_on_cpu_takes_torch_path(backend):
    kv, pe = make_inputs(6, 12)
    key, value = concat_mla_kv_quant_fp8(kv, pe, backend=backend)
    want_key, want_value = ref_pack(kv, pe)
    assert torch.equal(codes(key), want_key) and torch.equal(codes(value), want_value)


def test_env_switch_skips_fused_backends(monkeypatch):
    def boom(*_):
        raise AssertionError("a fused backend ran with the env switch set")

    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    monkeypatch.setattr(mkp.OP, "plan", boom)
    kv, pe = make_inputs(4, 2)
    key, value = concat_mla_kv_quant_fp8(kv, pe)
    assert torch.equal(codes(key), ref_pack(kv, pe)[0])


def test_fast_path_dispatch(monkeypatch, fresh_replays):
    """The fast path replays a cached plan only for the exact signature it was cached
    under, never with the env switch set, and leaves misaligned addresses to the full
    path. (CPU tensors never cache a plan; the test plants one.)"""
    kv, pe = make_inputs(4, 2)
    key, value = (
        torch.empty(4, 2, 192, dtype=torch.float8_e4m3fn),
        torch.empty(4, 2, 128, dtype=torch.float8_e4m3fn),
    )
    launched = []

    class FakePlan:
        def __init__(self, ok):
            self.ok = ok

        def run(self, *args):
            launched.append(tuple(t.data_ptr() for t in args[:4]))
            return (args[2], args[3]) if self.ok else None

    runner = mkp.OP.default
    runner.replays.clear()
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    assert len(runner.replays) == 0  # the torch path caches nothing
    sig = runner.key(*runner.inputs((kv, pe, key, value, 128, "auto")))
    runner.replays.put(sig, FakePlan(True))
    key.view(torch.uint8).zero_()
    assert concat_mla_kv_quant_fp8(kv, pe, key, value) == (key, value)
    assert launched == [(kv.data_ptr(), pe.data_ptr(), key.data_ptr(), value.data_ptr())]
    assert not codes(key).any()  # the (fake) plan served the call
    concat_mla_kv_quant_fp8(kv, pe, key, value, backend="cake")  # another signature
    assert len(launched) == 1 and torch.equal(codes(key), ref_pack(kv, pe)[0])
    monkeypatch.setenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE", "1")
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    assert len(launched) == 1
    monkeypatch.delenv("FLASHINFER_SPECIALIZED_KERNEL_DISABLE")
    runner.replays.put(sig, FakePlan(False))  # misaligned: the full path serves
    key.view(torch.uint8).zero_()
    concat_mla_kv_quant_fp8(kv, pe, key, value)
    assert len(launched) == 2 and torch.equal(codes(key), ref_pack(kv, pe)[0])


BAD = [
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe, backend="fast"), ValueError, "backend"),
    (lambda kv, pe: dict(kv_nope=kv[0], k_pe=pe), ValueError, "kv_nope"),
    (lambda kv, pe: dict(kv_nope=kv.to(torch.int32), k_pe=pe), TypeError, "kv_nope"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe, nope_dim=256), ValueError, "nope_dim"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe, nope_dim=0), ValueError, "nope_dim"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe[:3]), ValueError, "k_pe"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe.float()), TypeError, "k_pe"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe[:, None].expand(4, 2, 64)), ValueError, "k_pe"),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe[None]), ValueError, "k_pe"),
    (
        lambda kv, pe: dict(
            kv_nope=kv, k_pe=pe, key=torch.empty(4, 2, 191, dtype=torch.float8_e4m3fn)
        ),
        ValueError,
        "key",
    ),
    (
        lambda kv, pe: dict(kv_nope=kv, k_pe=pe, key=torch.empty(4, 2, 192, dtype=torch.uint8)),
        TypeError,
        "key",
    ),
    (
        lambda kv, pe: dict(
            kv_nope=kv, k_pe=pe, value=torch.empty(4, 3, 128, dtype=torch.float8_e4m3fn)
        ),
        ValueError,
        "value",
    ),
    (
        lambda kv, pe: dict(
            kv_nope=kv, k_pe=pe, value=torch.empty(4, 2, 128, dtype=torch.bfloat16)
        ),
        TypeError,
        "value",
    ),
    (lambda kv, pe: dict(kv_nope=kv, k_pe=pe, value="out"), ValueError, "value"),
]


@pytest.mark.parametrize("make, exc, name", BAD)
def test_bad_arguments(make, exc, name):
    kv, pe = make_inputs(4, 2)
    with pytest.raises(exc, match=name):
        concat_mla_kv_quant_fp8(**make(kv, pe))


# -- torch.compile, custom op ------------------------------------------------------------
def test_custom_op_fake_and_compile():
    kv, pe = make_inputs(8, 3)
    key = torch.empty(8, 3, 192, dtype=torch.float8_e4m3fn)
    value = torch.empty(8, 3, 128, dtype=torch.float8_e4m3fn)
    torch.library.opcheck(
        mkp.OP.traced, (kv, pe, key, value, 128, "auto"), test_utils=("test_faketensor",)
    )

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(kv, pe):
        key, value = concat_mla_kv_quant_fp8(kv, pe)
        return key.view(torch.uint8).float().sum() + value.view(torch.uint8).float().sum()

    want_key, want_value = ref_pack(kv, pe)
    assert step(kv, pe).item() == want_key.float().sum().item() + want_value.float().sum().item()


# -- planning, workloads, prebuilt programs -------------------------------------------------
def test_workloads_file_matches_module():
    import json

    data = json.loads(mkp.WORKLOADS.read_text())
    assert data["op"] == "mla_kv_pack"
    assert max(data["num_heads"]) <= mkp.MAX_HEADS and max(data["num_tokens"]) <= mkp.MAX_TOKENS
    assert (data["max_heads"], data["max_tokens"]) == (mkp.MAX_HEADS, mkp.MAX_TOKENS)
    specs = mkp.OP.prebuild_specs(data, mkp.OP.default.options)
    families = {s.family for s in specs}
    assert families == {"mla_kv_pack", "mla_kv_pack_cake"}
    assert {s.param_dict["head_group"] for s in specs if s.compiler == "cute"} == set(
        cake.HEAD_GROUPS
    )


def test_plan_head_group_stays_in_the_built_set():
    for heads in range(1, 129):
        pairs = (heads + 1) // 2
        for tokens in (1, 2, 7, 33, 64, 100, 1024, 4096, 16384, 131072):
            group = cake.plan_head_group(tokens, heads, 132)
            assert group in cake.HEAD_GROUPS and (group == 1 or group <= pairs)


def test_auto_order_names_both_backends():
    for heads in (1, 12, 16, 128):
        for tokens in (1, 1024, 131072):
            assert sorted(mkp.auto_order(tokens, heads)) == ["cake", "specialized"]


def test_cute_identity_without_the_dsl(monkeypatch):
    import importlib.metadata

    from jit_kernels import compile as jc

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    jc.cute_dsl_version.cache_clear()
    try:
        monkeypatch.setattr(importlib.metadata, "version", missing)
        assert jc.compiler_identity("cute") == f"cutlass-dsl {jc.CUTE_DSL_PINNED_VERSION}"
    finally:
        monkeypatch.undo()
        jc.cute_dsl_version.cache_clear()
    # With the DSL installed, its version is the pinned one: both machines agree.
    pytest.importorskip("cutlass")
    assert jc.cute_dsl_version() == jc.CUTE_DSL_PINNED_VERSION


def test_cake_generator_builds():
    """The generator's constants are the backend's; its parameter list is checked against
    the declaration with every family's (test_kernel_signatures)."""
    pytest.importorskip("cutlass")
    import importlib.util

    from flashinfer_jit._jit import TEMPLATE_ROOT

    spec = importlib.util.spec_from_file_location(
        "_cake_gen", TEMPLATE_ROOT / "mla_kv_pack/sm90_cute_dsl.py"
    )
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.HEAD_GROUPS == cake.HEAD_GROUPS and gen.WARPS_PER_BLOCK == cake.WARPS_PER_BLOCK
    cubin, entry = gen.build({"head_group": 2}, "sm_90a")
    assert cubin[:4] == b"\x7fELF" and entry.startswith("kernel_cutlass_")
    with pytest.raises(ValueError, match="head_group"):
        gen.build({"head_group": 3}, "sm_90a")


# -- measured choices -------------------------------------------------------------------
def test_tuned_table_nearest_point_and_validation():
    from flashinfer_jit.mla_kv_pack.tuning import Tuned, block_from_measurements

    def variant(backend, param, us):
        return {"backend": backend, "param": param, "planned": False, "us": us}

    rows = [
        {
            "tokens": t,
            "heads": h,
            "variants": {
                "a": variant("specialized", 4, 10.0 if h == 12 else 12.0),
                "b": variant("specialized", 8, 11.0),
                "c": variant("cake", 2, 11.5 if t < 1000 else 9.0),
                "d": variant("cake", 8, 13.0),
            },
        }
        for h in (1, 12, 128)
        for t in (1, 1024, 16384)
        if (h, t) != (128, 16384)
    ]
    block = block_from_measurements(rows, "test")
    assert block["auto"][1] == ["specialized", "cake", "cake"]
    assert block["auto"][2][2] == "cake"  # the unmeasured point copies its nearest
    assert block["cake_head_group"][0] == [2, 2, 2]
    assert block["specialized_heads_per_warp"][:2] == [[8, 8, 8], [4, 4, 4]]
    tuned = Tuned(block, cake.HEAD_GROUPS)
    assert tuned.get("auto", 1, 12) == "specialized"
    assert tuned.get("auto", 30, 11) == "specialized"  # nearest in log scale: (1, 12)
    assert tuned.get("auto", 40, 11) == "cake"  # nearer to 1024 tokens
    assert tuned.get("auto", 10**6, 1000) == "cake"
    assert Tuned(None, cake.HEAD_GROUPS).get("auto", 1, 1) is None
    bad = dict(block, cake_head_group=[[3, 2, 2]] * 3)
    with pytest.raises(ValueError, match="cake_head_group"):
        Tuned(bad, cake.HEAD_GROUPS)
    with pytest.raises(ValueError, match="auto"):
        Tuned(dict(block, auto=[["fast"] * 3] * 3), cake.HEAD_GROUPS)


def test_plans_follow_the_tuned_table(monkeypatch):
    from flashinfer_jit.mla_kv_pack.tuning import Tuned

    block = {
        "heads": [16],
        "tokens": [1, 4096],
        "auto": [["specialized", "cake"]],
        "cake_head_group": [[1, 4]],
        "specialized_heads_per_warp": [[2, 16]],
    }
    monkeypatch.setattr(heuristics, "TUNED", Tuned(block, cake.HEAD_GROUPS))
    assert (mkp.plan_cake(1, 16, 132), mkp.plan_cake(8000, 20, 132)) == (1, 4)
    assert (mkp.plan_specialized(2, 16), mkp.plan_specialized(9000, 8)) == (2, 8)
    monkeypatch.setattr(heuristics, "TUNED", Tuned(None, cake.HEAD_GROUPS))
    assert mkp.plan_cake(1, 16, 132) == cake.plan_head_group(1, 16, 132)


def test_auto_policy_per_arch():
    # sm_90: the entry of the largest head count at most the call's decides.
    table = ((1, None), (2, 64), (16, 8))
    first = lambda t, h: heuristics.specialized_first(table, t, h)  # noqa: E731
    assert all(first(t, 1) for t in (1, 16384, 131072))
    assert first(64, 2) and first(64, 15) and not first(65, 2) and not first(65, 15)
    assert first(8, 16) and first(8, 128) and not first(9, 16)
    assert not heuristics.specialized_first((), 1, 1)  # no entry: cake everywhere
    # The shipped table: one head always specialized, large calls cake.
    for tokens in (1, 1024, 16384, 131072):
        assert mkp.auto_order(tokens, 1, (9, 0)) == ("specialized", "cake")
    assert mkp.auto_order(16, 128, (9, 0))[0] == mkp.auto_order(1, 16, (9, 0))[0] == "specialized"
    for heads in (2, 12, 16, 128):
        assert mkp.auto_order(16384, heads, (9, 0))[0] == "cake"
    # sm_100/sm_103: the seed's rule (specialized for 12 local heads), whatever sm_90's is.
    for cap in ((10, 0), (10, 3)):
        assert mkp.auto_order(1, 12, cap) == ("specialized", "cake")
        assert mkp.auto_order(131072, 1, cap)[0] == mkp.auto_order(16, 16, cap)[0] == "cake"


def _rule_tool():
    """tools/mla_kv_pack_rule.py (on sys.path there, as the tools run)."""
    import sys
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    import mla_kv_pack_rule

    return mla_kv_pack_rule


def test_sm90_rule_agrees_with_the_measured_points():
    """The committed serving-measure points (tools/mla_kv_pack_rule.py --write): at every
    one, auto's first backend on sm_90 is within the tolerance of the faster backend."""
    rule = _rule_tool()
    if not rule.POINTS_FILE.exists():
        pytest.skip(f"no measured points committed ({rule.POINTS_FILE.name})")
    points, header = rule.load_points(rule.POINTS_FILE)
    assert len(points) >= 50, "the sweep covers tokens 1..131072 x heads 1..128"
    first = lambda t, h: mkp.auto_order(t, h, (9, 0))[0]  # noqa: E731
    bad = rule.violations(points, first, header["tolerance"])
    assert not bad, (
        "heuristics.SM90_SPECIALIZED_MAX_TOKENS disagrees with the measurement:\n" + "\n".join(bad)
    )


def _synthetic(rule, spec_wins) -> list:
    """The sweep's grid, specialized 10 % faster where ``spec_wins`` and cake elsewhere
    (with up to 0.5 % of noise, under the tolerance)."""
    import random

    rng = random.Random(0)
    points = []
    for h in (1, 2, 4, 8, 12, 16, 32, 64, 128):
        for t in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536, 131072):
            fast, slow = 1.0 + rng.uniform(0, 0.005), 1.1
            spec, cake_us = (fast, slow) if spec_wins(t, h) else (slow, fast)
            points.append(rule.Point(t, h, spec, cake_us))
    return points


@pytest.mark.parametrize(
    "truth, expected",
    [
        (lambda t, h: h == 1 or t <= 32, ((1, None), (2, 32))),
        (lambda t, h: t * h <= 2048, ((1, 1024), (4, 512), (8, 256), (12, 128), (32, 64),
                                      (64, 32), (128, 16))),
        (lambda t, h: h in (1, 4) or t <= 256, ((1, None), (2, 256), (4, None), (8, 256))),
        (lambda t, h: False, ((1, 0),)),
    ],
)  # fmt: skip
def test_rule_derivation_finds_each_head_counts_threshold(truth, expected):
    rule = _rule_tool()
    points = _synthetic(rule, truth)
    derived = rule.derive(points)
    assert derived == expected
    assert rule.violations(points, lambda t, h: rule.pick(derived, t, h)) == []
    # The check can fail: the opposite rule, and a threshold one step off, are caught.
    opposite = lambda t, h: "cake" if rule.pick(derived, t, h) == "specialized" else "specialized"  # noqa: E731
    assert rule.violations(points, opposite)
    off = tuple((h, 4 * t if t else 1) for h, t in derived)  # None and 0 -> 1
    assert rule.violations(points, lambda t, h: rule.pick(off, t, h))


def test_rule_derivation_no_threshold_and_points_file(tmp_path):
    rule = _rule_tool()
    with pytest.raises(ValueError, match="at 2 heads"):  # specialized only in the middle
        rule.derive(_synthetic(rule, lambda t, h: h == 2 and 64 <= t <= 1024))
    stair = _synthetic(rule, lambda t, h: t <= 64)
    path = tmp_path / "points.json"
    rule.write_points(stair, {"device": "test"}, path)
    again, header = rule.load_points(path)
    assert header["device"] == "test" and header["tolerance"] == rule.TOLERANCE
    assert [(p.tokens, p.heads) for p in again] == [(p.tokens, p.heads) for p in stair]
