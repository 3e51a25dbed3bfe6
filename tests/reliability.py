"""The table of ``docs/reliability.md``: each bad-input, fault and soak test writes its own row.

A test calls ``record(section, case, result)`` with what it sent and what
came back, after its assertions passed. Rows are kept only when the
environment names a file (``RELIABILITY_TABLE=path``, as ``make
reliability`` does), one JSON line each; then::

    python -m tests.reliability ROWS docs/reliability.md

puts them, grouped by section in the order they ran, between the table
markers of the page. The figures in the docs are therefore those of one run.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

ENV: Final = "RELIABILITY_TABLE"
BEGIN: Final = "<!-- reliability table: begin (make reliability rewrites it) -->"
END: Final = "<!-- reliability table: end -->"
COLUMNS: Final = {
    "Bad input": ("What the client sends", "What it gets back"),
    "Faults": ("What fails", "What clients saw, measured"),
    "Soak": ("Measured", "Result"),
    "Overload": ("What the picker holds, and what happens", "What clients saw, measured"),
}


def record(section: str, case: str, result: str) -> None:
    """Append a row to the table file, if one is named; a cell may not hold a newline."""
    path = os.environ.get(ENV)
    if not path:
        return
    if section not in COLUMNS:
        raise ValueError(f"unknown section {section!r}")
    row = {"section": section, "case": case.replace("|", "\\|"), "result": result}
    with open(path, "a") as table:
        table.write(json.dumps(row) + "\n")


def render(rows: Sequence[dict[str, str]]) -> str:
    """The rows as Markdown tables, one per section, in the order of ``COLUMNS``."""
    out: list[str] = []
    for section, (first, second) in COLUMNS.items():
        mine = [row for row in rows if row["section"] == section]
        if not mine:
            continue
        out += [f"### {section}", "", f"| {first} | {second} |", "|---|---|"]
        out += [f"| {row['case']} | {row['result']} |" for row in mine]
        out.append("")
    return "\n".join(out)


def rewrite(page: Path, rows: Sequence[dict[str, str]]) -> None:
    """Replace what stands between the markers of ``page`` with the rendered rows."""
    text = page.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:start] + "\n\n" + render(rows) + "\n" + text[end:])


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.reliability ROWS PAGE", file=sys.stderr)
        return 2
    lines = Path(argv[0]).read_text().splitlines()
    rewrite(Path(argv[1]), [json.loads(line) for line in lines if line.strip()])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
