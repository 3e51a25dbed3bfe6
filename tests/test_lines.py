"""The line counter behind the docs' size figures, and the figure the docs quote."""

from __future__ import annotations

import re
from pathlib import Path

from bench.lines import CORE, HANDLERS, code_lines, count, imported

ROOT = Path(__file__).resolve().parent.parent


def test_code_lines_leave_out_blank_lines_comments_and_docstrings() -> None:
    """Only lines holding code count; a string statement anywhere is documentation."""
    source = '''"""Module docstring,
over two lines."""

import os  # a comment after code counts as code


class A:
    """Class docstring."""

    x: int = 1
    """An attribute's docstring."""

    def f(self) -> str:
        # a comment alone
        return (
            "a string inside code is code"
        )
'''
    assert code_lines(source) == 7


def test_the_core_is_what_the_two_stream_handlers_read() -> None:
    """The core, defined once (``pyproject.toml``), is exactly BBR's and the picker's stream
    handlers and every project file they import: nothing a learner must read is left out,
    and nothing else is in."""
    assert sorted(CORE) == imported(HANDLERS)
    assert len(set(CORE)) == len(CORE)


def test_the_readme_lists_the_core_in_its_reading_order() -> None:
    """The README's "Read these first" names the core's files, each once, in the core's order."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Read these first") :]
    section = section[: section.index("\n### ", 1)]
    listed = re.findall(r"`([a-z_/]+\.py)`", section)
    assert listed == list(CORE)


def test_hooks_doc_quotes_the_cores_size_as_counted_now() -> None:
    """``docs/hooks.md`` states the core's files and code lines, and the picker's part of them;
    they match ``python -m bench.lines``."""
    text = (ROOT / "docs" / "hooks.md").read_text()
    picker = re.search(r"of the picker's (\d+) code lines in the core", text)
    core = re.search(r"the (\d+) files \(([\d,]+) code lines\) a learner reads", text)
    assert picker is not None
    assert core is not None
    assert int(picker[1]) == count(["lwepp/server.py", "lwepp/picking.py"]).code
    assert (int(core[1]), int(core[2].replace(",", ""))) == (len(CORE), count(CORE).code)
