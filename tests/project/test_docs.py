"""docs/ names only tests that exist: every `tests/<wing>/test_x.py::test_name` in any page
under docs/, subfolders included, and every `::test_name` that follows one in the same page
(a second test of the file named just before)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
NAMED = re.compile(r"`((?:tests|property_tests)/(?:\w+/)*\w+\.py)::(\w+)`|`::(\w+)`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def _named() -> list[tuple[str, str, str]]:
    """(page, test file, test name) for every test the docs name."""
    named = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        last = None
        for path, test, follower in NAMED.findall(page.read_text()):
            if path:
                last = path
            if last is not None:
                named.append((str(page.relative_to(ROOT)), last, test or follower))
    return named


def test_every_test_named_in_docs_exists():
    named = _named()
    assert named
    missing = [
        f"{page}: {f}::{t}"
        for page, f, t in named
        if not (ROOT / f).is_file() or t not in _test_names(ROOT / f)
    ]
    assert not missing, missing


def test_the_docs_subfolders_are_scanned():
    pages = {page.split("/")[1] for page, _, _ in _named()}
    assert "guides" in pages, pages
