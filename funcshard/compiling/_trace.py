"""Trace a functional training step into one FX graph: `trace(step_fn, *example_args)`.

[Note: tracing a step with make_fx]
`trace` runs the step once under `make_fx` (real tensors, so a multi-rank step really
communicates while it is traced, on every rank alike). make_fx records aten ops below autograd,
so the graph holds the forward, the backward autograd ran for it, and every collective as the
`torch.ops._c10d_functional.*` node that `funcshard.comm._collectives` issued: the hooks, custom
autograd functions and saved-tensor hooks of `funcshard.call` are plain Python that runs at
trace time and leaves only the ops it dispatched. Activation checkpointing (torch.utils.
checkpoint, or a `tag_activation_checkpoint` higher-order op) is inlined the same way: its
recomputation shows up as ordinary ops in backward, which is what lets `funcshard.split`
cut through it (pytorch#104674 is DDPOptimizer meeting such an op unflattened).

make_fx flattens the arguments with torch's pytree and gives the graph a code generator that
takes and returns the original pytrees, so `gm(state, batch)` is called like `step_fn`. The
graph's own `process_inputs`/`process_outputs` do that flattening, and the split graph reuses
them, which keeps the placeholder order make_fx chose the only order anyone relies on.

Which placeholders are parameters (what `funcshard.split` counts into buckets) is decided here,
from the example arguments, and stored on each placeholder's `meta[PARAM_META]` as a `Param`:
- every trainable flat shard of a `ShardedState` anywhere in the arguments, sized as its full
  padded flat buffer (the bytes one reduce-scatter or all-reduce of it moves; on a DDP mesh
  that is the shard itself). Frozen shards, the state's replicated (ignored) parameters and
  its buffers are not reduced, so they are not counted, as DDP ignores them too;
- when no argument holds a ShardedState, the tensors of a dict passed as the first argument
  that require grad (the plain-params form of `funcshard.value_and_grad`), sized as
  themselves.

Arguments may hold tensors and None only: make_fx bakes any other leaf (an int, a float) into
the graph as a constant, and a later call with another value would silently be wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import optree
import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from funcshard.core._state import ShardedState

PARAM_META = "funcshard_param"


@dataclass(frozen=True)
class Param:
    """A placeholder holding parameters that are reduced: what `funcshard.split` counts."""

    name: str  # a flat buffer's `unit[dtype]` name, or an FQN of a plain params dict
    nbytes: int  # bytes one reduction of it moves


def trace(step_fn: Callable[..., Any], *example_args: Any) -> torch.fx.GraphModule:
    """Trace `step_fn(*example_args)` into a GraphModule called exactly like `step_fn`.

    The placeholders are the tensor leaves of the arguments (state shards, batch); the graph
    returns the same output pytree. Parameter placeholders carry a `Param` in
    `node.meta[PARAM_META]`. See [Note: tracing a step with make_fx].
    Communicates: whatever `step_fn` does, once, while tracing (call it on every rank).
    """
    if not callable(step_fn):
        raise TypeError(f"funcshard.trace: step_fn must be callable, got {type(step_fn).__name__}.")
    _check_leaves(example_args)
    gm = make_fx(step_fn)(*example_args)
    params = _params_by_id(example_args)
    leaves = gm.graph.process_inputs(*example_args)
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, leaf in zip(placeholders, leaves, strict=True):
        param = params.get(id(leaf)) if isinstance(leaf, Tensor) else None
        if param is not None:
            node.meta[PARAM_META] = param
    return gm


def parameters_of(gm: torch.fx.GraphModule) -> dict[str, Param]:
    """The parameter placeholders `trace` marked, by placeholder name, in graph order."""
    return {
        node.name: node.meta[PARAM_META]
        for node in gm.graph.find_nodes(op="placeholder")
        if PARAM_META in node.meta
    }


def _check_leaves(args: tuple[Any, ...]) -> None:
    tree = cast("optree.PyTree[Any]", args)  # a tuple is a pytree; optree types it as a class
    paths, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    for path, leaf in zip(paths, leaves, strict=True):
        if leaf is not None and not isinstance(leaf, Tensor):
            where = "args" + "".join(f"[{k!r}]" for k in path)
            raise TypeError(
                f"funcshard.trace: {where} must be a tensor or None, got "
                f"{type(leaf).__name__} {leaf!r}. make_fx would bake it into the graph as a "
                f"constant; pass it as a tensor, or bind it into step_fn with "
                f"functools.partial."
            )


def _params_by_id(args: tuple[Any, ...]) -> dict[int, Param]:
    """Each parameter tensor of the arguments, keyed by identity."""
    states = [
        x
        for x in optree.tree_leaves(
            cast("optree.PyTree[Any]", args), is_leaf=lambda x: isinstance(x, ShardedState)
        )
        if isinstance(x, ShardedState)
    ]
    params: dict[int, Param] = {}
    for state in states:
        for shard, flat in zip(state.shards, state.layout.flats, strict=True):
            if not flat.frozen:
                params[id(shard)] = Param(flat.name, flat.padded_numel * flat.dtype.itemsize)
    if not states and args and isinstance(args[0], Mapping):
        for fqn, tensor in args[0].items():
            if isinstance(tensor, Tensor) and tensor.requires_grad:
                params[id(tensor)] = Param(str(fqn), tensor.numel() * tensor.element_size())
    return params
