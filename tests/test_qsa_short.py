"""The short single pass's configs (flashinfer_jit/qsa/short.py; the dispatcher's rule and
the config it takes: tests/test_qsa_short_dispatch.py): their residency, its launch plan
(CPU, kernels stubbed), its kernels compiled without spills for sm_90a and sm_100a; on the GPU every config with and without the row order against the
float64 reference (hazards: -1 indices, counts 0 and past TOPK, bad requests and pages;
selections shorter than a chunk and longer than the stages; odd groups; both caches), many
rows of uneven counts, other head dims and a CUDA graph replay.
"""

from __future__ import annotations

import math
import subprocess

import pytest
import torch

from flashinfer_jit.qsa import kernels as qk
from flashinfer_jit.qsa import plan as qsa_plan
from flashinfer_jit.qsa import short as qs
from flashinfer_jit.qsa.op import run_kernels, with_options
from flashinfer_jit.qsa.plan import Variant, decode_launch

from .test_qsa import add_hazards, args_of, assert_close, make_case, ref_of
from .test_replay import FakeKernel, qsa_args, qsa_stub, stub  # noqa: F401 (fixtures)

# Rows an SM holds of each config (D = 128, bulk copies; the comments of SHORT_CONFIGS).
ROWS_PER_SM = {
    "w1s2": 16,
    "w1s3": 12,
    "w1s4": 12,
    "w1s6": 8,
    "w2s2": 8,
    "w2s3": 7,
    "w4s3": 4,
    "w4s2": 4,
}


def test_short_configs_hold_their_rows_per_sm():
    assert set(ROWS_PER_SM) == set(qs.SHORT_CONFIGS)
    for name, config in qs.SHORT_CONFIGS.items():
        assert qs.checked_short_config(config, 128, True) == config
        assert qs.short_ctas(128, config, True) == ROWS_PER_SM[name], name
        assert qs.short_smem_bytes(128, config, True) <= qk.SMEM_LIMIT
    # the single pass's shape until session 27 (it now takes 2 stages: qk.BULK_SINGLE_PASS)
    assert qs.SHORT_CONFIGS["w4s3"] == (4, 3, 4) and qk.BULK_SINGLE_PASS == (4, 2, 4)
    for bad in [(3, 4, 8), (1, 1, 8), (1, 9, 8), (1, 4, 0), (2, 2, 33), (4, 2, 17)]:
        with pytest.raises(ValueError, match="short config"):
            qs.checked_short_config(bad, 128, True)


@pytest.mark.usefixtures("qsa_stub")
@pytest.mark.parametrize("order", [True, False])
@pytest.mark.parametrize("combined", [True, False])
def test_short_launch_plan(monkeypatch, order, combined):
    """The short variant's kernel, launch shape and slot pass (with the row order or not);
    the shipped launch is untouched by the new fields' defaults."""
    monkeypatch.setattr(qsa_plan, "capability", lambda device: (9, 0))
    monkeypatch.setattr(qsa_plan, "prepare", lambda wanted, device: None)
    seen = {}
    monkeypatch.setattr(
        qk.KernelFamily, "get", lambda f, p, device: seen.setdefault(f.family, p) and FakeKernel([])
    )
    args = tuple(
        qsa_args(rows=5, hq=16, hkv=1, d=128, page=64, topk=300, combined=combined).values()
    )
    config = qs.SHORT_CONFIGS["w1s2"]
    launch = decode_launch(args, with_options(), Variant(config=config, short=True, order=order))
    assert seen["qsa_decode_short"] == (16, 128, *config, combined, False, order)
    assert seen["qsa_slots"][1] is order
    assert launch.grid == (5, 1, 1) and launch.block == (32, 1, 1)
    assert launch.smem == qs.short_smem_bytes(128, config, combined)
    assert launch.slot_pass.size == 5 * 304 + 5 * order  # slots, then the order if any
    seen.clear()
    decode_launch(args, with_options(), Variant())  # the shipped single pass, as before
    assert "qsa_decode_form" in seen and seen["qsa_slots"][1] is True
    seen.clear()
    group8 = tuple(qsa_args(rows=2, hq=16, hkv=2, d=128, page=64, topk=64, combined=True).values())
    decode_launch(group8, with_options(), Variant(short=True, order=order))
    assert seen["qsa_decode_short"] == (8, 128, *qs.SHORT_DEFAULT, True, True, order)


