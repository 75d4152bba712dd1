"""Resharding and scheduling the collectives of a compiled step: one pass over its aten graph.

[Note: resharding a compiled step]
Traced, a step is one flat graph: the forward, then the backward that `torch.autograd.grad`
unrolled into it (nodes tagged `meta["autograd_backward"]`). As dynamo sees `funcshard.call`,
every flat buffer is gathered first and its views feed both the forward and the backward
(see [Note: the step under torch.compile]), so left alone the compiled step holds the whole
model gathered from its first node to the end of backward, and every unit's full gradient
until the last reduce-scatter. `schedule(graph)` moves and copies nodes so that the graph
holds what the eager step holds:

1. Forward: each buffer's gather (its cast, all-gather, wait and parameter views) moves to
   just before the first node that reads it, and its all-gather starts before the compute
   of the buffer used before it (one buffer of prefetch, as eagerly).
2. Backward: a buffer that reshards after forward (`reshard_after_forward`, the root unit
   exempt, as eagerly) is gathered again: its gather chain, with the forward views of its
   parameters that backward reads, is copied before the first backward node that reads
   any of them, and those nodes read the copy; again the copy's all-gather starts before
   the backward compute of the buffer regathered before it. The forward gather then dies
   at its last forward use. Resharding to k ranks (an int `reshard_after_forward`), forward
   keeps the 1/k slice of the gathered buffer that this rank holds in its group of k, and
   backward all-gathers it over that group (`register_regroup`, from `funcshard.compile`)
   before copying the views, as the eager step does.
3. Each buffer's reduce (the gradient's concatenation, cast, reduce-scatter and wait, the
   backward of funcshard's gather) moves to just after its gradient is complete, instead
   of the end of backward, so full-size gradients die one unit at a time; its wait moves
   to just before the next reduce starts, so one reduce is in flight while backward
   computes the next gradient, as eagerly.

The pass finds gathers and reduces by funcshard's own tag, not by a pattern of
collectives: `compiled.full_params` runs each gather under `torch.fx.traceback.annotate`,
whose mark every node traced inside it carries (`meta["custom"][GATHER]`: buffer index,
unit, whether it reshards), the gather's backward too; so a user's own gather
(`funcshard.Comm`) is resharded like the built-in one. Moving a node only ever places it
after everything it reads and before everything that reads it, and the copies compute
what the originals did, so the graph computes what it did (tests compare with eager).
`funcshard.compile` runs the pass on inductor's post-grad graph and in its `aot_eager`
backend; `reshard_backend(compiler)` makes any aot_autograd backend run it.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx

from funcshard.step._compiled import GATHER

REGATHERED = "funcshard_regathered"  # meta flag of the backward copies of a gather chain

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_COLLECTIVE_STARTS = {_ALL_GATHER, _REDUCE_SCATTER, torch.ops._c10d_functional.all_reduce.default}


@dataclass
class _Buffer:
    """One flat buffer's nodes: its forward gather chain and its backward reduce chain."""

    index: int
    unit: str
    reshard: bool
    chain: list[fx.Node] = field(default_factory=list)
    reduce: list[fx.Node] = field(default_factory=list)


def tag(node: fx.Node) -> tuple | None:
    """The (buffer index, unit, reshard) of a node of funcshard's gather, else None."""
    custom = node.meta.get("custom")
    return custom.get(GATHER) if isinstance(custom, dict) else None


def is_backward(node: fx.Node) -> bool:
    return bool(node.meta.get("autograd_backward"))


def schedule(graph: fx.Graph) -> None:
    """Reshard and schedule `graph` in place (see [Note: resharding a compiled step])."""
    buffers = _buffers(graph)
    if not buffers:
        return
    _place_forward_gathers(graph, buffers)
    _regather_in_backward(graph, buffers)
    _place_reduces(graph, buffers)
    graph.lint()
    _record_order(graph, buffers)


# The order in which the last scheduled graph over each set of buffers issues its
# shard-axis collectives: ("all-gather" | "reduce-scatter", buffer index) by graph order,
# keyed by the (index, unit) pairs of its buffers. `funcshard.compile` names the collective
# that failed inside a compiled step from it.
ISSUE_ORDERS: dict[tuple, list[tuple[str, int]]] = {}
_KINDS = {_ALL_GATHER: "all-gather", _REDUCE_SCATTER: "reduce-scatter"}


