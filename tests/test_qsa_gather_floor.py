"""tools/qsa_gather_floor.py and its probe (qsa_paged_gather_probe in
tools/kernels/qsa_gather_probe.cuh) without a GPU: the probe compiles for sm_90a to 16-byte
no-allocate loads without spills, the runner passes what the kernel's signature declares,
the tool takes the points whose floor reaches --min-floor within its time budget, and its
verdicts; on a GPU, the probe reads exactly the selected bytes and writes out = q ^ gate."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from jit_kernels import compile_cubin, render
from jit_kernels.compile import CompileError

from .test_mqa_logits_build import _sass
from .test_mqa_logits_tools import _tool
from .test_qsa import args_of, make_case

tool = _tool("qsa_gather_floor")
grid = _tool("qsa_bench_grid")
UNROLL = 8  # the probe's kGatherUnroll


def _build(head_dim: int, split_heads: bool = False):
    spec = tool._gather.spec((head_dim, split_heads))
    return compile_cubin(render(spec, tool.TOOLS_BUILDER.template_root), "sm_90a")


@pytest.mark.parametrize(
    "head_dim,split_heads", [(64, False), (128, False), (256, False), (128, True)]
)
def test_probe_compiles_to_wide_loads_without_spills(head_dim, split_heads, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc")
    built = _build(head_dim, split_heads)
    assert built.messages == "", built.messages
    sass, res = _sass(built.cubin, tmp_path)
    assert "LOCAL:0" in res and "STACK:0" in res, f"the probe spills at D={head_dim}: {res}"
    # the K/V pieces: 16-byte loads that skip L1, kGatherUnroll of them in one trip
    assert sass.count("LDG.E.NA.128.CONSTANT") >= UNROLL, sass
    assert "SHFL.IDX" in sass  # addresses from the lane that resolved the token


def test_probe_refuses_head_dims_its_lanes_do_not_tile():
    pytest.importorskip("cuda.bindings.nvrtc")
    with pytest.raises(CompileError, match="head_dim 16, 32, 64, 128 or 256"):
        _build(96)  # 12 pieces a (token, head): 32 lanes would straddle tokens


class _Kernel:
    def __init__(self):
        self.calls = []

    def launch(self, grid_, block, stream, values):
        self.calls.append((grid_, block, values))


def test_runner_passes_the_signature(monkeypatch):
    kernel = _Kernel()
    monkeypatch.setattr(tool._gather, "get", lambda params, device: kernel)
    monkeypatch.setattr(tool, "cuda_device_index", lambda t: 0)
    monkeypatch.setattr(tool, "current_stream", lambda device: 0)
    case = make_case(rows=3, hq=8, hkv=2, d=64, page=16, topk=200, num_blocks=60, width=16,
                     combined=True)  # fmt: skip
    args = args_of(case)
    tool.gather_runner([args])(args)
    ((grid_, block, values),) = kernel.calls
    assert grid_ == (2, 3, 1) and block == (tool.TOKENS, 1, 1)  # 200 tokens: 2 chunks of 128
    assert len(values) == len(tool._gather.signature)
    tool._gather.packer.pack(values)  # every value fits its declared type
    k = case["k_cache"]
    assert values[2] == 200 and values[6:8] == (16, 2)  # topk, page size, Hkv
    assert values[9:12] == k.stride()[:3] and values[-2] == 8 * 64 * 2 // 16
    tool.gather_runner([args], split_heads=True)(args)  # each kv head its own CTAs
    assert kernel.calls[1][0] == (2, 3, 2) and kernel.calls[1][2][:-1] == values[:-1]
    bad = dict(case, q=case["q"].transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(AssertionError):
        tool.gather_runner([args_of(bad)])


def test_points_parsing_and_time_budget():
    points = tool.candidates(50.0, None)
    names = {p.name for p in points}
    assert all(p.name in names for p in grid.grid() if p.est_floor_us() >= 50.0)
    assert all(p.est_floor_us() >= 45.0 for p in points) and len(points) > 40
    assert tool.wall_seconds(points) < 200  # the default run stays a short device call
    narrow = tool.candidates(100.0, "512:4096")
    assert narrow and all(512 <= p.pairs <= 4096 and p.est_floor_us() >= 90 for p in narrow)
    args = tool.parse_args(["--min-floor", "100", "--pairs", "512:4096", "--json", "f.json"])
    assert args.min_floor == 100.0 and args.pairs == "512:4096" and args.json == "f.json"
    assert not args.list and args.seed_triton  # the seed's default path
    command = [sys.executable, str(tool.__file__), "--list", "--min-floor", "100"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    count = len(tool.candidates(100.0, None))
    assert done.stdout.splitlines()[-1].startswith(f"{count} candidate points; model ~")


def test_verdicts():
    cells = tool.row_cells("p", {"floor": 100.0, "gather": 125.0, "ours": 130.0})
    assert cells[3] == "3.39" and cells[5] == "77%" and cells[-1] == "yes"  # 117.6 < 125
    assert tool.row_cells("p", {"floor": 100.0, "gather": 110.0, "ours": 130.0})[-1] == ""
    assert tool.row_cells("p", {"floor": 100.0, "gather": 125.0, "ours": 120.0})[-1] == (
        "not a floor"  # ours is faster: the probe bounds nothing there
    )


def _expected_sink(args, words_per_row: int) -> np.ndarray:
    """The xor of every selected token's K and V words, per 32 tokens (a warp's)."""
    q, k, v, indices, table, t2r = (a.cpu() if torch.is_tensor(a) else a for a in args[:6])
    rows, topk, page = q.shape[0], indices.shape[1] - 1, k.shape[1]
    sink = np.zeros((rows, words_per_row), dtype=np.uint32)
    for r in range(rows):
        for t in range(min(max(int(indices[r, topk]), 0), topk)):
            idx = int(indices[r, t])
            if idx >= 0:
                block, slot = int(table[int(t2r[r]), idx // page]), idx % page
                rows_kv = torch.cat([k[block, slot].reshape(-1), v[block, slot].reshape(-1)])
                words = rows_kv.view(torch.uint8).contiguous().numpy().view(np.uint32)
                sink[r, t // 32] ^= np.bitwise_xor.reduce(words)
    return sink


@pytest.mark.gpu
@pytest.mark.parametrize("split_heads", [False, True])
@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_probe_reads_exactly_the_selected_bytes(combined, d, split_heads):
    case = make_case(rows=5, hq=16, hkv=2, d=d, page=16, topk=300, num_blocks=80, width=24,
                     device="cuda", combined=combined)  # fmt: skip
    case["logical_indices"][0, 1] = -1  # a skipped token inside the count
    case["logical_indices"][1, -1] = 37  # a short row
    args = args_of(case)
    run = tool.gather_runner([args], split_heads)
    run(args)
    torch.cuda.synchronize()
    bits = [case[n].view(torch.int16) for n in ("q", "output_gate", "out")]
    assert torch.equal(bits[2], bits[0] ^ bits[1])
    got = run.sink.view(1 + split_heads, 5, -1).cpu().numpy().view(np.uint32)  # (head,) row, warp
    got = np.bitwise_xor.reduce(got, axis=0)  # the heads' words of a (row, warp) folded
    assert np.array_equal(got, _expected_sink(args, got.shape[1]))