@pytest.mark.usefixtures("qsa_stub")
def test_short_refusals():
    args = tuple(qsa_args(rows=2, d=128, page=64, topk=64).values())
    with pytest.raises(ValueError, match="order=False applies"):
        decode_launch(args, with_options(), Variant(order=False))
    with pytest.raises(ValueError, match="one split"):
        decode_launch(args, with_options(), Variant(num_splits=2, short=True))
    with pytest.raises(ValueError, match="short config"):
        decode_launch(args, with_options(), Variant(short=True, config=(8, 4, 8)))


def test_short_bench_plans_what_it_times():
    """tools/qsa_short_bench.py (no GPU): its points are issue 22's short selections (and one
    long guard), its columns every config, its up-front compile list every kernel they reach."""
    import importlib
    import sys
    from pathlib import Path

    tools = str(Path(__file__).resolve().parents[1] / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)  # as the tools run
    bench = importlib.import_module("qsa_short_bench")
    assert {p.topk for p in bench.POINTS} == {256, 512, 2048}
    labels = list(bench.columns(None))
    assert labels[0] == "k1" and set(qs.SHORT_CONFIGS) <= set(labels)
    wanted = {(f.family, p) for f, p in bench.plans(bench.POINTS)}
    for point in bench.POINTS:
        for config in qs.SHORT_CONFIGS.values():
            f, p = qs.short_plan(point.group, 128, True, config, True, False)
            assert (f.family, p) in wanted


# (arch, group, head dim, config) compiled: every config at G = 16 (heads as rows), the
# TMMA form (G = 8), the cp.async gathers of D = 64 / 256, and sm_100a.
COMPILED = [("sm_90a", 16, 128, c) for c in qs.SHORT_CONFIGS.values()]
COMPILED += [("sm_90a", 8, 128, qs.SHORT_CONFIGS["w1s2"]), ("sm_90a", 8, 128, qs.SHORT_DEFAULT)]
COMPILED += [("sm_90a", 5, 64, qs.SHORT_DEFAULT), ("sm_90a", 5, 256, (1, 2, 4))]
COMPILED += [("sm_100a", 16, 128, qs.SHORT_DEFAULT), ("sm_100a", 8, 128, qs.SHORT_CONFIGS["w2s3"])]


def assert_compiles_without_spills(spec, arch: str, tmp_path) -> bool:
    """``spec`` compiles for ``arch`` without a message, and (where cuobjdump is installed)
    without local memory or a stack; whether spills were checked (callers skip if not)."""
    from flashinfer_jit._jit import TEMPLATE_ROOT
    from jit_kernels import compile_cubin, render
    from jit_kernels.params import cuobjdump

    kernel = compile_cubin(render(spec, TEMPLATE_ROOT), arch)
    assert kernel.messages == "", kernel.messages
    tool = cuobjdump()
    if tool is None:
        return False
    path = tmp_path / "k.cubin"
    path.write_bytes(kernel.cubin)
    usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True)
    assert "LOCAL:0" in usage.stdout and "STACK:0" in usage.stdout, (arch, spec, usage.stdout)
    return True


def skip_unless_spills_checked(checked: list[bool]) -> None:
    if not all(checked):
        pytest.skip("cuobjdump not installed: compiled without a message, spills unchecked")