def _order_key(units: Iterable[tuple[int, str]]) -> tuple:
    return tuple(sorted(set(units)))


def issue_order(units: Sequence[str]) -> list[tuple[str, int]]:
    """The shard-axis collectives of the last scheduled graph over buffers of these units
    (by buffer index), in the order the graph issues them; empty if none was scheduled."""
    return ISSUE_ORDERS.get(_order_key(enumerate(units)), [])


def _record_order(graph: fx.Graph, buffers: list[_Buffer]) -> None:
    key = _order_key((b.index, b.unit) for b in buffers)
    ISSUE_ORDERS[key] = [
        (_KINDS[n.target], t[0])
        for n in graph.nodes
        if n.target in _KINDS and (t := tag(n)) is not None
    ]


def _buffers(graph: fx.Graph) -> list[_Buffer]:
    """Every gather and every reduce in the graph, each a connected run of tagged nodes: a
    tagged node that reads a gradient (a backward node, or a node of a reduce) belongs to a
    reduce, any other to a gather (the gather's backward carries the tag, not the mark).
    A buffer gathered by two calls (two `value_and_grad`s in one step) has two chains."""
    reduce: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if tag(node) is not None:
            reduce[node] = any(is_backward(a) or reduce.get(a, False) for a in node.all_input_nodes)
    parent = {node: node for node in reduce}

    def root(node: fx.Node) -> fx.Node:
        while parent[node] is not node:
            parent[node] = node = parent[parent[node]]
        return node

    for node, reducing in reduce.items():  # union-find over edges between tagged nodes
        for a in node.all_input_nodes:
            if a in reduce and reduce[a] == reducing:
                parent[root(a)] = root(node)
    found: dict[fx.Node, _Buffer] = {}
    for node, reducing in reduce.items():  # graph order within each run
        run = found.get(root(node))
        if run is None:
            tagged = tag(node)
            assert tagged is not None  # `reduce` holds tagged nodes only
            run = found[root(node)] = _Buffer(*tagged)
        (run.reduce if reducing else run.chain).append(node)
    return list(found.values())


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _view_closure(chain: list[fx.Node]) -> list[fx.Node]:
    """The chain and the forward view nodes made from its nodes through views alone (a
    weight's transpose that a matmul saves for backward), in graph order."""
    members = set(chain)
    closure = list(chain)
    frontier = list(chain)
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user not in members and not is_backward(user) and _is_view(user):
                members.add(user)
                closure.append(user)
                frontier.append(user)
    return closure


