"""The `funcshard` command: plan, check, demo, verify (`python -m funcshard --help`); `demo`
is also the examples' small GPT, its data and its loss.

May import: every other wing and testing.
"""

from funcshard.cli import _demo as demo
from funcshard.cli._main import main as main

__all__ = ["demo", "main"]
