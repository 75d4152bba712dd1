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
funcshard/compiling/_compiled_schedule.py) names the unit whose all-gather or reduce-scatter it was.

`compile` also reshards: with inductor (the default) or aot_eager it runs
`compiled_schedule.schedule` on the step's graph (see [Note: resharding a compiled step]),
on the graphs it applies to (`_schedulable`).

And it counts each call as the eager collectives are counted (`failures.last_issued`:
"call k of compiled step 'train_step'", with how many collectives its graphs issued), from
outside the graph, so that nothing traced reads funcshard's counters (see [Note:
bookkeeping outside compiled graphs]).

[Note: activation checkpointing in a compiled step]
With `torch.autograd.grad` traced, forward, loss and backward are one graph, and torch
recomputes a checkpointed region (`torch.utils.checkpoint`, non-reentrant, inside a module's
forward) by duplicating its nodes into the backward part of that graph. Its pass refuses two
cases: a random op inside a recomputed region (dropout, and CPU/CUDA attention kernels,
which take a dropout seed even at p=0) and backward regions of several `autograd.grad`
calls that each need recomputation. Without the traced `autograd.grad` ("joint graph
mode") the step breaks at `torch.autograd.grad`, and AOTAutograd's partitioner, which
handles both, compiles forward and backward with the recomputation. So when torch refuses,
`compile` traces that step again in joint mode, from then on, for every later call of it:
the step then runs as a graph up to `autograd.grad`, that backward, and a graph for the rest
(the optimizer update), with the same results. It does so only before any collective of the
call ran (the refusal comes from compiling the graph, before it runs; a graph break before it
that already communicated would make a rerun issue collectives twice) and without
`fullgraph=True`, which forbids the break: then it raises naming the checkpointed modules.
The cost of joint mode: funcshard's schedule places the forward's gathers, but the
partitioned backward reads the gathered parameters the forward saved for it (they are its
inputs, see `_schedulable`), so between forward and backward the step holds them, as with
`reshard_after_forward=False`, while the checkpointed activations are recomputed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from funcshard.comm import _failures as failures
from funcshard.comm import _process_groups as process_groups
from funcshard.comm import _trail as trail
from funcshard.comm._failures import CollectiveError
from funcshard.compiling import _compiled_schedule as compiled_schedule
from funcshard.compiling._compiled_schedule import inductor_pass, schedule, tag
from funcshard.core._state import ShardedState
from funcshard.step import _compiled as compiled
from funcshard.step import _finite as finite
from funcshard.step import _host_memory as host_memory

F = TypeVar("F", bound=Callable[..., Any])


def compile(fn: F | None = None, /, **options: Any) -> Any:
    """`torch.compile(fn, **options)` for a function of funcshard states (usable as a
    decorator, with or without options): traces `torch.autograd.grad` so a whole step is
    one graph, and raises `CollectiveError` for a collective that failed inside it.

    Compiled once, a step is not recompiled by funcshard on later calls (clipping,
    `global_norm`, `pmean`, `check_finite` and a `Comm` included; see [Note: bookkeeping
    outside compiled graphs]). The default non-finite check does not break the graph: a
    skipped step is a masked update, warned about when the call returns (see [Note: a
    compiled step's skip is a masked update]). Graph breaks:
    `value_and_grad(check_finite=True)` breaks once, where every rank reads the gathered
    flags; a step whose model has
    activation-checkpointed modules that torch cannot recompute inside one graph (random
    ops in the recomputed region, e.g. attention or dropout) breaks at
    `torch.autograd.grad`, with the same results, and with `fullgraph=True` raises
    `ValueError` naming those modules (see [Note: activation checkpointing in a compiled
    step]).

    A cold compile and the mesh's timeout: every rank compiles the step at its first call,
    so a collective in it waits only for the difference between the ranks' compile times,
    bounded by the mesh's timeout (10 minutes by default). Where that difference can be
    longer (a compile cache warm on some nodes only, max-autotune on a large model), give
    the mesh a longer `timeout` or set FUNCSHARD_TIMEOUT. There is deliberately no barrier
    after compiling: a recompile on one rank alone (its last batch shorter) would wait there
    for ranks that never compile.
    """
    if fn is None:
        return functools.partial(compile, **options)
    backend = options.get("backend", "inductor")
    if backend == "aot_eager":
        options["backend"] = _aot_eager()
    compiled = torch.compile(fn, **options)
    scheduling = _inductor_pass() if backend == "inductor" else contextlib.nullcontext()
    name = getattr(fn, "__qualname__", repr(fn))
    calls = itertools.count(1)
    joint = [False]  # see [Note: activation checkpointing in a compiled step]

    def run(args: tuple, kwargs: dict) -> Any:
        autograd_ops = torch._dynamo.config.patch(trace_autograd_ops=not joint[0])
        with autograd_ops, scheduling, finite.read_after_the_call():
            return compiled(*args, **kwargs)

    @functools.wraps(fn)
    def step(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # inside another compiled function: its graph
            return fn(*args, **kwargs)
        state = next((a for a in (*args, *kwargs.values()) if isinstance(a, ShardedState)), None)
        if state is not None:
            _register_regroup(state)
        call = next(calls)
        before = _issued(state)
        failures.entering_compiled(name, call)
        trail.compiled_call()  # see [Note: the collectives' trail] in comm/_trail.py
        try:
            try:
                out = run(args, kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as error:
                modules = _refused_recomputation(error)
                if modules is None or joint[0]:
                    raise
                if options.get("fullgraph") or _issued(state) != before:
                    raise _cannot_break(name, modules, bool(options.get("fullgraph"))) from error
                joint[0] = True
                out = run(args, kwargs)
        except CollectiveError:
            raise
        except RuntimeError as error:
            if not failures.is_failure(error):
                raise
            raise _failed_inside(fn, state, before, error) from error
        finally:
            failures.left_compiled(name, call, _count(before, _issued(state)))
        if state is not None:  # see [Note: host memory kept between steps]
            host_memory.keep_for(state.layout.mesh.device_type)
        finite.read_compiled_verdicts()  # see [Note: a compiled step's skip is a masked update]
        return out

    return step


def _refused_recomputation(error: BaseException) -> list[str] | None:
    """If torch's pass that recomputes checkpointed regions inside a forward-loss-backward
    graph refused the step's graph, the modules of the ops it refused (best effort; [] when
    none could be named); None for any other compile failure."""
    cause = getattr(error, "inner_exception", None) or error.__cause__
    tb = cause.__traceback__ if cause is not None else None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "remat_using_tags_for_fwd_loss_bwd_graph":
            return _recomputed_modules(frame.f_locals.get("gm"))
        tb = tb.tb_next
    return None


def _recomputed_modules(gm: Any) -> list[str]:
    """The innermost module (class and path) of each recomputed node of `gm` that is a
    random op, or of every recomputed node when none is: what a refusal names."""
    if gm is None:
        return []
    recomputed = [n for n in gm.graph.nodes if n.meta.get("recompute") is not None]
    random = [
        n for n in recomputed if torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
    ]
    names: list[str] = []
    for node in random or recomputed:
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if stack:
            path, cls = stack[-1]
            words = f"{getattr(cls, '__name__', cls)} {_module_path(path)!r}"
            if words not in names:
                names.append(words)
    return names


def _module_path(source: str) -> str:
    """A module's path ("blocks.0.attn") from dynamo's source of it, such as
    "getattr(L['f'].__closure__[0].cell_contents.blocks, '0').attn"."""
    while True:
        flat = re.sub(r"getattr\(([^()]*), '([^']*)'\)", r"\1.\2", source)
        if flat == source:
            break
        source = flat
    source = re.sub(r"\._modules\['([^']*)'\]", r".\1", source)
    return re.sub(r"^.*\.cell_contents\.?|^L\['[^']*'\]\.?", "", source)


def _cannot_break(name: str, modules: list[str], fullgraph: bool) -> ValueError:
    where = f": {', '.join(modules)}" if modules else ""
    why = (
        "fullgraph=True forbids the graph break at torch.autograd.grad that compiles it in "
        "torch's joint graph mode. Pass fullgraph=False (the step then breaks once there, "
        "with the same results)"
        if fullgraph
        else "the call had already issued collectives before the graph that refused (after a "
        "graph break), so it cannot be traced again. Remove the graph break before "
        "funcshard.value_and_grad"
    )
    return ValueError(
        f"funcshard.compile({name}): torch cannot recompute the activation-checkpointed "
        f"modules of this step inside one forward-loss-backward graph (a random op, such "
        f"as attention or dropout, in a recomputed region, or several backward regions to "
        f"recompute){where}. {why}, or checkpoint those modules without their random ops "
        f"(see [Note: activation checkpointing in a compiled step] in funcshard/compiling/_jit.py)."
    )


def _count(before: dict[str, int | None], after: dict[str, int | None]) -> int | None:
    """How many collectives were issued on the mesh's axes between `before` and `after`
    (None if the backend does not number them, or without a state)."""
    if not after or None in before.values() or None in after.values():
        return None
    return sum(cast(int, after[axis]) - cast(int, before[axis]) for axis in after)


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
    graph it compiles during a call that it applies to (see `_schedulable`), after the
    user's own pre-passes, if any are set."""
    from torch._inductor import config

    current = config.post_grad_custom_pre_pass
    ours = _guarded_pass_class()
    if isinstance(current, list | tuple):  # the user's passes, each run by inductor, then ours
        theirs = [p for p in current if not isinstance(p, ours)]  # not an enclosing call's
        return config.patch(post_grad_custom_pre_pass=[*theirs, ours(inductor_pass())])
    if isinstance(current, ours):  # ours, from an enclosing call
        current = current.scheduled
    return config.patch(post_grad_custom_pre_pass=ours(inductor_pass(current)))


@functools.cache
def _guarded_pass_class() -> type[Any]:
    # inductor is imported here, when a step is compiled, not when funcshard is
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class SchedulablePass(CustomGraphPass):
        """`scheduled` (a `compiled_schedule.inductor_pass`) on the graphs `schedule`
        applies to; on the others only the user's own pass that it wraps."""

        def __init__(self, scheduled: Any) -> None:
            self.scheduled = scheduled

        def __call__(self, graph: torch.fx.Graph) -> None:
            if _schedulable(graph):
                self.scheduled(graph)
            elif self.scheduled.before is not None:
                self.scheduled.before(graph)

        def uuid(self) -> Any:
            return ("funcshard.compiling._jit", 1, self.scheduled.uuid())

    return SchedulablePass


def _aot_eager() -> Callable[..., Any]:
    """aot_eager with `compiled_schedule.schedule` run on the graphs it applies to."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def scheduled(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        if _schedulable(gm.graph):
            schedule(gm.graph)
            gm.recompile()
        return boxed_nop(gm, example_inputs)

    return aot_autograd(fw_compiler=scheduled, bw_compiler=scheduled)


def _schedulable(graph: torch.fx.Graph) -> bool:
    """Whether `schedule` applies to `graph`: not to the backward graph AOTAutograd
    partitions from a forward when `torch.autograd.grad` was not traced with it (joint
    graph mode, see [Note: activation checkpointing in a compiled step]). Its inputs are
    the gathered parameters the forward saved, tagged as the gather's nodes: the pass
    would move and copy them as gather nodes, changing the graph's signature, and a
    backward that reads saved parameters has no gather to reshard anyway."""
    return not any(tag(node) is not None for node in graph.find_nodes(op="placeholder"))


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
    return {axis: process_groups.issued_count(group) for axis, group in _axes(state).items()}


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
            f"(ranks {process_groups.group_ranks(mesh.group)})"
        )
        which = _which(state, before, _issued(state))
    return CollectiveError(
        f"rank {process_groups.global_rank()}: a collective inside the compiled step {name!r}"
        f"{where} did not complete: {cause}{which}\n"
        f"The other ranks did not join it in time: one died or hung, or the ranks took "
        f"different paths. Mesh(timeout=...) bounds the wait; run the step eagerly with "
        f"Mesh(check_collectives=True) to compare every collective across ranks."
    )


def _which(state: ShardedState, before: dict[str, int | None], after: dict[str, int | None]) -> str:
    """Which collective of the call was the last issued on each mesh axis, counted by the
    backend's sequence numbers: the call's k-th there, named from the order in which the
    scheduled graph issues its collectives (see funcshard/compiling/_compiled_schedule.py)."""
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
            f"(ranks {process_groups.group_ranks(group)}){unit}."
        )
    return "".join(lines)
