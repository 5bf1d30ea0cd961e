"""Every assertion of the public tests says what it checks: a student who sees it fail reads the contract it
enforces (and the stub docstring or handout where that contract is written), not a bare ``assert a == b``.

A static scan (AST) of tests/public: each ``assert`` statement carries a message. The hidden tests are held
to the same rule, since their messages reach students once grades are published.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.staff


def bare_asserts(folder: Path) -> list[str]:
    """``file:line: condition`` for every assert statement under ``folder`` that has no message."""
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assert) and node.msg is None:
                out.append(f"{path.name}:{node.lineno}: assert {ast.unparse(node.test)[:80]}")
    return out


@pytest.mark.parametrize("folder", ["tests/public", "tests/hidden"])
def test_every_assertion_names_its_contract(folder):
    bare = bare_asserts(ROOT / folder)
    assert not bare, ("assertions without a message (say which contract failed, in the student's words):\n  "
                      + "\n  ".join(bare))


def test_the_scan_finds_a_bare_assert(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_a():\n    assert 1 == 1, 'named'\n    assert 2 == 2\n")
    assert bare_asserts(tmp_path) == ["test_x.py:3: assert 2 == 2"], \
        f"the scan must report exactly the bare assert on line 3, got {bare_asserts(tmp_path)}"
