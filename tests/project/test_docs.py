"""docs/ names only tests that exist."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_test_named_in_docs_exists():
    named = re.findall(r"`((?:tests|property_tests)/\w+/\w+\.py)::(\w+)`", _docs())
    assert named
    missing = [f"{f}::{t}" for f, t in named if t not in _test_names(ROOT / f)]
    assert not missing, missing


def _docs() -> str:
    return "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
