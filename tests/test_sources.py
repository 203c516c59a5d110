"""The Python sources themselves: no module defines a top-level function or
class twice. A second definition silently replaces the first, so every
caller of the first (or a test of that name) runs the second: the KV-cache
suite once lost 79 cases so, each failing on arguments meant for the other."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("mha_ext", "tests", "bench", "scripts", "examples") for p in (ROOT / d).rglob("*.py"))


def redefinitions(source):
    """(name, first line, second line) of each top-level def / class defined
    again at the top level of source."""
    seen, again = {}, []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                again.append((node.name, seen[node.name], node.lineno))
            seen[node.name] = node.lineno
    return again


def test_the_check_finds_a_redefinition():
    src = "def f(a):\n    return a\n\n\nclass C:\n    pass\n\n\ndef f(a, b):\n    return b\n"
    assert redefinitions(src) == [("f", 1, 9)]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_top_level_name_defined_twice(path):
    assert redefinitions(path.read_text()) == []
