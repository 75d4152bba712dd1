"""Tools for testing sharded training code: a multi-rank runner, hypothesis strategies, models."""

from funcshard.chaos import chaos as chaos
from funcshard.testing.runner import RankDied as RankDied
from funcshard.testing.runner import RemoteTraceback as RemoteTraceback
from funcshard.testing.runner import run as run

__all__ = ["RankDied", "RemoteTraceback", "chaos", "run"]