def _is_view(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _readers(nodes: Iterable[fx.Node], members: set[fx.Node]) -> list[fx.Node]:
    return [u for n in nodes for u in n.users if u not in members]


def _move_before(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    """Move `nodes` (in order) to just before `anchor`, unless one of them reads a node
    outside them that comes after `anchor` (a shard first made later, by a second call):
    then leave them where they are."""
    moving = set(nodes)
    outside = [a for n in nodes for a in n.all_input_nodes if a not in moving]
    if outside:
        positions = _positions(anchor.graph)
        if max(positions[a] for a in outside) >= positions[anchor]:
            return
    for node in nodes:
        anchor.prepend(node)


def _start_part(chain: list[fx.Node]) -> list[fx.Node]:
    """The chain's nodes up to and including its collective start (cast, all-gather)."""
    for i, node in enumerate(chain):
        if node.target in _COLLECTIVE_STARTS:
            return chain[: i + 1]
    return []


def _place_forward_gathers(graph: fx.Graph, buffers: list[_Buffer]) -> None:
    """Step 1: each gather just before its first reader, its all-gather one buffer ahead."""
    positions = _positions(graph)
    anchors = []
    for buffer in buffers:
        closure = set(_view_closure(buffer.chain))
        readers = [  # through the views too (a bias-free linear reads only `t` of its weight)
            r for r in _readers(closure, closure) if not is_backward(r) and r.op != "output"
        ]
        if not readers or not buffer.chain:
            continue
        first = min(readers, key=positions.__getitem__)
        _move_before(first, sorted(closure, key=positions.__getitem__))  # views follow
        anchors.append((positions[first], first, buffer))
    anchors.sort(key=lambda a: a[0])
    for (_, before, _), (_, _, buffer) in itertools.pairwise(anchors):
        _move_before(before, _start_part(buffer.chain))


def _regather_in_backward(graph: fx.Graph, buffers: list[_Buffer]) -> None:
    """Step 2: backward reads a copy of each resharding buffer's gather chain."""
    anchors = []
    for buffer in buffers:
        if not buffer.reshard or not buffer.chain:
            continue
        positions = _positions(graph)
        closure = sorted(_view_closure(buffer.chain), key=positions.__getitem__)
        members = set(closure)
        readers = [r for r in _readers(closure, members) if is_backward(r)]
        if not readers:
            continue
        first = min(readers, key=positions.__getitem__)
        copies = _regathered(graph, buffer, closure, first)
        for node in closure:
            for user in list(node.users):
                if is_backward(user) and node in copies:
                    user.replace_input_with(node, copies[node])
        chain_copy = [copies[n] for n in closure if n in set(buffer.chain) and n in copies]
        anchors.append((first, chain_copy))
    positions = _positions(graph)
    anchors.sort(key=lambda a: positions[a[0]])
    for (before, _), (_, chain_copy) in itertools.pairwise(anchors):
        _move_before(before, _start_part(chain_copy))


# shard group name -> (k, the group of k ranks that shard regathers from, this rank's
# position in it): registered by `funcshard.compile` for a state with an int
# `reshard_after_forward` (see `register_regroup`)
REGROUPS: dict[str, tuple[int, str, int]] = {}


def register_regroup(shard_group: str, k: int, group: str, index: int) -> None:
    """Say that buffers gathered over `shard_group` and tagged to reshard to `k` regather
    from `group` (k ranks, this rank `index`-th), keeping a 1/k slice from forward."""
    REGROUPS[shard_group] = (k, group, index)


def _regathered(
    graph: fx.Graph, buffer: _Buffer, closure: list[fx.Node], anchor: fx.Node
) -> dict[fx.Node, fx.Node]:
    """Backward's copies of a gather's nodes, before `anchor`: the whole chain, or, for a
    buffer that reshards to k ranks, an all-gather over those k of the 1/k slice forward
    kept (taken just after the forward all-gather's wait) and copies of the views."""
    start = next((n for n in closure if n.target is _ALL_GATHER), None)
    # all_gather_into_tensor(input, group_size, group_name)
    regroup = REGROUPS.get(cast(str, start.args[2])) if start is not None else None
    if isinstance(buffer.reshard, bool) or regroup is None or regroup[0] != buffer.reshard:
        return _copy_before(graph, anchor, closure)
    k, group, index = regroup
    wait = next(iter(start.users))
    full = wait.meta.get("val")  # the gathered buffer's fake tensor: its size
    if full is None:
        return _copy_before(graph, anchor, closure)
    part = slice(index * full.shape[0] // k, (index + 1) * full.shape[0] // k)
    with graph.inserting_after(wait):
        sliced = graph.call_function(torch.ops.aten.slice.Tensor, (wait, 0, part.start, part.stop))
    with graph.inserting_after(sliced):
        kept = graph.call_function(torch.ops.aten.clone.default, (sliced,))
    sliced.meta["val"] = full[part]  # inductor lowers from these
    kept.meta["val"] = full[part].clone()
    with graph.inserting_before(anchor):
        gathered = graph.call_function(_ALL_GATHER, (kept, k, group))
        waited = graph.call_function(_WAIT, (gathered,))
    for node in (gathered, waited):
        node.meta["val"] = full
        node.meta[REGATHERED] = True
        node.meta["custom"] = dict(start.meta.get("custom", {}))
    after = [n for n in closure if n is not wait and _depends_on(n, wait)]
    copies = _copy_before(graph, anchor, after, {wait: waited})
    copies[start], copies[wait] = gathered, waited
    return copies


def _depends_on(node: fx.Node, base: fx.Node) -> bool:
    frontier, seen = [node], set()
    while frontier:
        n = frontier.pop()
        if n is base:
            return True
        if n not in seen:
            seen.add(n)
            frontier.extend(n.all_input_nodes)
    return False


def _copy_before(
    graph: fx.Graph, anchor: fx.Node, nodes: list[fx.Node], env: dict | None = None
) -> dict[fx.Node, fx.Node]:
    """Copies of `nodes` (in graph order) inserted before `anchor`, reading each other's
    copies; marked REGATHERED."""
    copies: dict[fx.Node, fx.Node] = dict(env or {})
    with graph.inserting_before(anchor):
        for node in nodes:
            copy = graph.node_copy(node, lambda arg: copies.get(arg, arg))
            copy.meta[REGATHERED] = True
            copies[node] = copy
    return copies


def _place_reduces(graph: fx.Graph, buffers: list[_Buffer]) -> None:
    """Step 3: each reduce chain right after the last node it reads from outside itself."""
    for buffer in buffers:
        if not buffer.reduce:
            continue
        positions = _positions(graph)
        members = set(buffer.reduce)
        inputs = [a for n in buffer.reduce for a in n.all_input_nodes if a not in members]
        if not inputs:
            continue
        last = max(inputs, key=positions.__getitem__)
        for node in buffer.reduce:
            last.append(node)
            last = node
    _overlap_reduces(graph, [b.reduce for b in buffers if b.reduce])


def _overlap_reduces(graph: fx.Graph, chains: list[list[fx.Node]]) -> None:
    """Leave one reduce in flight, as eagerly: each reduce's wait, and what follows it in
    its chain, moves to just before the next reduce starts, so the collective runs while
    backward computes the next gradient."""
    positions = _positions(graph)
    chains = sorted(chains, key=lambda chain: positions[chain[0]])
    for chain, following in itertools.pairwise(chains):
        waits = [i for i, n in enumerate(chain) if n.target is _WAIT]
        start = next((n for n in following if n.target in _COLLECTIVE_STARTS), None)
        if waits and start is not None:
            _move_later_before(start, chain[waits[0] :])


def _move_later_before(anchor: fx.Node, nodes: list[fx.Node]) -> None:
    """Move `nodes` (in order) later, to just before `anchor`, unless a node outside them
    reads one of them before `anchor`: then leave them where they are."""
    moving = set(nodes)
    readers = [u for n in nodes for u in n.users if u not in moving]
    positions = _positions(anchor.graph)
    if any(positions[r] < positions[anchor] for r in readers):
        return
    for node in nodes:
        anchor.prepend(node)


@functools.cache
def _pass_class() -> type[Any]:
    # inductor is imported here, when a step is compiled, not when funcshard is (~1 s)
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class ReshardPass(CustomGraphPass):
        """`schedule` as an inductor custom graph pass, after `before` (a pass of the
        user's) if given; its `uuid` keys inductor's cache."""

        def __init__(self, before: Callable[[fx.Graph], None] | None = None) -> None:
            self.before = before

        def __call__(self, graph: fx.Graph) -> None:
            if self.before is not None:
                self.before(graph)
            schedule(graph)

        def uuid(self) -> Any:
            before = self.before
            theirs = before.uuid() if before is not None and hasattr(before, "uuid") else None
            return ("funcshard.compiling._compiled_schedule", 1, theirs)

    return ReshardPass


def inductor_pass(before: Callable[[fx.Graph], None] | None = None) -> Any:
    """`schedule` as an inductor post-grad custom pass (run after `before`, if given)."""
    if before is not None and isinstance(before, _pass_class()):
        before = cast(Any, before).before  # already ours: never run the schedule twice
    return _pass_class()(before)


def reshard_backend(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """An aot_autograd backend whose graphs are scheduled by `schedule` before `compiler`
    (a forward compiler: `(graph_module, example_inputs) -> callable`) compiles them."""
    from torch._dynamo.backends.common import aot_autograd

    def scheduled(gm: fx.GraphModule, example_inputs: Any) -> Any:
        schedule(gm.graph)
        gm.recompile()
        return compiler(gm, example_inputs)

    return aot_autograd(fw_compiler=scheduled, bw_compiler=scheduled)
