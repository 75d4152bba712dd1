"""`funcshard.compile`: torch.compile for funcshard steps, with no private flags to set.

A whole training step is one graph only if dynamo traces `torch.autograd.grad` (which
`fs.value_and_grad` calls), and dynamo does that only under its private switch
`torch._dynamo.config.trace_autograd_ops`. `compile` sets it for the compiled calls alone
(a scoped patch around each call: what dynamo traces then, and nothing else in the
process, sees it), so users write no private configuration.

It also names failures as eager steps do. Inside a compiled graph the collectives are the
compiler's nodes, so a peer that died or hung surfaces as a bare gloo/NCCL error
("Connection closed by peer", "Timed out waiting 3000ms for send"). `compile` turns such
an error into `CollectiveError` naming the compiled function, the ranks of the mesh of the
state it was given and the cause. What it cannot name is which of the graph's collectives
failed: the graph runs without Python between its nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from funcshard import collectives
from funcshard.collectives import CollectiveError
from funcshard.state import ShardedState

F = TypeVar("F", bound=Callable[..., Any])


def compile(fn: F | None = None, /, **options: Any) -> Any:
    """`torch.compile(fn, **options)` for a function of funcshard states (usable as a
    decorator, with or without options): traces `torch.autograd.grad` so a whole step is
    one graph, and raises `CollectiveError` for a collective that failed inside it."""
    if fn is None:
        return functools.partial(compile, **options)
    compiled = torch.compile(fn, **options)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            try:
                return compiled(*args, **kwargs)
            except CollectiveError:
                raise
            except RuntimeError as error:
                if not collectives.is_failure(error):
                    raise
                raise _failed_inside(fn, args, kwargs, error) from error

    return step


def _failed_inside(
    fn: Callable[..., Any], args: tuple, kwargs: dict, cause: BaseException
) -> CollectiveError:
    states = [
        leaf
        for leaf in pytree.tree_leaves(
            (args, kwargs), is_leaf=lambda x: isinstance(x, ShardedState)
        )
        if isinstance(leaf, ShardedState)
    ]
    if states:
        mesh = states[0].layout.mesh
        where = (
            f" over the mesh replicate={mesh.replicate} x shard={mesh.shard} "
            f"(ranks {collectives.group_ranks(mesh.group)})"
        )
        units = ", ".join(states[0].layout.units)
        holds = f"\nIts graph gathers and reduces the units {units}."
    else:
        where, holds = "", ""
    name = getattr(fn, "__qualname__", repr(fn))
    rank = collectives.global_rank()
    return CollectiveError(
        f"rank {rank}: a collective inside the compiled step {name!r}{where} did not "
        f"complete: {cause}{holds}\n"
        f"The last funcshard collective this rank issued eagerly: {collectives.last_issued()}.\n"
        f"The other ranks did not join it in time: one died or hung, or the ranks took "
        f"different paths. Mesh(timeout=...) bounds the wait. Which of the graph's "
        f"collectives failed is not known inside a compiled graph: run the step eagerly "
        f"with Mesh(check_collectives=True) to name it."
    )
