"""Plain-text tables for the commands' output."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 right: Sequence[str] = ()) -> str:
    """Rows under headers in aligned columns; columns named in ``right`` align right."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if h in right else c.ljust(w)
                 for c, w, h in zip(row, widths, headers, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
