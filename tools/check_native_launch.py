"""The native launcher on the GPU: host time per repeat call with it on and off, and
bit-identical outputs.

    python tools/check_native_launch.py [--calls 3000]

Each mode (FLASHINFER_JIT_NATIVE_LAUNCH=1, then =0) runs in processes of its own (the
switch is read when a kernel is loaded): tools/profile_host.py (median host and eager us
per repeat call of MQA, QSA and the MLA K/V pack, GPU idle), then one call each of MQA
(out None and given) and QSA (rows 4: cluster; rows 512: slot pass + single pass) on
seeded inputs, whose outputs are compared bit for bit across the modes. The profile runs
twice, on / off / on / off, and the second round is reported: the first process of a run
is slower either way (H200, round 4: 1-4 us a call), which would bias whichever mode goes
first. Prints one table
(host us on / off and the difference, eager us on / off), which launcher each child used
and whether this torch's tensor guard serves replays, then "outputs identical" or the
tensors that differ (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
MODES = ("1", "0")


def child(path: str) -> None:
    """One call of each op on seeded inputs; saves {name: output} to ``path``."""
    sys.path.insert(0, str(ROOT))
    import flashinfer_jit.qsa as qsa
    from flashinfer_jit import fp8_paged_mqa_logits, padded_seq_len
    from jit_kernels import native, plan_cache
    from tests.test_mqa_logits import make_inputs
    from tests.test_qsa import make_case

    lens = [300, 5000, 8000, 1]
    q, kv, w, table, seq_lens, max_len = make_inputs(lens, device="cuda", seed=1)
    given = torch.full((len(lens), padded_seq_len(max_len)), float("nan"), device="cuda")
    logits = fp8_paged_mqa_logits(q, kv, w, table, seq_lens, max_len)
    outputs = {
        # out=None: only the valid positions are specified (row b: 0 .. lens[b] - 1)
        "mqa out=None": [row[:n] for row, n in zip(logits, lens, strict=True)],
        "mqa out=given": fp8_paged_mqa_logits(q, kv, w, table, seq_lens, max_len, out=given),
    }
    for rows in (4, 512):
        case = make_case(
            rows=rows, hq=64, hkv=4, d=128, page=64, topk=2048, num_blocks=256,
            num_requests=4, width=40, seed=rows, device="cuda", combined=True,
        )  # fmt: skip
        outputs[f"qsa rows={rows}"] = qsa.qsa_sparse_paged_attention(**case)
    torch.cuda.synchronize()
    module = native.launcher()
    used = "native" if module is not None else "cuda-python"
    print(f"  launcher: {used} {getattr(module, '__file__', '')}")
    print(f"  replay recall by tensor guard: {plan_cache._make_guard is not None}")
    host = {k: [t.cpu() for t in v] if isinstance(v, list) else v.cpu() for k, v in outputs.items()}
    torch.save(host, path)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # NaN == NaN bit for bit


def same(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def profile(mode: str, calls: int) -> dict[str, tuple[str, str]]:
    env = {**os.environ, "FLASHINFER_JIT_NATIVE_LAUNCH": mode}
    command = [sys.executable, str(ROOT / "tools" / "profile_host.py"), "--calls", str(calls)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    table = {}
    for line in run.stdout.splitlines()[1:]:
        name, host, eager = line.rsplit(None, 2)
        table[name.strip()] = (host, eager)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--child", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    tables, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            print(f"FLASHINFER_JIT_NATIVE_LAUNCH={mode}")
            env = {**os.environ, "FLASHINFER_JIT_NATIVE_LAUNCH": mode}
            path = str(Path(tmp) / f"out{mode}.pt")
            subprocess.run([sys.executable, __file__, "--child", path], env=env, check=True)
            outputs[mode] = torch.load(path)
        for _ in range(2):  # the second round is kept (see the docstring)
            for mode in MODES:
                tables[mode] = profile(mode, args.calls)
    on, off = tables["1"], tables["0"]
    width = max(map(len, on))
    print(f"\n{'row':{width}}  host on  host off  on-off   eager on  eager off   (us)")
    for name, (host, eager) in on.items():
        host_off, eager_off = off[name]
        delta = float(host) - float(host_off)
        print(f"{name:{width}}  {host:>7}  {host_off:>8}  {delta:+6.1f}", end="")
        print(f"   {eager:>8}  {eager_off:>9}")
    differ = [k for k in outputs["1"] if not same(outputs["1"][k], outputs["0"][k])]
    print("\noutputs identical" if not differ else f"\nOUTPUTS DIFFER: {differ}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
