"""What the ``flashinfer-jit`` subcommands share: user errors, their text, table printing."""

from __future__ import annotations


class CliError(Exception):
    """A user error: printed as one line on stderr, exit status 2."""


def os_error_text(exc: OSError) -> str:
    """One line for ``exc``: the path and the system's reason, where it names them."""
    return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)


def table(header: list[str], rows: list[list]) -> str:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
