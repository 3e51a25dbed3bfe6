"""How big each part of Switchyard is: lines of code per package, and for the picker's core.

``python -m bench.lines [PATH ...]`` prints, for each package (or each
``PATH`` given: files or folders), its files, total lines and *code lines*:
lines that hold code, not counting blank lines, comments and docstrings
(any string standing alone as a statement, which is how this code documents
modules, classes, functions and attributes). Tests are not counted.

The "core" row is what a learner reads to understand a conformant endpoint
picker and BBR: the list ``core`` in ``pyproject.toml``'s ``[tool.switchyard]``,
the one place it is defined (``CORE``), which is exactly the two stream
handlers and what of the project they import (``imported``). The
filter/scorer pipeline plugs into the picker's core and is counted apart.
``docs/hooks.md`` quotes these figures; rerun this to check them.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent

CORE: Final[tuple[str, ...]] = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["switchyard"]["core"]
)
"""The core's files, in reading order (``pyproject.toml``, ``[tool.switchyard] core``)."""

HANDLERS: Final = ("bbr/server.py", "lwepp/server.py")
"""The two stream handlers the core is the reading of."""

GROUPS: Final[Sequence[tuple[str, Sequence[str]]]] = (
    ("plugin_api (shared vocabulary)", ("plugin_api",)),
    ("wire (messages, exchange, stream)", ("wire",)),
    ("serving (server, flags, TLS, logs)", ("serving",)),
    ("pods (pod list)", ("pods",)),
    ("bbr", ("bbr",)),
    ("lwepp", ("lwepp",)),
    ("onehop", ("onehop",)),
    (f"core ({len(CORE)} files: pyproject.toml's [tool.switchyard] core)", CORE),
    (
        "pipeline layer: contracts, pipeline, explain, config, router_compat, attributes, body, "
        "plugins",
        (
            "lwepp/contracts.py",
            "lwepp/pipeline.py",
            "lwepp/explain.py",
            "lwepp/config.py",
            "lwepp/router_compat.py",
            "lwepp/attributes.py",
            "lwepp/body.py",
            "lwepp/plugins",
        ),
    ),
)
"""What ``python -m bench.lines`` counts with no arguments: each row's paths, from the top."""


@dataclass(frozen=True, slots=True)
class Count:
    files: int
    lines: int
    code: int

    def __add__(self, other: Count) -> Count:
        return Count(self.files + other.files, self.lines + other.lines, self.code + other.code)


def code_lines(source: str) -> int:
    """Lines of ``source`` holding code: no blank lines, comments or docstrings."""
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            prose.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    code: set[int] = set()
    ignored = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in ignored and token.type != tokenize.ENDMARKER:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - prose)


def python_files(path: Path) -> Iterable[Path]:
    if path.is_file():
        yield path
    else:
        yield from sorted(p for p in path.rglob("*.py") if "tests" not in p.parts)


def count(paths: Iterable[str], root: Path = ROOT) -> Count:
    """Files, lines and code lines of the Python files under ``paths`` (relative to ``root``)."""
    total = Count(0, 0, 0)
    for name in paths:
        for file in python_files(root / name):
            text = file.read_text()
            total += Count(1, len(text.splitlines()), code_lines(text))
    return total


def imported(start: Iterable[str], root: Path = ROOT) -> list[str]:
    """``start`` and every file of the project it imports, directly or not, as paths from
    ``root``, sorted: the files one must read to follow ``start``. ``from package import
    module`` reads the module, not the package's ``__init__``."""

    def source(module: str) -> str | None:
        base = root / module.replace(".", "/")
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return str(candidate.relative_to(root))
        return None

    seen: set[str] = set()
    todo = list(start)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse((root / path).read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                found = [source(name) for name in names]
                if not all(found):  # some names are attributes of the module itself
                    found.append(source(node.module))
            elif isinstance(node, ast.Import):
                found = [source(alias.name) for alias in node.names]
            else:
                continue
            todo += [file for file in found if file is not None]
    return sorted(seen)


def table(rows: Sequence[tuple[str, Count]]) -> str:
    lines = ["| part | files | lines | code lines |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {c.files} | {c.lines:,} | {c.code:,} |" for name, c in rows]
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    if argv:
        rows = [(name, count([name], Path.cwd())) for name in argv]
    else:
        rows = [(name, count(paths)) for name, paths in GROUPS if (ROOT / paths[0]).exists()]
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