def test_short_kernels_compile_without_spills(tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    checked = []
    for arch, group, d, config in COMPILED:
        family, params = qs.short_plan(group, d, d == 128, config, True, False)
        checked.append(assert_compiles_without_spills(family.spec(params), arch, tmp_path))
    skip_unless_spills_checked(checked)


# -- GPU -----------------------------------------------------------------------------------------
# (topk, hq, hkv): shorter than a chunk per warp with a group of 4 (TMMA); longer than any
# config's stages, G = 16; an odd selection (the plain cache: cp.async) of a group of 16.
CASES = [(40, 8, 2), (1000, 64, 4), (77, 16, 1)]
CONFIGS = list(qs.SHORT_CONFIGS.values())
MANY_ROWS = ["w1s2", "w2s3", "w1s4"]


def _case(rows, hq, hkv, topk, seed, d=128):
    return add_hazards(
        make_case(rows=rows, hq=hq, hkv=hkv, d=d, page=64, topk=topk, width=-(-topk // 64) + 3,
                  num_blocks=60, device="cuda", seed=seed, combined=topk % 2 == 0 and d == 128)
    )  # fmt: skip


@pytest.fixture(scope="module")
def built():
    """Every kernel of this file's GPU tests, compiled at once (parallel NVRTC)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    from jit_kernels import prepare

    wanted = [
        qs.short_plan(hq // hkv, 128, topk % 2 == 0, config, True, order)
        for config in CONFIGS
        for order in (True, False)
        for topk, hq, hkv in CASES
    ]
    wanted += [qk.slot_plan(64, order, 4) for order in (True, False)]
    many = [qs.SHORT_CONFIGS[name] for name in MANY_ROWS]
    wanted += [qs.short_plan(8, 128, True, c, True, order) for c in many for order in (True, False)]
    prepare(wanted, torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=list(qs.SHORT_CONFIGS))
@pytest.mark.parametrize("order", [True, False])
@pytest.mark.parametrize("topk, hq, hkv", CASES)
def test_gpu_short_configs(built, config, order, topk, hq, hkv, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = _case(9, hq, hkv, topk, seed=topk + config[0] * 10 + config[1])
    case["out"].fill_(math.nan)
    run_kernels(args_of(case), config=config, short=True, order=order)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))
    assert (case["out"][1] == 0).all() and (case["out"][3] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", MANY_ROWS)
@pytest.mark.parametrize("order", [True, False])
def test_gpu_short_many_rows(built, name, order, monkeypatch):
    """More CTAs than the device holds at once, counts 0..TOPK in any order."""
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = make_case(rows=1500, hq=16, hkv=2, d=128, page=64, topk=256, width=8, num_blocks=40,
                     device="cuda", seed=31, combined=True)  # fmt: skip
    counts = torch.randint(0, 257, (1500,), device="cuda", dtype=torch.int32)
    case["logical_indices"][:, -1] = counts
    case["out"].fill_(math.nan)
    run_kernels(args_of(case), config=qs.SHORT_CONFIGS[name], short=True, order=order)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
@pytest.mark.parametrize("d, config", [(64, qs.SHORT_DEFAULT), (256, (1, 2, 4)), (256, (2, 2, 2))])
def test_gpu_short_head_dims(d, config, monkeypatch):
    monkeypatch.setenv("FLASHINFER_JIT_STRICT", "1")
    case = _case(7, 10, 2, 300, seed=d, d=d)
    case["out"].fill_(math.nan)
    run_kernels(args_of(case), config=config, short=True, order=False)
    torch.cuda.synchronize()
    assert_close(case["out"], ref_of(case))


@pytest.mark.gpu
def test_gpu_short_cuda_graph(built):
    """Captured once, replayed over fresh inputs copied into the captured buffers."""
    shape = dict(rows=40, hq=64, hkv=4, d=128, page=64, topk=256, width=8, num_blocks=48,
                 num_requests=4, device="cuda", combined=True)  # fmt: skip
    case = make_case(**shape, seed=2)
    run = lambda: run_kernels(args_of(case), config=qs.SHORT_DEFAULT, short=True, order=False)  # noqa: E731
    run()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (7, 8):
        fresh = make_case(**shape, seed=seed)
        for key in ("q", "k_cache", "v_cache", "logical_indices", "block_table", "output_gate"):
            case[key].copy_(fresh[key])
        case["out"].fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(case["out"], ref_of(case))
