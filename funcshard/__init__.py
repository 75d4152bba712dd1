"""funcshard: data-parallel sharding (FSDP, DDP, HSDP) for PyTorch, as pure functions on pytrees."""

from funcshard import checkpoint as checkpoint
from funcshard import host_memory as host_memory
from funcshard import optim as optim
from funcshard import policy as policy
from funcshard import testing as testing
from funcshard.autodiff import accumulate as accumulate
from funcshard.autodiff import grad as grad
from funcshard.autodiff import value_and_grad as value_and_grad
from funcshard.carry import carry_zeros as carry_zeros
from funcshard.comm import Comm as Comm
from funcshard.comm import MeshAxis as MeshAxis
from funcshard.estimate import Estimate as Estimate
from funcshard.estimate import estimate as estimate
from funcshard.failfast import fail_fast as fail_fast
from funcshard.failures import CollectiveError as CollectiveError
from funcshard.finite import NonFiniteError as NonFiniteError
from funcshard.gathered_state import GatheredState as GatheredState
from funcshard.gathered_state import keep_gathered as keep_gathered
from funcshard.integrity import CheckpointCorrupted as CheckpointCorrupted
from funcshard.jit import compile as compile
from funcshard.layout import FlatLayout as FlatLayout
from funcshard.layout import Layout as Layout
from funcshard.leaves import tree_map as tree_map
from funcshard.materialize import skip as skip
from funcshard.materialize import whole_model as whole_model
from funcshard.mesh import Mesh as Mesh
from funcshard.mesh import shutdown as shutdown
from funcshard.metrics import global_norm as global_norm
from funcshard.metrics import pmean as pmean
from funcshard.metrics import psum as psum
from funcshard.module import extract as extract
from funcshard.optim_params import apply_updates as apply_updates
from funcshard.plan import Plan as Plan
from funcshard.plan import Unit as Unit
from funcshard.plan import plan as plan
from funcshard.precision import MixedPrecision as MixedPrecision
from funcshard.reduction import reduce as reduce
from funcshard.replicate import replicate as replicate
from funcshard.rng import fold_in as fold_in
from funcshard.rng import manual_seed as manual_seed
from funcshard.rng import rank_generator as rank_generator
from funcshard.rng import rank_seed as rank_seed
from funcshard.sharded_call import call as call
from funcshard.sharding import shard as shard
from funcshard.split import Bucket as Bucket
from funcshard.split import SplitGraph as SplitGraph
from funcshard.split import split as split
from funcshard.state import DonatedError as DonatedError
from funcshard.state import LocalGrads as LocalGrads
from funcshard.state import ShardedGrads as ShardedGrads
from funcshard.state import ShardedState as ShardedState
from funcshard.state_dict import from_state_dict as from_state_dict
from funcshard.state_dict import full_state_dict as full_state_dict
from funcshard.trace import trace as trace
from funcshard.unit_gathers import Prefetch as Prefetch
from funcshard.unsharding import reshard as reshard
from funcshard.unsharding import unshard as unshard
from funcshard.unsharding import unshard_async as unshard_async

__all__ = [
    "Bucket",
    "CheckpointCorrupted",
    "CollectiveError",
    "Comm",
    "DonatedError",
    "Estimate",
    "FlatLayout",
    "GatheredState",
    "Layout",
    "LocalGrads",
    "Mesh",
    "MeshAxis",
    "MixedPrecision",
    "NonFiniteError",
    "Plan",
    "Prefetch",
    "ShardedGrads",
    "ShardedState",
    "SplitGraph",
    "Unit",
    "accumulate",
    "apply_updates",
    "call",
    "carry_zeros",
    "checkpoint",
    "compile",
    "estimate",
    "extract",
    "fail_fast",
    "fold_in",
    "from_state_dict",
    "full_state_dict",
    "global_norm",
    "grad",
    "host_memory",
    "keep_gathered",
    "manual_seed",
    "optim",
    "plan",
    "pmean",
    "policy",
    "psum",
    "rank_generator",
    "rank_seed",
    "reduce",
    "replicate",
    "reshard",
    "shard",
    "shutdown",
    "split",
    "testing",
    "trace",
    "tree_map",
    "unshard",
    "unshard_async",
    "value_and_grad",
]
__version__ = "0.1.0"
