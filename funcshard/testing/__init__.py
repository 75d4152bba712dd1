"""Tools for testing sharded training code: a multi-rank runner, hypothesis strategies, models,
and `check`, which checks the sharding laws on a user's own model (docs/guides/checking.md).

Every submodule is an attribute after `import funcshard as fs`: `fs.testing.compare`,
`.dynamo`, `.memory` and `.models` are imported with the package (they need only torch);
`fs.testing.strategies` is imported on first use, because it needs hypothesis, which only the
test extra installs and which would add ~70 ms to every `import funcshard`.
"""

import importlib
from types import ModuleType

from funcshard.comm._chaos import chaos as chaos
from funcshard.testing import compare as compare
from funcshard.testing import dynamo as dynamo
from funcshard.testing import memory as memory
from funcshard.testing import models as models
from funcshard.testing.check import check as check
from funcshard.testing.process_state import ProcessStateChanged as ProcessStateChanged
from funcshard.testing.rank_errors import RankDied as RankDied
from funcshard.testing.rank_errors import RemoteTraceback as RemoteTraceback
from funcshard.testing.report import LawViolation as LawViolation
from funcshard.testing.report import Report as Report
from funcshard.testing.runner import run as run

__all__ = [
    "LawViolation",
    "ProcessStateChanged",
    "RankDied",
    "RemoteTraceback",
    "Report",
    "chaos",
    "check",
    "run",
]

_LAZY = ("strategies",)


def __getattr__(name: str) -> ModuleType:
    """Import `strategies` when first asked for (see the module docstring)."""
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
