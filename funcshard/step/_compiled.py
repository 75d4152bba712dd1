"""Sharded calls while torch.compile traces them.

[Note: the step under torch.compile]
Eagerly, `funcshard.call` gathers each unit from module hooks (see [Note: per-unit
gathering]). Dynamo cannot trace hooks installed per call, and it need not: in a traced step
the schedule is the compiler's to choose. So while dynamo traces, `call` gathers every flat
buffer of the state through the same differentiable gather the eager call uses
(`funcshard.step._gather.gather`, whose backward is the reduce; see [Note: one differentiable
gather]) and runs the model on the gathered parameters through the params-dict path
(`funcshard.core._module.call`). `funcshard.value_and_grad` is the same code eagerly and traced:
`torch.autograd.grad` of the loss with respect to the shards.

So the units' compute is traced with the shards as graph inputs, the collectives are graph
nodes (torch's functional collectives), and the compiled step is one graph; the optimizer
update, when traced in the same function, joins it. `torch.autograd.grad` is traced only
with `torch._dynamo.config.trace_autograd_ops = True` (off by default in torch); without it
dynamo breaks the graph there once per step, and everything still works. Eager runs never
take this path: `torch.compiler.is_dynamo_compiling()` is a constant False outside dynamo.

Left as traced, each unit would be gathered once, at the start, and its buffers would live
until their last use in backward: the compiled step's peak would hold the whole model
gathered. So each gather runs under `torch.fx.traceback.annotate` (a tag every node traced
inside it carries, its backward's too), and funcshard.compiled_schedule's pass, which
`funcshard.compile` runs on the step's graph, moves each gather to its first use, regathers
resharding units in backward and reduces each gradient as soon as it is complete (see
[Note: resharding a compiled step]); with an int `reshard_after_forward` k, backward
regathers from groups of k ranks the 1/k slice each kept, as eagerly. `offload` does not
apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from funcshard.comm._comm import Comm
from funcshard.core import _precision as precision
from funcshard.core._module import call as call_on_dict
from funcshard.core._state import ShardedState
from funcshard.step import _gather as gather
from funcshard.step._gather_spec import specs_and_sinks

GATHER = "funcshard_gather"  # the meta["custom"] key of a gather's nodes: (index, unit, reshard)


def full_params(state: ShardedState, comm: Comm | None = None) -> dict[str, Tensor]:
    """Every parameter of the state, gathered differentiably, by FQN (with the replicated)."""
    specs, sinks = specs_and_sinks(state, comm)
    params: dict[str, Tensor] = dict(state.replicated)
    reshard = reshard_mark(state)
    for index, (shard, spec, sink) in enumerate(zip(state.shards, specs, sinks, strict=True)):
        # the root unit (named "") runs around the whole call: kept, as eagerly
        mark = (index, spec.flat.unit, reshard if spec.flat.unit != "" else False)
        with torch.fx.traceback.annotate({GATHER: mark}):  # see compiled_schedule
            full = gather.gather(shard, spec, sink=sink)
        params.update(zip(spec.flat.fqns, full, strict=True))
    return params


def reshard_mark(state: ShardedState) -> bool | int:
    """How the compiled step reshards the state's units after forward: not at all (False),
    over the whole shard axis (True) or to k ranks (an int below the shard size), as the
    eager step does."""
    k = state.reshard_after_forward
    if isinstance(k, bool) or k >= state.layout.mesh.shard_size:
        return k is not False
    return k


def call(
    model: nn.Module,
    state: ShardedState,
    args: tuple,
    kwargs: dict,
    buffers: Mapping[str, Tensor] | None,
    mutable: bool,
    method: str,
    comm: Comm | None = None,
) -> Any:
    """`funcshard.call` on a sharded state while dynamo traces (see the note above)."""
    mp = precision.root_policy(state.mp, state.layout.flats)  # the state's, or the root's own
    args, kwargs = precision.cast_inputs(mp, args, kwargs)
    out, new_buffers = call_on_dict(
        model,
        full_params(state, comm),
        *args,
        buffers=state.buffers if buffers is None else buffers,
        mutable=True,
        method=method,
        **kwargs,
    )
    out = precision.cast_outputs(mp, out)
    return (out, new_buffers) if mutable else out
