"""The README's Python examples run as written (each as a script, as a user would)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"readme_example_{index}.py"
    script.write_text(BLOCKS[index])
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
