"""Compare the SASS of two prebuilt bundles (``flashinfer-jit prebuild --output DIR``) kernel
by kernel: which specializations compile to the same machine code, which differ, which are
in one bundle only. No GPU needed (cuobjdump from the nvidia-cuda-cuobjdump wheel).

    python tools/compare_bundles.py /tmp/bundle-main /tmp/bundle-branch [--arch sm_90a]

Kernels are matched by (arch, label). Labels name the template parameters, so a parameter
that was removed everywhere is dropped from both sides first (``--drop probe=0`` for the
TMA logits kernel's benchmark-only probe, which left the shipped template). The SASS is
compared past the function name (the mangled name spells the template arguments).
Exit status 1 when a kernel present in both differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jit_kernels.params import cuobjdump  # noqa: E402


def records(root: Path, archs: set[str], drop: list[str]) -> dict[tuple[str, str], Path]:
    """(arch, label) -> cubin path of every kernel record under ``root``."""
    found = {}
    for meta in root.rglob("*.json"):
        cubin = meta.with_suffix(".cubin")
        if not cubin.is_file():
            continue
        record = json.loads(meta.read_text())
        arch, label = record.get("arch"), record.get("label")
        if not arch or not label or (archs and arch not in archs):
            continue
        for part in drop:
            label = label.replace(f",{part}]", "]").replace(f",{part},", ",")
        found[(arch, label)] = cubin
    return found


def sass(cubin: Path, tool: str) -> str:
    """The SASS text past the function line (the mangled name differs with the labels)."""
    text = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    return text[text.find(".headerflags") :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--arch", default="", help="comma-separated archs (default: all)")
    parser.add_argument("--drop", action="append", default=["probe=0"], help="label parts")
    args = parser.parse_args()
    tool = cuobjdump()
    if tool is None:
        raise SystemExit("no cuobjdump: pip install nvidia-cuda-cuobjdump")
    archs = {a for a in args.arch.split(",") if a}
    before = records(args.before, archs, args.drop)
    after = records(args.after, archs, args.drop)
    common = sorted(set(before) & set(after))
    differ = [k for k in common if sass(before[k], tool) != sass(after[k], tool)]
    for arch, label in differ:
        print(f"DIFFERS {arch} {label}")
    for name, only in (("before", set(before) - set(after)), ("after", set(after) - set(before))):
        for arch, label in sorted(only):
            print(f"only {name}: {arch} {label}")
    print(
        f"{len(common)} kernels in both: {len(common) - len(differ)} same SASS, "
        f"{len(differ)} differ; {len(set(before) - set(after))} only before, "
        f"{len(set(after) - set(before))} only after"
    )
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
