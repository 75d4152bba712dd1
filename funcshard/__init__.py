"""funcshard: data-parallel sharding (FSDP, DDP, HSDP) for PyTorch, as pure functions on pytrees."""

import importlib
import sys

from funcshard import optim as optim
from funcshard import testing as testing
from funcshard.comm import CollectiveError as CollectiveError
from funcshard.comm import Comm as Comm
from funcshard.comm import Mesh as Mesh
from funcshard.comm import MeshAxis as MeshAxis
from funcshard.comm import fail_fast as fail_fast
from funcshard.comm import shutdown as shutdown
from funcshard.compiling import Bucket as Bucket
from funcshard.compiling import SplitGraph as SplitGraph
from funcshard.compiling import compile as compile
from funcshard.compiling import split as split
from funcshard.compiling import trace as trace
from funcshard.core import DonatedError as DonatedError
from funcshard.core import FlatLayout as FlatLayout
from funcshard.core import Layout as Layout
from funcshard.core import LocalGrads as LocalGrads
from funcshard.core import MixedPrecision as MixedPrecision
from funcshard.core import Plan as Plan
from funcshard.core import ShardedGrads as ShardedGrads
from funcshard.core import ShardedState as ShardedState
from funcshard.core import UngatheredParameterError as UngatheredParameterError
from funcshard.core import Unit as Unit
from funcshard.core import UnitOptions as UnitOptions
from funcshard.core import _policy as policy
from funcshard.core import extract as extract
from funcshard.core import fold_in as fold_in
from funcshard.core import manual_seed as manual_seed
from funcshard.core import plan as plan
from funcshard.core import rank_generator as rank_generator
from funcshard.core import rank_seed as rank_seed
from funcshard.init import deferred_init as deferred_init
from funcshard.init import skip as skip
from funcshard.init import whole_model as whole_model
from funcshard.io import CheckpointCorrupted as CheckpointCorrupted
from funcshard.io import _checkpoint as checkpoint
from funcshard.io import refreeze as refreeze
from funcshard.optim import apply_updates as apply_updates
from funcshard.optim import tree_map as tree_map
from funcshard.planning import Estimate as Estimate
from funcshard.planning import estimate as estimate
from funcshard.step import GatheredState as GatheredState
from funcshard.step import NonFiniteError as NonFiniteError
from funcshard.step import NonFiniteWarning as NonFiniteWarning
from funcshard.step import Prefetch as Prefetch
from funcshard.step import StuckAtZeroWarning as StuckAtZeroWarning
from funcshard.step import _host_memory as host_memory
from funcshard.step import accumulate as accumulate
from funcshard.step import call as call
from funcshard.step import carry_zeros as carry_zeros
from funcshard.step import from_state_dict as from_state_dict
from funcshard.step import full_state_dict as full_state_dict
from funcshard.step import global_norm as global_norm
from funcshard.step import grad as grad
from funcshard.step import keep_gathered as keep_gathered
from funcshard.step import pmean as pmean
from funcshard.step import psum as psum
from funcshard.step import reduce as reduce
from funcshard.step import replicate as replicate
from funcshard.step import reshard as reshard
from funcshard.step import shard as shard
from funcshard.step import unshard as unshard
from funcshard.step import unshard_async as unshard_async
from funcshard.step import value_and_grad as value_and_grad

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
    "NonFiniteWarning",
    "Plan",
    "Prefetch",
    "ShardedGrads",
    "ShardedState",
    "SplitGraph",
    "StuckAtZeroWarning",
    "UngatheredParameterError",
    "Unit",
    "UnitOptions",
    "accumulate",
    "apply_updates",
    "call",
    "carry_zeros",
    "checkpoint",
    "compile",
    "deferred_init",
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
    "refreeze",
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

# [Note: the old flat module paths]
# Until the wings, every module sat in funcshard/ itself, and users' code imports some
# of them by path (`funcshard.collectives.record`, `from funcshard.compiled_schedule
# import reshard_backend`). Each moved module is registered under its old name too, so
# those imports get the very module object the wings use (one module, not a copy).
_OLD_PATHS = {
    "apply_init": "funcshard.init._apply_init",
    "attention_kernels": "funcshard.planning._attention_kernels",
    "autodiff": "funcshard.step._autodiff",
    "binding": "funcshard.core._binding",
    "chaos": "funcshard.comm._chaos",
    "check_command": "funcshard.cli._check_command",
    "checkpoint": "funcshard.io._checkpoint",
    "checkpoint_dict": "funcshard.io._checkpoint_dict",
    "checkpoint_dir": "funcshard.io._checkpoint_dir",
    "checkpoint_match": "funcshard.io._checkpoint_match",
    "collectives": "funcshard.comm._collectives",
    "compiled": "funcshard.step._compiled",
    "compiled_schedule": "funcshard.compiling._compiled_schedule",
    "demo": "funcshard.cli._demo",
    "donation": "funcshard.core._donation",
    "dryrun": "funcshard.planning._dryrun",
    "estimate": "funcshard.planning._estimate",
    "failfast": "funcshard.comm._failfast",
    "finite": "funcshard.step._finite",
    "flight_recorder": "funcshard.comm._flight_recorder",
    "gather": "funcshard.step._gather",
    "gathered_state": "funcshard.step._gathered_state",
    "gc_pause": "funcshard.step._gc_pause",
    "groups": "funcshard.core._groups",
    "hf": "funcshard.io._hf",
    "hf_save": "funcshard.io._hf_save",
    "host_memory": "funcshard.step._host_memory",
    "inplace": "funcshard.step._inplace",
    "integrity": "funcshard.io._integrity",
    "jit": "funcshard.compiling._jit",
    "layout": "funcshard.core._layout",
    "leaves": "funcshard.optim._leaves",
    "loading": "funcshard.cli._loading",
    "materialize": "funcshard.init._materialize",
    "mesh": "funcshard.comm._mesh",
    "meta_predicates": "funcshard.planning._meta_predicates",
    "meta_step": "funcshard.planning._meta_step",
    "metabytes": "funcshard.planning._metabytes",
    "metrics": "funcshard.step._metrics",
    "mixed_reduction": "funcshard.optim._mixed_reduction",
    "module": "funcshard.core._module",
    "muon": "funcshard.optim._muon",
    "optim_leaves": "funcshard.io._optim_leaves",
    "owned": "funcshard.optim._owned",
    "owners": "funcshard.optim._owners",
    "plan": "funcshard.core._plan",
    "policy": "funcshard.core._policy",
    "precision": "funcshard.core._precision",
    "progress": "funcshard.comm._progress",
    "rank_values": "funcshard.io._rank_values",
    "recompute": "funcshard.core._recompute",
    "regather": "funcshard.step._regather",
    "replicate": "funcshard.step._replicate",
    "rng": "funcshard.core._rng",
    "segments": "funcshard.optim._segments",
    "sharded_call": "funcshard.step._sharded_call",
    "split": "funcshard.compiling._split",
    "state": "funcshard.core._state",
    "trace": "funcshard.compiling._trace",
    "tree": "funcshard.core._tree",
    "waits": "funcshard.comm._waits",
    "whole_params": "funcshard.optim._whole_params",
}
for _old, _new in _OLD_PATHS.items():
    _module = importlib.import_module(_new)
    sys.modules[f"{__name__}.{_old}"] = _module
    if _old not in globals():  # fs.estimate, fs.split... stay the functions
        globals()[_old] = _module
del _old, _new, _module

