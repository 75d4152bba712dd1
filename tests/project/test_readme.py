"""The Python examples of README.md and of every page under docs/ run as written: each
```python block as a script of its own, as a user would run it. Launch commands (torchrun,
multi-node, GPU) are ```bash blocks and excerpts of example files ```py blocks; neither runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


# (test id, code): the id names the file and the block's index in it, e.g.
# "docs/guides/checkpoints.md[0]", so `-k checkpoints` runs one page's blocks
EXAMPLES = [
    (f"{page.relative_to(ROOT)}[{i}]", code)
    for page in PAGES
    for i, code in enumerate(_blocks(page))
]
BLOCKS = _blocks(README)


# README's own blocks (the first sharded step a newcomer runs) are in the quick lane too.
@pytest.mark.parametrize(
    "code",
    [
        pytest.param(c, id=i, marks=[pytest.mark.quick] if i.startswith("README") else [])
        for i, c in EXAMPLES
    ],
)
def test_readme_example_runs(code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]


def test_readme_has_examples():
    assert len(BLOCKS) >= 1
    assert len(EXAMPLES) > len(BLOCKS), "the docs' pages have python examples too"
