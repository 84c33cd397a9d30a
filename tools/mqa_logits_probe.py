"""The TMA logits kernel's timing probes (benchmark only, never shipped): a copy of the
shipped template with a PROBE template parameter patched in, which leaves out parts of
the kernel to time the rest: 1 = consumers release each stage untouched (the streaming
alone), 2 = no epilogue (stream + MMA), 3 = no MMA (stream + epilogue on unset
accumulators). PROBE 0 is the shipped kernel. Probes write no valid logits.

    options = probe_options(TmaConfig(2, 6, 2, 2), probe=1)   # MqaLogitsOptions
    mqa_logits.OP.runner(options).call(q, kv, w, table, lens, max_len)

``patch_templates`` copies the templates and applies (anchor, replacement) pairs, each
anchor found exactly once (tools/trace_mqa_logits.py patches the same way; a CPU test
checks the anchors still apply).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from flashinfer_jit._jit import TEMPLATE_ROOT
from flashinfer_jit._version import __version__
from flashinfer_jit.mqa_logits import MqaLogitsOptions
from flashinfer_jit.mqa_logits.tma import TmaConfig, tma_family
from jit_kernels import KernelBuilder, KernelFamily, LoadedKernel

TMA_TEMPLATE = "mqa_logits/sm90_tma_wgmma.cuh"
PROBE_PATCHES = [
    (
        "          int PRODUCERS, int QBUF, int LEAN, int PAIR, int REGS>\n__global__",
        "          int PRODUCERS, int QBUF, int LEAN, int PAIR, int REGS, int PROBE>\n__global__",
    ),
    (
        "  if (T * wg < len) {  // the first tile's Q",
        "  if (PROBE != 1 && T * wg < len) {  // the first tile's Q",
    ),
    (
        "    tma_mma_cols<N, 0, N, DIM, F16ACC>(acc, da, db);",
        "    if constexpr (PROBE == 3)\n"
        '      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");\n'
        "    else\n"
        "      tma_mma_cols<N, 0, N, DIM, F16ACC>(acc, da, db);",
    ),
    (
        "    if constexpr (WREG) {\n      tma_epilogue",
        "    if constexpr (PROBE == 2) {  // keep the accumulators alive without an epilogue\n"
        "      tma_mma_wait<0, 0, ACC_WORDS>(acc);\n"
        "      release_stage(empty0 + 8 * s);\n"
        "      if (acc[0] == 0x7fc00001u && m.x < 0) out[0] = OutT{};\n"
        "    } else if constexpr (WREG) {\n      tma_epilogue",
    ),
    (
        "    if (m.x >= batch) release_stage(empty0 + 8 * s);  // padding\n    return m;",
        "    if (PROBE == 1 || m.x >= batch) release_stage(empty0 + 8 * s);\n"
        "    return PROBE == 1 ? make_int4(batch, 0, 0, 0) : m;",
    ),
]


def patch_templates(root: Path, patches: list[tuple[str, ...]]) -> None:
    """Copy the package's templates to ``root`` and apply ``patches``: (anchor, replacement)
    to the TMA template, or (template, anchor, replacement) to another file under it."""
    shutil.copytree(TEMPLATE_ROOT, root, dirs_exist_ok=True)
    for patch in patches:
        name, anchor, replacement = patch if len(patch) == 3 else (TMA_TEMPLATE, *patch)
        path = root / name
        text = path.read_text()
        if text.count(anchor) != 1:
            raise SystemExit(f"anchor not found exactly once in {path.name}: {anchor!r}")
        path.write_text(text.replace(anchor, replacement))


def patched_family(root: Path, name: str, patches: list[tuple[str, ...]]) -> KernelFamily:
    """The TMA family (with a trailing ``probe`` parameter) built from a patched copy of
    the templates under ``root``; ``patches`` come after the probe's."""
    patch_templates(root, PROBE_PATCHES + patches)
    f = tma_family
    builder = KernelBuilder(root, f"{__version__}+{name}")
    return KernelFamily(builder, name, f.template, f.kernel, (*f.param_names, "probe"), f.signature)


class Probe:
    """A TMA family for MqaLogitsOptions.tma_family: builds ``family``'s probe ``probe``."""

    def __init__(self, family: KernelFamily, probe: int):
        self.family, self.probe = family, probe

    def get(self, params: tuple, device: int) -> LoadedKernel:
        return self.family.get((*params, self.probe), device)


@functools.cache
def _probe_family() -> KernelFamily:
    root = Path(tempfile.mkdtemp(prefix="fij-probe-"))
    atexit.register(shutil.rmtree, root, True)
    return patched_family(root / "templates", "mqa_logits_tma_probe", [])


@functools.cache
def probe(n: int) -> Probe:
    """The probe-``n`` TMA family (one per process, so options built from it compare equal)."""
    return Probe(_probe_family(), n)


@functools.cache
def variant(name: str, patches: tuple[tuple[str, ...], ...]) -> KernelFamily:
    """The TMA family built from a copy of the templates with ``patches`` (and no probe
    parameter): a candidate change timed beside the shipped kernel in one process."""
    root = Path(tempfile.mkdtemp(prefix="fij-variant-"))
    atexit.register(shutil.rmtree, root, True)
    patch_templates(root / "templates", list(patches))
    f = tma_family
    builder = KernelBuilder(root / "templates", f"{__version__}+{name}")
    return KernelFamily(builder, name, f.template, f.kernel, f.param_names, f.signature)


def probe_options(config: TmaConfig, n: int, pdl: bool = True) -> MqaLogitsOptions:
    """Options running the TMA kernel's probe ``n`` in ``config``. The probes patch the plain
    consumer loop: a lean config would time the unpatched lean loop (session 18 found
    ``--probes`` doing that since the dispatcher took the lean loop), so it is refused; use
    ``config._replace(lean=0, pair=0)`` and compare with the plain kernel."""
    if config is None or config.lean:
        raise ValueError(
            f"probe {n}: the probes patch the plain loop; give a config with lean=0, got {config}"
        )
    return MqaLogitsOptions(config=config, pdl=pdl, tma_family=probe(n))
