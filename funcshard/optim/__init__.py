"""Optimizers as pairs of pure functions, `(init, update)`, computed with torch's own math.

[Note: optimizers]
An optimizer is `Optimizer(init, update)` as in optax: `init(params)` builds its state,
`update(grads, opt_state, params)` returns `(updates, new_opt_state)` and writes nothing, and
`apply_updates(params, updates)` adds the updates. The arithmetic follows torch.optim's
single-tensor kernels op for op (`torch.optim.sgd`), or is torch's fused Adam/AdamW kernel
(`torch._fused_adam_`, `_fused_adamw_`, run on a copy of each parameter: one pass over
memory instead of eight), one leaf at a time, so after N steps the parameters match
`torch.optim.SGD/Adam/AdamW` on the same tensors (to rounding of the final addition) and
temporaries never exceed one flat buffer.

Purity costs memory: new moments are built beside the old ones. `update(..., donate=True)`
gives that memory back, as buffer donation does in JAX: the moments are updated in place and
the updates are written into the gradients' buffers, so the caller must not read the old
opt_state or the grads again. With donation a step needs no more memory than torch.optim's
in-place step.

Params are a ShardedState (its flat shards, then its replicated parameters: see [Note: the
optimizer's leaves]) or a dict of tensors; grads are the matching ShardedGrads or dict.
Frozen buffers (None gradients) get None updates and no state. Padding stays zero: zero
gradients and zero parameters give zero moments and zero updates.

The contract for a user's optimizer is the same pair: `init(params)` returns any pytree
(a dataclass registered with `torch.utils._pytree.register_dataclass`, a NamedTuple, a dict,
a list of moments: checkpoints save it whole), and `update(grads, state, params)` returns
`(updates, new_state)` with `updates` of the grads' kind, written leaf by leaf with
`funcshard.tree_map`. It may take `donate=False` (a promise that it may reuse the memory of
`grads` and `state`); without it, it is wrapped to ignore donation. Per-parameter math on
flat shards (trust ratios, masks) goes through `segments` (see [Note: per-parameter views of
a shard]); `masked` and `partition` are masks and parameter groups as in optax.
"""

from funcshard.core._groups import GroupView as GroupView
from funcshard.core._groups import Part as Part  # a GroupView's record, not in __all__
from funcshard.optim._base import EmptyState as EmptyState
from funcshard.optim._base import Optimizer as Optimizer
from funcshard.optim._clipping import clip_by_global_norm as clip_by_global_norm
from funcshard.optim._combinators import ChainState as ChainState
from funcshard.optim._combinators import SkipState as SkipState
from funcshard.optim._combinators import chain as chain
from funcshard.optim._combinators import masked as masked
from funcshard.optim._combinators import skip_nonfinite as skip_nonfinite
from funcshard.optim._kernels import AdamState as AdamState
from funcshard.optim._kernels import SgdState as SgdState
from funcshard.optim._kernels import adam as adam
from funcshard.optim._kernels import adamw as adamw
from funcshard.optim._kernels import sgd as sgd
from funcshard.optim._leaves import leaves as leaves
from funcshard.optim._leaves import tree_map as tree_map
from funcshard.optim._mixed_reduction import (
    MixedParameterReductionWarning as MixedParameterReductionWarning,
)
from funcshard.optim._muon import muon as muon
from funcshard.optim._owned import Owned as Owned
from funcshard.optim._params import apply_updates as apply_updates
from funcshard.optim._params import difference as difference
from funcshard.optim._partition import Labels as Labels
from funcshard.optim._partition import PartitionState as PartitionState
from funcshard.optim._partition import partition as partition
from funcshard.optim._rates import LearningRate as LearningRate
from funcshard.optim._segments import Piece as Piece
from funcshard.optim._segments import Segments as Segments
from funcshard.optim._segments import Where as Where
from funcshard.optim._segments import segments as segments
from funcshard.optim._whole_params import whole_params as whole_params

__all__ = [
    "AdamState",
    "ChainState",
    "EmptyState",
    "GroupView",
    "Labels",
    "LearningRate",
    "MixedParameterReductionWarning",
    "Optimizer",
    "Owned",
    "PartitionState",
    "Piece",
    "Segments",
    "SgdState",
    "SkipState",
    "Where",
    "adam",
    "adamw",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "difference",
    "leaves",
    "masked",
    "muon",
    "partition",
    "segments",
    "sgd",
    "skip_nonfinite",
    "tree_map",
    "whole_params",
]
