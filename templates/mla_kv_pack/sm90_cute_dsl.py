"""The "cake" backend of concat_mla_kv_quant_fp8: a CuTe-DSL program per head group.

    kv_nope [T*H, NOPE + V] bf16  ->  key   [T*H, NOPE + ROPE] e4m3 = [k_nope | k_pe]
    k_pe    [T, ROPE] (row stride LD)    value [T*H, V]           e4m3

A warp owns one token and ``head_group`` consecutive head *pairs* of it. Two heads'
kv_nope rows are 1 KiB, so each lane moves one 32-byte chunk of a pair: lanes 0-15 the
first head (0-7 k_nope, 8-15 v), lanes 16-31 the second. Every pair's loads are issued
before any conversion or store, so ``head_group`` is also the number of 32-byte loads a
lane keeps in flight; a larger group means fewer, longer-lived warps. The token's k_pe
(4 chunks, loaded with the rows) is converted once and stored for every head by every
lane of each half, four lanes a chunk.

Heads past the end (odd head counts, a last group short of pairs) load the last head's
row and store its bytes again, so neither loads nor stores need a head predicate (a
predicate would let the compiler sink loads behind other loads' conversions).

The conversion is the DSL's bf16 -> Float8E4M3FN, which lowers to
``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even, overflow and +-inf to +-448,
NaN to 0x7F, the op's numerics exactly (the tests compare bytes).

Kernel parameters (the launch signature): kv_nope {ptr; i64 rows}, k_pe {ptr; i32 T;
i64 LD}, key {ptr; i64 rows}, value {ptr; i64 rows}, num_tokens i32, num_heads i32,
groups_per_token i32. Block: exactly ``WARPS_PER_BLOCK`` warps (``.reqntid``). Grid:
ceil(T * groups_per_token / WARPS_PER_BLOCK) blocks along x.

``build(params, arch)`` compiles one program without a GPU and returns its cubin and
mangled entry name; the engine caches and launches it like any NVRTC kernel.
"""

from __future__ import annotations

import os
import tempfile

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

NOPE, ROPE, V = 128, 64, 128
CHUNK = 16  # bf16 elements a lane moves per head row: 32 bytes in, 16 bytes out
WARPS_PER_BLOCK = 8
HEAD_GROUPS = (1, 2, 4, 8)  # head pairs per warp that programs exist for


