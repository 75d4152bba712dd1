"""torch.compile for funcshard steps: tracing, splitting into buckets, and the pass
that schedules and reshards the collectives of a compiled graph.

May import: optim, step, init, core, comm.
"""

from funcshard.compiling._compiled_schedule import reshard_backend as reshard_backend
from funcshard.compiling._jit import compile as compile
from funcshard.compiling._split import Bucket as Bucket
from funcshard.compiling._split import SplitGraph as SplitGraph
from funcshard.compiling._split import split as split
from funcshard.compiling._trace import trace as trace

__all__ = [
    "Bucket",
    "SplitGraph",
    "compile",
    "reshard_backend",
    "split",
    "trace",
]
