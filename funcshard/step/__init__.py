"""The sharded training step: gather, call, differentiate, reduce; and the transforms
between a model, its full parameters and its sharded state.

May import: init, core, comm.
"""

from funcshard.step._autodiff import accumulate as accumulate
from funcshard.step._autodiff import grad as grad
from funcshard.step._autodiff import value_and_grad as value_and_grad
from funcshard.step._carry import carry_zeros as carry_zeros
from funcshard.step._finite import NonFiniteError as NonFiniteError
from funcshard.step._finite import NonFiniteWarning as NonFiniteWarning
from funcshard.step._gathered_state import GatheredState as GatheredState
from funcshard.step._gathered_state import keep_gathered as keep_gathered
from funcshard.step._metrics import global_norm as global_norm
from funcshard.step._metrics import pmean as pmean
from funcshard.step._metrics import psum as psum
from funcshard.step._reduction import reduce as reduce
from funcshard.step._replicate import replicate as replicate
from funcshard.step._sharded_call import call as call
from funcshard.step._sharding import shard as shard
from funcshard.step._state_dict import from_state_dict as from_state_dict
from funcshard.step._state_dict import full_state_dict as full_state_dict
from funcshard.step._unit_gathers import Prefetch as Prefetch
from funcshard.step._unsharding import reshard as reshard
from funcshard.step._unsharding import unshard as unshard
from funcshard.step._unsharding import unshard_async as unshard_async
from funcshard.step._zero_start import StuckAtZeroWarning as StuckAtZeroWarning

__all__ = [
    "GatheredState",
    "NonFiniteError",
    "NonFiniteWarning",
    "Prefetch",
    "StuckAtZeroWarning",
    "accumulate",
    "call",
    "carry_zeros",
    "from_state_dict",
    "full_state_dict",
    "global_norm",
    "grad",
    "keep_gathered",
    "pmean",
    "psum",
    "reduce",
    "replicate",
    "reshard",
    "shard",
    "unshard",
    "unshard_async",
    "value_and_grad",
]
