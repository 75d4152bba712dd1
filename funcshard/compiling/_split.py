"""Split a traced step into buckets of parameters: `split(gm, bucket_mb, first_bucket_mb)`.

[Note: bucketing a traced graph]
The rule is DDPOptimizer's (torch._dynamo.backends.distributed), applied to the graphs
`funcshard.trace` makes. Walk the graph from its output towards its inputs, putting every call
node into the current bucket, and add to the bucket's size the bytes of each parameter whose
data that node is the last in the graph to read (so a parameter counts once, in the bucket of
its last read). Before a node joins, a bucket that has reached its cap is closed, but only if
one of its nodes has a user outside it (another bucket, or the graph's output): a piece with
no such output would compute nothing anyone sees, so the bucket is extended node by node
instead, and `Bucket.extended_by` says by how many. The first bucket closed (the last piece to
run) has its own, usually smaller, cap. Once the walk reaches the inputs, a leading bucket
with no parameters (a preamble) joins the bucket after it. `torch.fx.passes.split_module`
then cuts the graph into one submodule per bucket; as buckets are contiguous runs of the
graph's order, the pieces run in that order and compute exactly what the whole graph does.

"Reads" looks through views. make_fx graphs take parameters apart with ops that alias their
input (`split_with_sizes` of a flat buffer, `view`, `t`, `detach`), often at the top of the
graph, and the data is read later, in forward and again in backward, through those views.
Counting a parameter where its view is made would heap every parameter into the first
piece; counting it at the last node that computes with any view of it (a view only ever
viewed counts at its last view) puts it where it is last needed.

Differences from DDPOptimizer, all deliberate: parameters are the placeholders `trace`
marked (see [Note: tracing a step with make_fx]) or those named in `params=`, never nn.Module
attributes; DDPOptimizer counts a parameter at every node that takes the placeholder itself
as an argument, once per such node, and does not follow views, so the two agree exactly on
graphs whose parameters are each read once, directly (tests/compiling/test_split.py checks this);
get_attr nodes (constants, a higher-order op's body) belong to no bucket, as split_module
copies them into every piece that reads them. Higher-order ops that survive tracing are
ordinary call nodes here: the parameters they take count like any other operands, so a graph
with them still splits at every other node (DDPOptimizer falls back to a single bucket on
them, pytorch#104674).

On a graph of a whole training step (forward, backward and collectives) the last read of a
parameter is in backward, so buckets follow backward in reverse: the first bucket closed holds
the end of backward, with the gradients of the units that ran first in forward.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tabulate import tabulate
from torch import fx
from torch.fx.passes.split_module import split_module

from funcshard.compiling._trace import Param, parameters_of

MiB = 2**20


@dataclass(frozen=True)
class Bucket:
    """One piece of a split graph: its parameters and the nodes it runs, in graph order.

    `extended_by` counts the nodes added after the bucket reached its cap, because until then
    none of its nodes had an output used outside it.
    """

    size_bytes: int
    params: tuple[str, ...]
    nodes: tuple[str, ...]
    extended_by: int = 0


class SplitGraph:
    """A traced graph cut into buckets, called exactly like the graph it came from.

    `module` is the split GraphModule (one `submod_<i>` per bucket, run in order); calling the
    SplitGraph flattens the arguments as the traced graph does and rebuilds its output pytree.
    """

    def __init__(
        self,
        traced: fx.GraphModule,
        module: fx.GraphModule,
        buckets: tuple[Bucket, ...],
        caps: tuple[int, int],
    ) -> None:
        self._traced = traced
        self.module = module
        self.buckets = buckets
        self.bucket_bytes, self.first_bucket_bytes = caps

    def __call__(self, *args: Any) -> Any:
        flat = self._traced.graph.process_inputs(*args)
        return self._traced.graph.process_outputs(self.module(*flat))

    @property
    def pieces(self) -> tuple[torch.nn.Module, ...]:
        """The submodules, one per bucket, in the order they run."""
        return tuple(getattr(self.module, _piece_name(i)) for i in range(len(self.buckets)))

    def compile(self, backend: str | Any = "inductor", **options: Any) -> SplitGraph:
        """A copy whose pieces are each compiled with `torch.compile(backend=...)`.

        The pieces still run one after another, so whatever crosses a piece boundary (a
        collective issued in one piece and waited on in the next) stays outside any one
        compiled graph. `options` go to `torch.compile`. This SplitGraph is left as it is.
        In-place all-reduces become out-of-place ones where nothing can see the difference
        (see `_out_of_place`): AOTAutograd cannot functionalize the in-place op.
        """
        module = copy.deepcopy(self.module)
        for i in range(len(self.buckets)):
            name = _piece_name(i)
            piece = _out_of_place(getattr(module, name))
            setattr(module, name, torch.compile(piece, backend=backend, **options))
        return SplitGraph(
            self._traced, module, self.buckets, (self.bucket_bytes, self.first_bucket_bytes)
        )

    def __str__(self) -> str:
        rows = []
        last = len(self.buckets) - 1
        for i, bucket in enumerate(self.buckets):
            cap = self.first_bucket_bytes if i == last else self.bucket_bytes
            names = bucket.params or ("-",)
            rows.append([i, f"{bucket.size_bytes:,}", f"{cap:,}", len(bucket.nodes), names[0]])
            rows.extend([None, None, None, None, name] for name in names[1:])
        table = tabulate(rows, headers=["bucket", "bytes", "cap", "nodes", "params"])
        lines = [
            f"SplitGraph: {len(self.buckets)} buckets (cap {self.bucket_bytes:,} bytes, first "
            f"bucket closed {self.first_bucket_bytes:,}), in the order they run",
            table,
        ]
        lines += [
            f"warning: bucket {i} was extended by {b.extended_by} nodes past its cap, until "
            f"one of its nodes had an output used outside it; expect fewer, larger buckets."
            for i, b in enumerate(self.buckets)
            if b.extended_by
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.size_bytes:,}" for b in self.buckets)
        return f"SplitGraph({len(self.buckets)} buckets of {sizes} bytes)"


def split(
    gm: fx.GraphModule,
    bucket_mb: float = 25,
    first_bucket_mb: float = 1,
    params: Mapping[str, int] | None = None,
) -> SplitGraph:
    """Cut a traced graph into buckets of at most `bucket_mb` MiB of parameters each.

    Parameters are the placeholders `funcshard.trace` marked, or, given `params`, the
    placeholders it names (placeholder name -> bytes). The first bucket closed (the last to
    run) holds at most `first_bucket_mb`. See [Note: bucketing a traced graph].
    Law: the split graph computes exactly what `gm` computes.
    """
    caps = _caps(bucket_mb, first_bucket_mb)
    by_node = _parameter_nodes(gm, params)
    if not any(node.op not in ("placeholder", "get_attr", "output") for node in gm.graph.nodes):
        raise ValueError(
            "funcshard.split: the graph computes nothing, so there is nothing to split."
        )
    buckets, owner = _assign(gm.graph, by_node, caps)
    module = split_module(gm, gm, lambda node: owner[node.name])
    return SplitGraph(gm, module, buckets, caps)


def _caps(bucket_mb: float, first_bucket_mb: float) -> tuple[int, int]:
    for name, value in (("bucket_mb", bucket_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"funcshard.split: {name} must be a number, got {value!r}.")
        if not value > 0:
            raise ValueError(
                f"funcshard.split: {name} must be positive, got {value}. Buckets are capped "
                f"in MiB of parameters, e.g. bucket_mb=25, first_bucket_mb=1 (DDP's defaults)."
            )
    if first_bucket_mb > bucket_mb:
        raise ValueError(
            f"funcshard.split: first_bucket_mb must not exceed bucket_mb, got "
            f"{first_bucket_mb} > {bucket_mb}. The first bucket is the small one that starts "
            f"communication early."
        )
    return max(1, int(bucket_mb * MiB)), max(1, int(first_bucket_mb * MiB))


def _parameter_nodes(gm: fx.GraphModule, params: Mapping[str, int] | None) -> dict[fx.Node, Param]:
    placeholders = {node.name: node for node in gm.graph.find_nodes(op="placeholder")}
    if params is None:
        found = parameters_of(gm)
    else:
        unknown = sorted(set(params) - set(placeholders))
        if unknown:
            raise ValueError(
                f"funcshard.split: params names {unknown}, which are not placeholders of the "
                f"graph; its placeholders are {sorted(placeholders)}."
            )
        found = {name: Param(name, int(nbytes)) for name, nbytes in params.items()}
    if not found:
        raise ValueError(
            "funcshard.split: the graph has no parameter placeholders, so there is nothing to "
            "bucket. Trace the step with funcshard.trace, whose first argument is a "
            "ShardedState or a dict of tensors that require grad, or name the parameter "
            "placeholders with params={name: nbytes}."
        )
    return {placeholders[name]: param for name, param in found.items()}


@dataclass
class _Open:
    """The bucket being filled by the backward walk (nodes in walk order)."""

    nodes: list[fx.Node] = field(default_factory=list)
    members: set[fx.Node] = field(default_factory=set)
    params: list[str] = field(default_factory=list)
    size: int = 0
    extended_by: int = 0
    has_external_output: bool = False

    def add(self, node: fx.Node, new_params: list[Param]) -> None:
        # every user comes later in the graph, so it is already placed: in this bucket, in
        # one closed before it, or the output node, which is in none
        self.has_external_output |= any(user not in self.members for user in node.users)
        self.nodes.append(node)
        self.members.add(node)
        self.params += [p.name for p in new_params]
        self.size += sum(p.nbytes for p in new_params)

    def close(self) -> Bucket:
        return Bucket(
            size_bytes=self.size,
            params=tuple(reversed(self.params)),
            nodes=tuple(n.name for n in reversed(self.nodes)),
            extended_by=self.extended_by,
        )


def _assign(
    graph: fx.Graph, by_node: dict[fx.Node, Param], caps: tuple[int, int]
) -> tuple[tuple[Bucket, ...], dict[str, int]]:
    """Fill buckets walking backwards; return them in graph order and each node's bucket."""
    bucket_cap, first_cap = caps
    counted_at = _last_readers(graph, by_node)
    closed: list[_Open] = []
    current = _Open()
    for node in reversed(graph.nodes):
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if current.size >= (bucket_cap if closed else first_cap):
            if current.has_external_output:
                closed.append(current)
                current = _Open()
            else:
                current.extended_by += 1
        current.add(node, counted_at.get(node, []))
    closed.append(current)
    ordered = closed[::-1]
    if len(ordered) > 1 and ordered[0].size == 0:  # a parameter-free preamble
        preamble = ordered.pop(0)
        ordered[0].nodes += preamble.nodes
    buckets = tuple(b.close() for b in ordered)
    owner = {name: i for i, b in enumerate(buckets) for name in b.nodes}
    return buckets, owner


