"""The line counter behind the docs' size figures, and the figure the docs quote."""

from __future__ import annotations

import re
from pathlib import Path

from bench.lines import code_lines, count

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


def test_hooks_doc_quotes_the_cores_size_as_counted_now() -> None:
    """``docs/hooks.md`` states the core's code lines; they match ``python -m bench.lines``."""
    text = (ROOT / "docs" / "hooks.md").read_text()
    quoted = re.search(r"the core's (\d+) code lines", text)
    assert quoted is not None
    assert int(quoted[1]) == count(["lwepp/server.py", "lwepp/picking.py"]).code
