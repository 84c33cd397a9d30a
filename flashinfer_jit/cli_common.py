"""What the ``flashinfer-jit`` subcommands share: the user-error type and table printing."""

from __future__ import annotations


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


def table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
