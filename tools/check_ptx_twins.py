"""Which archs may take sm_100a's PTX (jit_kernels.ptxas), and whether a prebuild's cubins
have NVRTC's own SASS: the evidence behind ``PTX_TWINS`` and ``KernelSpec.ptx_twins``, to
re-run on a new NVRTC (docs/prebuild-time.md). No GPU needed.

    python tools/check_ptx_twins.py --arch sm_100a,sm_103a,sm_107a -j 2 [--against CACHE]

Compiles every shipped NVRTC specialization for each arch with NVRTC alone (a compile for a
real arch gives the cubin and the PTX), then prints per family and arch how many specs'
PTX is sm_100a's but for ``.target`` and the internal-linkage names (a per-compile hash),
and with ``--against`` (a prebuild's cache root or bundle) how many of its cubins, found
by cache key, have the SASS of NVRTC's own compile (``cuobjdump -sass`` past
``.headerflags``: addresses, instructions and encodings). Exit status 1 when one differs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flashinfer_jit import cli  # noqa: E402
from flashinfer_jit._jit import TEMPLATE_ROOT  # noqa: E402
from flashinfer_jit._version import __version__  # noqa: E402
from jit_kernels import CubinCache, KernelBuilder, render  # noqa: E402
from jit_kernels.compile import NVRTC_OPTIONS, _check  # noqa: E402
from jit_kernels.params import cuobjdump  # noqa: E402
from jit_kernels.prebuild import worker_pool  # noqa: E402

BASE = "sm_100a"
_NAMES = re.compile(rb"_INTERNAL_\w+?_cu_[0-9a-f]+_\d+|\.target \S+")


def nvrtc_both(rendered, arch: str) -> tuple[bytes, bytes]:
    """(cubin, PTX) of one NVRTC compile of ``rendered`` for the real arch ``arch``."""
    from cuda.bindings import nvrtc

    names = [n.encode() for n, _ in rendered.headers]
    texts = [t.encode() for _, t in rendered.headers]
    source, filename = rendered.source.encode(), rendered.filename.encode()
    (prog,) = _check(nvrtc.nvrtcCreateProgram(source, filename, len(names), texts, names), "create")
    try:
        _check(nvrtc.nvrtcAddNameExpression(prog, rendered.spec.name_expression.encode()), "name")
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in NVRTC_OPTIONS)]
        _check(nvrtc.nvrtcCompileProgram(prog, len(options), options), "compile")
        out = []
        for kind in ("CUBIN", "PTX"):
            (size,) = _check(getattr(nvrtc, f"nvrtcGet{kind}Size")(prog), kind)
            data = bytearray(size)
            _check(getattr(nvrtc, f"nvrtcGet{kind}")(prog, data), kind)
            out.append(bytes(data))
        return out[0], out[1].rstrip(b"\0")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def sass(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    return text[text.find(".headerflags") :]


def check(spec, archs: list[str], against: str | None) -> list[tuple[str, str, bool, bool | None]]:
    """(family, arch, PTX is sm_100a's, the prebuilt cubin has NVRTC's SASS: None where there
    is none or no ``against``) per arch."""
    rendered, tool = render(spec, TEMPLATE_ROOT), cuobjdump()
    cache = CubinCache(Path(against or "."), [], __version__)
    builder = KernelBuilder(TEMPLATE_ROOT, __version__, cache)
    compiled = {arch: nvrtc_both(rendered, arch) for arch in dict.fromkeys([BASE, *archs])}
    base_ptx = _NAMES.sub(b"", compiled[BASE][1])
    rows = []
    for arch in archs:
        cubin, ptx = compiled[arch]
        same_sass = None
        if against:
            key = builder.cache_key(spec, arch)
            found = builder.cache.lookup(arch, spec.family, key, spec.label)
            same_sass = None if found is None else sass(found.cubin, tool) == sass(cubin, tool)
        rows.append((spec.family, arch, _NAMES.sub(b"", ptx) == base_ptx, same_sass))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_103a,sm_107a")
    parser.add_argument("--ops", help="comma-separated ops (default: all)")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--against", help="a prebuild cache root or bundle to check")
    args = parser.parse_args()
    archs = [a for a in args.arch.split(",") if a]
    specs: dict = defaultdict(list)  # spec -> the archs prebuild builds it for
    for task in cli._tasks(cli._ops(args.ops), tuple(archs), None):
        if task.spec.compiler == "nvrtc":
            specs[task.spec].append(task.arch)
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    with worker_pool(args.jobs) as pool:
        futures = [pool.submit(check, s, a, args.against) for s, a in specs.items()]
        for future in futures:
            for family, arch, same_ptx, same_sass in future.result():
                row = table[(family, arch)]
                row[0] += 1
                row[1] += same_ptx
                row[2 if same_sass else 3] += same_sass is not None
    print(f"{'family':22} {'arch':8} specs  PTX = {BASE}'s  prebuilt SASS = NVRTC's / differs")
    for (family, arch), (n, ptx, same, differ) in sorted(table.items()):
        missing = f" ({n - same - differ} not in the cache)" if n - same - differ else ""
        checked = f"{same:5} / {differ}{missing}" if args.against else "    -"
        print(f"{family:22} {arch:8} {n:5}  {ptx:14}  {checked}")
    print(f"{sum(r[0] for r in table.values())} (spec, arch) pairs")
    return 1 if args.against and any(r[2] != r[0] for r in table.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
