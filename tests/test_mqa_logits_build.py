"""fp8_paged_mqa_logits without a GPU: registration, workloads, compilation of every
shipped specialization (SASS checks), launch configs and the repeat-call replay."""

from __future__ import annotations

import math

import pytest
import torch

import flashinfer_jit.mqa_logits as mq
from flashinfer_jit.mqa_logits import (
    fp8_paged_mqa_logits,
    padded_seq_len,
)
from flashinfer_jit.mqa_logits import plan as mq_plan
from flashinfer_jit.mqa_logits.checks import launch_config
from flashinfer_jit.mqa_logits.launch import KernelPlan, Launch
from flashinfer_jit.mqa_logits.ring import ring_family, ring_params
from flashinfer_jit.mqa_logits.schedule import schedule_family
from flashinfer_jit.mqa_logits.tma import tma_config
from jit_kernels.launch import merge

from .test_mqa_logits import (
    _args,
    make_inputs,
)


# -- registration, workloads, compilation (no GPU needed) ---------------------------------
def test_custom_op_registered():
    op = torch.ops.flashinfer_jit.fp8_paged_mqa_logits
    a = _args()
    out = torch.empty(4, padded_seq_len(a["max_seq_len"]))
    torch.library.opcheck(
        op,
        (
            a["q"],
            a["kv_fused"],
            a["weights"],
            a["block_tables"],
            a["seq_lens"],
            a["max_seq_len"],
            torch.float32,
            torch.float32,
            torch.float32,
            None,
            out,
        ),
        test_utils=("test_faketensor", "test_autograd_registration"),
    )


def test_prebuild_specs_cover_workloads():
    import json

    workloads = json.loads(mq.OP.workloads.read_text())
    specs = mq.OP.prebuild_specs(workloads, mq.OP.default.options)
    labels = [s.label for s in specs]
    assert any(s.family == "mqa_logits_schedule" for s in specs)
    # the generic kernel of each dtype triple of the workloads (bfloat16 logits: DeepGEMM's)
    triples = [(o, e, a) for o in workloads["output_dtype"] for e in workloads["epi_dtype"]
               for a in workloads["acc_dtype"]]  # fmt: skip
    generic = [s.label for s in specs if s.family == "mqa_logits_generic"]
    assert generic == sorted(
        f"mqa_logits_generic[output_dtype={o},epi_dtype={e},acc_dtype={a}]" for o, e, a in triples
    )
    # (float16 and bfloat16 logits share the ring and TMA kernels' 16-bit specialization)
    outs = len({"16-bit" if o in ("float16", "bfloat16") else o for o in workloads["output_dtype"]})
    assert outs == 2
    shapes = outs * math.prod(
        len(workloads[k]) for k in ("next_n", "num_heads", "head_dim", "block_size")
    )
    # Every workload point has its ring/direct kernel (every arch) and, at head_dim 128, the
    # TMA kernel, which is built for sm_90a only, in each config its small-call classes take
    # (mqa_logits_tma.tma_config).
    pairs = [(n, h) for n in workloads["next_n"] for h in workloads["num_heads"]]
    configs = [{tma_config(n * h, small, 128, n) for small in range(3)} for n, h in pairs]
    small = sum(len(c) - 1 for c in configs) * shapes // len(pairs)
    assert small > 0
    tma = [s for s in specs if s.family == "mqa_logits_tma"]
    assert len(tma) == shapes + small and all(s.archs == ("sm_90a",) for s in tma)
    assert not any(s.supports("sm_100a") for s in tma)
    assert sum(s.family == "mqa_logits_clean" for s in specs) == 2  # float32, bfloat16
    assert len(specs) == 1 + len(triples) + 2 + 2 * shapes + small
    assert all("portable=False" in lbl for lbl in labels if lbl.startswith("mqa_logits["))


def test_prebuild_skips_the_ring_kernel_where_the_tma_kernel_serves():
    """sm_90a takes the TMA kernel at its head dims (every config it picks launches), so
    prebuild builds the ring kernel there for the other archs only; at another head dim
    sm_90a's ring kernel is built."""
    from flashinfer_jit import cli

    archs = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")
    tasks = cli._tasks(["mqa_logits"], archs, None)
    ring = {(t.spec, t.arch) for t in tasks if t.spec.family == "mqa_logits"}
    specs = {spec for spec, _ in ring}
    assert specs and {a for _, a in ring} == set(archs[1:])
    f32 = (torch.float32,) * 3
    other = ring_family.spec(ring_params((1, 64, 160, 64), f32))
    assert mq.OP.prebuilt_on(other, "sm_90a") and mq.OP.prebuilt_on(other, "sm_100a")
    tma = next(t.spec for t in tasks if t.spec.family == "mqa_logits_tma")
    assert mq.OP.prebuilt_on(tma, "sm_90a") and not mq.OP.prebuilt_on(tma, "sm_100a")