def _last_readers(graph: fx.Graph, by_node: dict[fx.Node, Param]) -> dict[fx.Node, list[Param]]:
    """The parameters each node counts: those whose data it is the last in the graph to read.

    Views are followed to the nodes that read them (see [Note: bucketing a traced graph]); a
    parameter only ever viewed counts at its last view, one never read at all nowhere.
    """
    position = {node: i for i, node in enumerate(graph.nodes)}
    counted_at: dict[fx.Node, list[Param]] = {}
    for placeholder, param in by_node.items():
        aliases, readers, stack = [], [], [placeholder]
        while stack:
            for user in stack.pop().users:
                if user.op == "output":
                    continue
                if _is_view(user):
                    aliases.append(user)
                    stack.append(user)
                else:
                    readers.append(user)
        last = max(readers or aliases, key=position.__getitem__, default=None)
        if last is not None:
            counted_at.setdefault(last, []).append(param)
    return counted_at


def _is_view(node: fx.Node) -> bool:
    """Whether `node`'s output aliases its input (reached from that input): a view op, or an
    element of a view op's list output."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.is_view
    return target is operator.getitem


_IN_PLACE = {"all_reduce_": "all_reduce"}  # _c10d_functional ops and their out-of-place twins


def _out_of_place(piece: fx.GraphModule) -> fx.GraphModule:
    """Swap the piece's in-place collectives whose mutation nothing can see for their
    out-of-place twins: those whose input the piece computes itself (not a tensor from the
    caller or another piece) and neither returns nor reads after the collective."""
    position = {node: i for i, node in enumerate(piece.graph.nodes)}
    for node in piece.graph.nodes:
        name = _collective_name(node)
        if name not in _IN_PLACE or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        seen_later = any(
            user is not node and position[user] > position[node] for user in mutated.users
        )
        if mutated.op not in ("placeholder", "get_attr") and not seen_later:
            node.target = getattr(torch.ops._c10d_functional, _IN_PLACE[name]).default
    piece.recompile()
    return piece


def _collective_name(node: fx.Node) -> str | None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional":
        return target._opname
    return None


def _piece_name(index: int) -> str:
    return f"submod_{index}"
