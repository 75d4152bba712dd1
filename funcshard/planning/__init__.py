"""Memory and communication of a plan, per rank, from a dry run on the meta device.

May import: io, compiling, optim, step, init, core, comm.
"""

from funcshard.planning._estimate import Estimate as Estimate
from funcshard.planning._estimate import estimate as estimate

__all__ = [
    "Estimate",
    "estimate",
]
