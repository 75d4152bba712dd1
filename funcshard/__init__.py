"""funcshard: data-parallel sharding (FSDP, DDP, HSDP) for PyTorch, as pure functions on pytrees."""

from funcshard import testing as testing
from funcshard.mesh import Mesh as Mesh
from funcshard.mesh import shutdown as shutdown
from funcshard.module import call as call
from funcshard.module import extract as extract

__all__ = ["Mesh", "call", "extract", "shutdown", "testing"]
__version__ = "0.1.0"
