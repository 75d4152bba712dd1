"""The `funcshard` command: plan, check, demo, verify (`python -m funcshard --help`).

May import: every other wing and testing.
"""

from funcshard.cli._main import main as main

__all__ = ["main"]
