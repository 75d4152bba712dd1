"""Writing results down: the machine, the command, the date, and generated sections of a file.

[Note: generated sections]
RESULTS.md mixes prose written by hand (earlier runs, the runner and planner figures) with
sections that scripts write. A script owns only the text between its two markers,
`<!-- NAME:start -->` and `<!-- NAME:end -->`, and rewrites that on every run; everything
outside them is left byte for byte. A file without the markers gets the section appended.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def machine() -> str:
    """CPU model, cores, RAM, OS; Python and torch versions, e.g. for a results header."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return (
        f"{_cpu_model()}, {os.cpu_count()} cores, {ram / 2**30:.1f} GiB RAM, "
        f"{platform.system()} {platform.machine()}; Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command() -> str:
    """The command line this process was started with, runnable from the repository root."""
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    argv[0] = _from_repo(argv[0]) if Path(argv[0]).is_absolute() else argv[0]
    argv[1:] = [_from_repo(a) if a.startswith(str(REPO)) else a for a in argv[1:]]
    return shlex.join(argv)


def _from_repo(path: str) -> str:
    """`path` relative to the repository root when it lies inside it, else as given."""
    try:
        return str(Path(path).relative_to(REPO))
    except ValueError:
        return path


def now() -> str:
    """The date and time in UTC, to the minute."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the text between `name`'s markers in `path` with `body`, or append it.

    See [Note: generated sections].
    """
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if (start in text) != (end in text) or text.find(start) > text.find(end):
        raise ValueError(
            f"{path}: expected both {start} and {end}, in that order, or neither. Restore the "
            f"missing marker by hand."
        )
    if start in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