@cute.kernel
def _pack(
    kv_nope: cute.Tensor,
    k_pe: cute.Tensor,
    key: cute.Tensor,
    value: cute.Tensor,
    num_tokens: cutlass.Int32,
    num_heads: cutlass.Int32,
    groups_per_token: cutlass.Int32,
    head_group: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    warp = bidx * WARPS_PER_BLOCK + tidx // 32
    token = warp // groups_per_token
    group = warp - token * groups_per_token
    if token < num_tokens:
        half = lane // 16  # which head of the pair
        sub = lane % 16  # which 32-byte chunk of that head's row
        first = group * (2 * head_group) + half
        base = cutlass.Int64(token) * cutlass.Int64(num_heads)
        # No load or conversion may sit inside a branch it alone feeds: the compiler would
        # sink it there, behind another load's conversion, and put two memory round trips
        # in series (all that a decode-sized call, one pass per warp, pays). So no store
        # is skipped: a head past the end (odd head counts, a group padded past the last
        # pair) loads the last head's row and rewrites it with the same bytes, and every
        # lane of a half stores its k_pe chunk (lanes with equal addresses coalesce into
        # the same sectors within the instruction, so this costs no extra traffic).
        # The rows' loads come first and k_pe's last, so no load waits behind another
        # load's conversion (for groups of 4 and 8, ptxas still defers a pair's loads to
        # stay near 64 registers; those calls have many warps per SM to hide it). Every
        # lane loads a k_pe chunk (the warp touches 128 bytes once): no divergence.
        rows = []
        for p in cutlass.range_constexpr(head_group):
            row = base + cutlass.min(first + 2 * p, num_heads - 1)
            rows.append((row, cute.local_tile(kv_nope[row, None], (CHUNK,), (sub,)).load()))
        pe = cute.local_tile(k_pe[token, None], (CHUNK,), (sub % (ROPE // CHUNK),)).load()
        # Conversions are staged lazily where first used; a register fragment materializes
        # each one here, once, so both store branches can read it.
        pe8 = cute.make_rmem_tensor((CHUNK,), cutlass.Float8E4M3FN)
        pe8.store(pe.to(cutlass.Float8E4M3FN))
        for row, data in rows:
            out = cute.make_rmem_tensor((CHUNK,), cutlass.Float8E4M3FN)
            out.store(data.to(cutlass.Float8E4M3FN))
            cute.local_tile(
                key[row, None], (CHUNK,), (NOPE // CHUNK + sub % (ROPE // CHUNK),)
            ).store(pe8.load())
            if sub < NOPE // CHUNK:
                cute.local_tile(key[row, None], (CHUNK,), (sub,)).store(out.load())
            else:
                cute.local_tile(value[row, None], (CHUNK,), (sub - NOPE // CHUNK,)).store(
                    out.load()
                )


@cute.jit
def _host(
    kv_nope: cute.Tensor,
    k_pe: cute.Tensor,
    key: cute.Tensor,
    value: cute.Tensor,
    num_tokens: cutlass.Int32,
    num_heads: cutlass.Int32,
    groups_per_token: cutlass.Int32,
    head_group: cutlass.Constexpr,
):
    # Only the kernel is kept: the package launches it itself with the real grid.
    _pack(kv_nope, k_pe, key, value, num_tokens, num_heads, groups_per_token, head_group).launch(
        grid=(1, 1, 1), block=(32 * WARPS_PER_BLOCK, 1, 1)
    )


def build(params: dict, arch: str) -> tuple[bytes, str]:
    """Compile the program for ``params["head_group"]`` head pairs a warp on ``arch``."""
    head_group = int(params["head_group"])
    if head_group not in HEAD_GROUPS:
        raise ValueError(f"head_group must be one of {HEAD_GROUPS}, got {head_group}")
    rows = cute.sym_int64(symbol="rows")
    tokens = cute.sym_int32(symbol="tokens")
    pe_stride = cute.sym_int64(divisibility=CHUNK, symbol="pe_row_stride")
    kv_nope = make_fake_tensor(cutlass.BFloat16, (rows, NOPE + V), (NOPE + V, 1), assumed_align=32)
    k_pe = make_fake_tensor(cutlass.BFloat16, (tokens, ROPE), (pe_stride, 1), assumed_align=32)
    key = make_fake_tensor(
        cutlass.Float8E4M3FN, (rows, NOPE + ROPE), (NOPE + ROPE, 1), assumed_align=32
    )
    value = make_fake_tensor(cutlass.Float8E4M3FN, (rows, V), (V, 1), assumed_align=32)
    scalars = (cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1))
    with tempfile.TemporaryDirectory(prefix="fij-cute-") as dump:
        # --keep-cubin makes the DSL hand the cubin bytes back in `artifacts`; the
        # explicit arch matters: with no GPU the DSL would silently pick sm_100a.
        options = f"--gpu-arch {arch} --keep-cubin --dump-dir {dump}"
        compiled = cute.compile(
            _host, kv_nope, k_pe, key, value, *scalars, head_group, options=options
        )
        cubin = compiled.artifacts.CUBIN
        if isinstance(cubin, str) and os.path.exists(cubin):
            with open(cubin, "rb") as f:
                cubin = f.read()
    if not isinstance(cubin, bytes) or not cubin.startswith(b"\x7fELF"):
        raise RuntimeError(f"CuTe DSL returned no cubin for head_group={head_group} ({arch})")
    entries = list(compiled.kernel_info)
    if len(entries) != 1:
        raise RuntimeError(f"expected one kernel in the program, found {entries}")
    return cubin, entries[0]