def _sass(cubin: bytes, tmp_path) -> tuple[str, str]:
    import subprocess

    from jit_kernels.params import cuobjdump

    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run(
        [tool, "-sass", str(path)], capture_output=True, text=True, check=True
    ).stdout
    res = subprocess.run(
        [tool, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return sass, res


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
@pytest.mark.parametrize(
    "params",
    [
        (1, 64, 128, 64, torch.float32, torch.float32, torch.float32),
        (4, 64, 128, 32, torch.float16, torch.float16, torch.float16),
        (2, 4, 96, 128, torch.float32, torch.float16, torch.float32),
    ],
)
def test_kernels_compile(arch, params, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from jit_kernels import compile_cubin, render

    spec = ring_family.spec(ring_params(params[:4], params[4:]))
    compiled = compile_cubin(render(spec, BUILDER.template_root), arch)
    assert compiled.messages == "", f"{spec.label} on {arch}: {compiled.messages}"
    cubin = compiled.cubin
    sass, res = _sass(cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills on {arch}: {res}"
    if arch == "sm_90a":
        assert "QGMMA" in sass, "the sm_90a path must use fp8 wgmma"
    else:
        assert "HMMA" in sass
    assert "UBLKCP" in sass, "the ring kernel streams K with cp.async.bulk"
    sched = schedule_family.spec((256,))
    assert compile_cubin(render(sched, BUILDER.template_root), arch).cubin


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_generic_kernel_compiles(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from flashinfer_jit.mqa_logits.generic import generic_family
    from jit_kernels import compile_cubin, render

    spec = generic_family.spec((torch.float16, torch.float32, torch.float32))
    compiled = compile_cubin(render(spec, BUILDER.template_root), arch)
    # Known: on sm_90a ptxas serializes the generic kernel's wgmma (C7519: its MMA sits under
    # runtime head_dim / column guards; perf-log engine, 2026-12-02). Nothing else is said.
    known = "C7519" if arch == "sm_90a" else None
    said = [line for line in compiled.messages.splitlines() if known is None or known not in line]
    assert not said, f"{spec.label} on {arch}: {compiled.messages}"
    sass, res = _sass(compiled.cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills on {arch}: {res}"
    assert ("QGMMA" if arch == "sm_90a" else "HMMA") in sass


def test_launch_configs_fit_the_register_file():
    """9 warps get 168 registers (4 sub-partitions of 16K, ceil(9/4) = 3 warps each): the
    chosen ring config must leave its consumers room, or the launch fails with error 701."""
    from flashinfer_jit.mqa_logits.checks import direct_config, reg_cap, ring_regs

    assert (reg_cap(288), reg_cap(160), reg_cap(416), reg_cap(256), reg_cap(384)) == (
        168,
        255,
        128,
        255,
        168,
    )
    for dim in range(32, 257, 32):
        for n in range(8, 257, 8):
            cfg = launch_config(n, dim)
            if cfg is None:
                assert direct_config(n, dim) is None
                continue
            warpgroups, stages, ring = cfg
            if ring:
                assert ring_regs(n, dim) <= reg_cap(128 * warpgroups + 32), (n, dim, cfg)
                assert stages >= 4 and stages % warpgroups == 0


def test_fast_path_replays_the_full_path(monkeypatch, request):
    """A repeated call (same metadata, new tensors) launches with the same arguments as the
    full path would, with the new addresses; a changed layout takes the full path."""
    calls = []

    class Kernel:
        name = "fake"

        def bind(self, grid, block, smem, programmatic, template):
            return lambda stream, values: calls.append((grid, block, merge(template, values), smem))

    plan = KernelPlan(Kernel(), (7, 1, 1), (288, 1, 1), 1234)
    monkeypatch.setattr(mq.OP, "kernel_call", lambda args: True)
    monkeypatch.setattr(mq.OP, "refusal", lambda args: None)
    monkeypatch.setattr(mq_plan, "kernel_plan", lambda *a: plan)
    import flashinfer_jit.mqa_logits.launch as mql

    monkeypatch.setattr(mq_plan, "cuda_device_index", lambda t: 0)
    monkeypatch.setattr(mq_plan, "sm_count", lambda d: 132)
    monkeypatch.setattr(mql, "current_stream", lambda d: 0)
    replays = mq.OP.default.replays
    replays.clear()
    request.addfinalizer(replays.clear)  # launches of the fake plan must not outlive the test
    a = make_inputs([70, 5, 300], next_n=2, heads=32, seed=1)
    b = make_inputs([70, 5, 300], next_n=2, heads=32, seed=2)
    max_len = a[5]
    wide = torch.empty(6, padded_seq_len(max_len) + 40)
    for out in (None, wide):
        calls.clear()
        for inputs in (a, b, a):
            got = fp8_paged_mqa_logits(*inputs[:5], max_len, out=out)
            assert got.shape == (6, max_len)
            assert out is None or got.data_ptr() == wide.data_ptr()
        assert len(replays) >= 1
        full, fast_b, fast_a = calls
        assert full[2][:3] == fast_a[2][:3] and full[2][4:8] == fast_a[2][4:8]
        assert full[2][9:] == fast_a[2][9:] == fast_b[2][9:]
        assert fast_b[2][0] == b[0].data_ptr() and fast_b[2][5] == b[4].data_ptr()
        assert (full[0], full[1], full[3]) == (fast_b[0], fast_b[1], fast_b[3])
    # A strided block table (a new layout) misses the fast path and still passes its stride.
    table = torch.zeros(3, 2 * a[3].shape[1], dtype=torch.int32)[:, ::2]
    with pytest.raises(ValueError, match="block_tables rows must be contiguous"):
        fp8_paged_mqa_logits(*a[:3], table, a[4], max_len)
    wide_table = torch.zeros(6, a[3].shape[1], dtype=torch.int32)[::2]
    calls.clear()
    fp8_paged_mqa_logits(*a[:3], wide_table, a[4], max_len)
    fp8_paged_mqa_logits(*a[:3], wide_table, a[4], max_len)
    assert calls[0][2][4] == calls[1][2][4] == 2 * a[3].shape[1]


@pytest.mark.parametrize("prefetch", [True, False, None])
def test_launch_passes_the_table_columns(prefetch):
    """The TMA kernel's table_cols, right after the plan's extra arguments: the call's
    block-table columns where the plan prefetches the table, 0 where it does not; no such
    argument for a plan whose kernel takes none (table_prefetch None)."""
    seen = {}

    class Kernel:
        name = "fake"

        def bind(self, grid, block, smem, programmatic, template):
            seen["template"] = template
            return lambda stream, values: None

    plan = KernelPlan(Kernel(), (7, 1, 1), (288, 1, 1), 1234, (5,), None, False, prefetch)
    q, _, w, table, lens, max_len = make_inputs([70, 5, 300], next_n=1, heads=32, seed=1)
    wide = torch.zeros(3, 2 * table.shape[1], dtype=torch.int32)[:, : table.shape[1] + 3]
    for t in (table, wide):
        Launch(plan, 0, q, w, t, lens, torch.empty(3, max_len), max_len)
        members = seen["template"]
        assert members[11] == 5  # the plan's extra (flags)
        if prefetch is None:
            assert len(members) == 12
        else:
            assert members[12] == (t.shape[1] if prefetch else 0)


def test_direct_kernel_compiles_for_wide_heads(tmp_path):
    """head_dim 512 with next_n*num_heads 256 leaves room for fewer than 4 ring stages: the
    dispatcher picks the register-fed direct kernel, which must compile without spills."""
    pytest.importorskip("cuda.bindings.nvrtc")
    from flashinfer_jit._jit import BUILDER
    from jit_kernels import compile_cubin, render

    assert launch_config(256, 512)[2] is False
    f32 = torch.float32
    spec = ring_family.spec(ring_params((4, 64, 512, 64), (f32, f32, f32)))
    sass, res = _sass(compile_cubin(render(spec, BUILDER.template_root), "sm_90a").cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"{spec.label} spills: {res}"
    assert "QGMMA" in sass


def test_compiled_calls_check_values_when_they_run():
    """torch.compile traces the op (one graph, fake tensors: no values to check) and the
    compiled call's custom op runs the eager call path, which checks the values (on CPU
    always): the logits are eager's, and a length past max_seq_len is refused at run time."""
    q, kv, w, table, lens, longest = make_inputs([10, 70], next_n=2, heads=32)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, kv, w, table, lens):
        return mq.fp8_paged_mqa_logits(q, kv, w, table, lens, longest)

    got, want = step(q, kv, w, table, lens), mq.fp8_paged_mqa_logits(q, kv, w, table, lens, longest)
    assert got.shape == want.shape and got.stride() == want.stride()
    for row, n in enumerate((9, 10, 69, 70)):  # next_n=2: rows see lengths len - 1, len
        assert torch.equal(got[row, :n], want[row, :n])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        step(q, kv, w, table, torch.tensor([10, 700], dtype=torch.int32))
