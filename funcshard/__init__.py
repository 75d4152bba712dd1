"""funcshard: data-parallel sharding (FSDP, DDP, HSDP) for PyTorch, as pure functions on pytrees."""

from funcshard import policy as policy
from funcshard import testing as testing
from funcshard.mesh import Mesh as Mesh
from funcshard.mesh import shutdown as shutdown
from funcshard.module import call as call
from funcshard.module import extract as extract
from funcshard.plan import Plan as Plan
from funcshard.plan import Unit as Unit
from funcshard.plan import plan as plan

__all__ = [
    "Mesh",
    "Plan",
    "Unit",
    "call",
    "extract",
    "plan",
    "policy",
    "shutdown",
    "testing",
]
__version__ = "0.1.0"
