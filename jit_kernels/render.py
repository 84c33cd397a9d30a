"""Rendering a KernelSpec into the exact inputs of one compilation."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from .spec import KernelSpec, sha256_hex

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class RenderedSource:
    """Everything a compiler reads for one specialization, by content."""

    spec: KernelSpec
    source: str  # the translation unit (nvrtc) or the generator module (cute)
    headers: tuple[tuple[str, str], ...]  # (include name, content), sorted by name
    filename: str

    def digest_parts(self) -> list[str]:
        parts = [self.source, self.spec.name_expression, self.spec.compiler]
        for name, text in self.headers:
            parts += [name, text]
        return parts


def _read_headers(root: Path, first: str) -> dict[str, str]:
    """The template and every header it includes from ``root``, transitively."""
    found: dict[str, str] = {}
    pending = [first]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"template header {name!r} not found under {root}")
        text = path.read_text()
        found[name] = text
        pending.extend(_INCLUDE.findall(text))
    return found


def render(spec: KernelSpec, template_root: Path) -> RenderedSource:
    """Deterministically render ``spec``: same spec and templates, same bytes."""
    if spec.compiler == "cute":
        text = (template_root / spec.template).read_text()
        return RenderedSource(spec, text, (), Path(spec.template).name)
    headers = _read_headers(template_root, spec.template)
    # The translation unit only includes the template; NVRTC instantiates the
    # specialization from the name expression, so the generator fixes parameters only.
    source = (
        f"// flashinfer-jit specialization {spec.label}\n"
        f"// instantiated through the name expression {spec.name_expression}\n"
        f'#include "{spec.template}"\n'
    )
    filename = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{spec.family}_{sha256_hex(*headers)[:8]}.cu")
    return RenderedSource(spec, source, tuple(sorted(headers.items())), filename)
