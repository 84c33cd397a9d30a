"""A kernel's parameter list, declared once and typed.

An op declares each ``__global__`` parameter as one of these, in the C++ order; the
family packs launches from the declaration (``ArgPacker``), and ``entry_param_sizes``
reads the compiled entry's parameter table (the ELF ``.nv.info`` section, through
``cuobjdump -elf``) so a test can compare the two: a parameter added, dropped or
retyped on one side only fails there, not as a silent misread on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# Size and alignment in bytes of each struct code an ArgPacker understands.
_LAYOUT = {"P": (8, 8), "i": (4, 4), "I": (4, 4), "q": (8, 8), "f": (4, 4), "M": (128, 64)}


@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel parameter: ``codes`` are its members' ArgPacker codes (one code for a
    scalar, several for a by-value struct); ``what`` says what it is, for messages."""

    codes: str
    what: str = ""

    @property
    def size(self) -> int:
        """Its size in the parameter buffer, as the C++ compiler lays it out."""
        size = 0
        for code in self.codes:
            width, align = _LAYOUT[code]
            size += -size % align + width
        return size + -size % self.align

    @property
    def align(self) -> int:
        return max(_LAYOUT[code][1] for code in self.codes)


PTR = Param("P", "pointer")
I32 = Param("i", "int32")
U32 = Param("I", "uint32")
I64 = Param("q", "int64")
F32 = Param("f", "float")
TENSOR_MAP = Param("M", "CUtensorMap (__grid_constant__)")


def struct(*members: Param, what: str = "struct") -> Param:
    """A by-value struct of ``members`` (e.g. a CuTe-DSL tensor: pointer, shape, strides)."""
    return Param("".join(m.codes for m in members), what)


Signature = tuple[Param, ...]


def codes(signature: Sequence[Param]) -> tuple[str, ...]:
    """The ArgPacker codes of a signature."""
    return tuple(p.codes for p in signature)


def cuobjdump() -> str | None:
    """The cuobjdump binary: on PATH, else the ``nvidia-cuda-cuobjdump`` wheel's."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13

        path = Path(list(nvidia.cu13.__path__)[0]) / "bin" / "cuobjdump"
        return str(path) if path.exists() else None
    except ImportError:
        return None


def entry_param_sizes(cubin: bytes, tool: str) -> dict[str, list[int]]:
    """Entry symbol -> its parameters' sizes in ordinal order, from a cubin's ``.nv.info``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        elf = subprocess.run(
            [tool, "-elf", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    tables: dict[str, dict[int, int]] = {}
    current: dict[int, int] | None = None
    for line in elf.splitlines():
        if line.startswith(".nv.info."):
            current = tables.setdefault(line.removeprefix(".nv.info."), {})
        elif current is not None and "Ordinal :" in line and "Size" in line:
            fields = line.replace(":", " ").split()
            ordinal = int(fields[fields.index("Ordinal") + 1], 16)
            current[ordinal] = int(fields[fields.index("Size") + 1], 16)
    return {name: [sizes[i] for i in sorted(sizes)] for name, sizes in tables.items() if sizes}
