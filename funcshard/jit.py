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
state it was given, the cause, and which collective it was: the graph runs without Python
between its nodes, but the backend numbers every collective on a group (its sequence
number), so the difference across the call says it was the call's k-th on that mesh axis;
and the order in which the scheduled graph issues its collectives (recorded by
funcshard/compiled_schedule.py) names the unit whose all-gather or reduce-scatter it was.

`compile` also reshards: with inductor (the default) or aot_eager it runs
`compiled_schedule.schedule` on the step's graph (see [Note: resharding a compiled step]).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from funcshard import collectives, compiled, compiled_schedule, host_memory
from funcshard.collectives import CollectiveError
from funcshard.compiled_schedule import inductor_pass, reshard_backend
from funcshard.state import ShardedState

F = TypeVar("F", bound=Callable[..., Any])


def compile(fn: F | None = None, /, **options: Any) -> Any:
    """`torch.compile(fn, **options)` for a function of funcshard states (usable as a
    decorator, with or without options): traces `torch.autograd.grad` so a whole step is
    one graph, and raises `CollectiveError` for a collective that failed inside it."""
    if fn is None:
        return functools.partial(compile, **options)
    backend = options.get("backend", "inductor")
    if backend == "aot_eager":
        from torch._dynamo.backends.debugging import boxed_nop

        options["backend"] = reshard_backend(boxed_nop)
    compiled = torch.compile(fn, **options)
    scheduling = _inductor_pass() if backend == "inductor" else contextlib.nullcontext()

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        state = next((a for a in (*args, *kwargs.values()) if isinstance(a, ShardedState)), None)
        if state is not None:
            _register_regroup(state)
        before = _issued(state)
        with torch._dynamo.config.patch(trace_autograd_ops=True), scheduling:
            try:
                out = compiled(*args, **kwargs)
            except CollectiveError:
                raise
            except RuntimeError as error:
                if not collectives.is_failure(error):
                    raise
                raise _failed_inside(fn, state, before, error) from error
        if state is not None:  # see [Note: host memory kept between steps]
            host_memory.keep_for(state.layout.mesh.device_type)
        return out

    return step


def _register_regroup(state: ShardedState) -> None:
    """For a state resharded to k ranks after forward: make the group of k ranks its
    backward regathers from (on every rank together, as every rank calls the step) and
    tell the schedule about it."""
    k = compiled.reshard_mark(state)
    if isinstance(k, bool):
        return
    mesh = state.layout.mesh
    group = mesh.post_forward_group(k)
    compiled_schedule.register_regroup(
        mesh.shard_group.group_name, k, group.group_name, mesh.shard_rank % k
    )


def _issue_order(state: ShardedState) -> list[tuple[str, int]]:
    """The shard-axis collectives of the last compiled graph over this state's buffers, in
    the order the graph issues them (see compiled_schedule.ISSUE_ORDERS); empty if none."""
    return compiled_schedule.issue_order([flat.unit for flat in state.layout.flats])


def _inductor_pass() -> contextlib.AbstractContextManager:
    """Inductor's config patched to run `compiled_schedule.schedule` on every post-grad
    graph it compiles during a call (after the user's own pre-pass, if one is set)."""
    from torch._inductor import config

    return config.patch(post_grad_custom_pre_pass=inductor_pass(config.post_grad_custom_pre_pass))


def _axes(state: ShardedState | None) -> dict[str, Any]:
    """The process group of each axis of the state's mesh that communicates (size > 1)."""
    if state is None:
        return {}
    mesh, axes = state.layout.mesh, {}
    if mesh.shard > 1:
        axes["shard"] = mesh.shard_group
    if mesh.replicate > 1:
        axes["replicate"] = mesh.replicate_group
    return axes


def _issued(state: ShardedState | None) -> dict[str, int | None]:
    """How many collectives this rank has issued on each communicating axis of the mesh."""
    return {axis: collectives.issued_count(group) for axis, group in _axes(state).items()}


def _failed_inside(
    fn: Callable[..., Any],
    state: ShardedState | None,
    before: dict[str, int | None],
    cause: BaseException,
) -> CollectiveError:
    name = getattr(fn, "__qualname__", repr(fn))
    where = which = ""
    if state is not None:
        mesh = state.layout.mesh
        where = (
            f" over the mesh replicate={mesh.replicate} x shard={mesh.shard} "
            f"(ranks {collectives.group_ranks(mesh.group)})"
        )
        which = _which(state, before, _issued(state))
    return CollectiveError(
        f"rank {collectives.global_rank()}: a collective inside the compiled step {name!r}"
        f"{where} did not complete: {cause}{which}\n"
        f"The other ranks did not join it in time: one died or hung, or the ranks took "
        f"different paths. Mesh(timeout=...) bounds the wait; run the step eagerly with "
        f"Mesh(check_collectives=True) to compare every collective across ranks."
    )


def _which(state: ShardedState, before: dict[str, int | None], after: dict[str, int | None]) -> str:
    """Which collective of the call was the last issued on each mesh axis, counted by the
    backend's sequence numbers: the call's k-th there, named from the order in which the
    scheduled graph issues its collectives (see funcshard/compiled_schedule.py)."""
    lines = []
    flats = state.layout.flats
    for axis, group in _axes(state).items():
        start, end = before.get(axis), after.get(axis)
        if start is None or end is None or end == start:
            continue
        k = end - start
        order = _issue_order(state) if axis == "shard" else []
        unit = (
            f": the {order[k - 1][0]} of unit {flats[order[k - 1][1]].name!r} if the step's "
            f"first collectives are its first fs.call's"
            if k <= len(order)
            else ""
        )
        lines.append(
            f"\nThe last collective this call issued on the {axis} axis was its #{k} there "
            f"(ranks {collectives.group_ranks(group)}){unit}."
        )
    return "".join(lines)
