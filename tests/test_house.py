"""The house's walls: every import arrow points down.

A service never imports another service; the one hop, above both, uses only
what ``bbr`` and ``lwepp`` list as their API; the simulator, which stands in for
the engines the services are tested against, imports nothing of them; and no
package reaches into a ``__main__`` module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import bbr
import lwepp

ROOT = Path(__file__).resolve().parent.parent


def imports(package: str) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Each (file, module, names) one of ``package``'s files imports (names empty: the
    module itself)."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = str(path.relative_to(ROOT))
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                yield where, node.module, tuple(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield where, alias.name, ()


def top(module: str) -> str:
    return module.partition(".")[0]


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("lwepp", {"bbr", "onehop", "simulator", "demo", "bench", "conformance"}),
        ("bbr", {"lwepp", "onehop", "simulator", "demo", "bench", "conformance"}),
        ("simulator", {"lwepp", "bbr", "onehop", "demo", "bench", "conformance"}),
        ("wire", {"lwepp", "bbr", "onehop", "serving", "pods", "simulator"}),
        ("serving", {"lwepp", "bbr", "onehop", "simulator"}),
        ("plugin_api", {"lwepp", "bbr", "onehop", "serving", "pods", "wire", "simulator"}),
        ("pods", {"lwepp", "bbr", "onehop", "simulator"}),
        ("blockhash", {"lwepp", "bbr", "onehop", "serving", "pods", "wire", "simulator"}),
    ],
)
def test_no_arrow_points_up_or_across(package: str, forbidden: set[str]) -> None:
    """``package`` imports none of the packages beside or above it."""
    crossing = [(f, m) for f, m, _ in imports(package) if top(m) in forbidden]
    assert crossing == []


def test_nothing_imports_a_main_module() -> None:
    """A command line is an end, not an API: no package of the services imports one."""
    packages = ("lwepp", "bbr", "onehop", "serving", "wire", "pods", "plugin_api", "simulator")
    mains = [(f, m) for p in packages for f, m, _ in imports(p) if m.endswith("__main__")]
    assert mains == []


def test_the_one_hop_uses_only_the_services_listed_apis() -> None:
    """``onehop`` imports from ``bbr`` and ``lwepp`` only the names each package's
    ``__all__`` lists, from the package itself, never one of their modules."""
    apis = {"bbr": set(bbr.__all__), "lwepp": set(lwepp.__all__)}
    used = [(f, m, names) for f, m, names in imports("onehop") if top(m) in apis]
    assert used, "the one hop builds on both services"
    for where, module, names in used:
        assert module in apis, f"{where} reaches into {module}"
        assert set(names) <= apis[module], f"{where}: {set(names) - apis[module]}"
