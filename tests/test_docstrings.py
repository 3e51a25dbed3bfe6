"""Every test says what behaviour it pins, in its docstring."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def undocumented(source: str) -> list[str]:
    """The module-level ``test_*`` functions (and ``Test*`` methods) of ``source`` with no
    docstring."""
    found = []
    for node in ast.parse(source).body:
        functions = node.body if isinstance(node, ast.ClassDef) else [node]
        for function in functions:
            if (
                isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
                and function.name.startswith("test_")
                and not ast.get_docstring(function)
            ):
                found.append(f"{function.name} (line {function.lineno})")
    return found


def test_every_test_has_a_docstring_naming_the_behaviour_it_pins() -> None:
    """No test function in tests/ lacks a docstring."""
    missing = {
        path.name: names
        for path in sorted(TESTS.glob("test_*.py"))
        if (names := undocumented(path.read_text()))
    }
    assert missing == {}


def test_the_check_sees_a_test_without_a_docstring() -> None:
    """The scan finds a bare test, at module level and in a class, and passes documented ones."""
    source = (
        "def test_a():\n    pass\n"
        'def test_b():\n    """Pins b."""\n'
        "class TestC:\n    def test_c(self):\n        pass\n"
        "def helper():\n    pass\n"
    )
    assert undocumented(source) == ["test_a (line 1)", "test_c (line 6)"]
