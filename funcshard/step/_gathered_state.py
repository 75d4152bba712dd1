"""A state whose units stay gathered across calls: accumulation without regathering.

[Note: keeping units gathered]
Each `fs.call` of a state gathers every unit it runs (and, resharded after forward, again in
backward), so accumulating over k micro-batches all-gathers every unit k or 2k times per
step. FSDP2 avoids that with `set_reshard_after_backward(False)`, a flag on the module. Here
it is a value: `kept = fs.keep_gathered(state)` all-gathers every flat buffer once and
returns a GatheredState, a ShardedState that also holds those gathered buffers. A call of it
takes its units from them (its gathers are handed the finished all-gather as their source,
so they are the same differentiable op, with the same backward) and never reshards, so
every `fs.value_and_grad(f, reduce=False)(kept, ...)` after it communicates nothing until
the one `fs.reduce` of the accumulated gradients.

The price is memory: the whole model's parameters gathered (in the gather dtype) for as long
as `kept` lives, plus, with `reduce=False`, the full-size gradients. A GatheredState is for
computing gradients: `replace` of its shards (an optimizer update, `fs.apply_updates`) gives
a plain ShardedState, so stale gathered buffers can never feed a later step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from funcshard.core._state import ShardedState, donatable, ensure_live
from funcshard.core._tree import register_record
from funcshard.step import _gather as gather
from funcshard.step._gather_spec import specs_and_sinks


@dataclass(frozen=True, eq=False)
class GatheredState(ShardedState):
    """A ShardedState plus every flat buffer gathered (`gathered[i]`: the padded full buffer
    of `layout.flats[i]`, in its gather dtype). See [Note: keeping units gathered]."""

    gathered: tuple[Tensor, ...] = ()

    def replace(self, **changes: Any) -> ShardedState:
        """A copy with some fields changed: a plain ShardedState once the shards change."""
        ensure_live(self, "GatheredState.replace")
        if "shards" not in changes:
            return dataclasses.replace(self, **changes)
        return ShardedState(**{**_state_fields(self), **changes})


register_record(
    GatheredState,
    data_fields=("shards", "replicated", "buffers", "gathered"),
    meta_fields=("layout", "mp", "reshard_after_forward", "offload"),
)
donatable(GatheredState, ("shards", "replicated", "buffers", "gathered"))


def keep_gathered(state: ShardedState) -> GatheredState:
    """`state` with every unit gathered once and kept (see [Note: keeping units gathered]):
    calls of it gather nothing, and it is never resharded. Communicates: one all-gather over
    the shard axis per flat buffer, all issued before the first is waited for."""
    ensure_live(state, "keep_gathered")
    if isinstance(state, GatheredState):
        return state
    specs, _ = specs_and_sinks(state)
    pending = [gather.issue_gather(s, spec) for s, spec in zip(state.shards, specs, strict=True)]
    fields = {**_state_fields(state), "reshard_after_forward": False}
    return GatheredState(**fields, gathered=tuple(p.wait() for p in pending))


def _state_fields(state: ShardedState) -> dict[str, Any]:
    """The fields a plain ShardedState has, taken from `state`."""
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(ShardedState)}
