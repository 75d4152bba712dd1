"""Laws of `split` (DESIGN.md §10 item 6) on traced training steps of random module trees.

Each example traces `value_and_grad` of a random module tree on a plain params dict (one
process, no collectives) and splits it with random caps. Which node reads a parameter last is
found independently of `split`, by running the graph and watching which ops take a tensor
sharing the parameter's storage without returning one (views are not reads).

The five laws over drawn trees draw the same examples in one run (`SAME_DRAWS`: one seed for
all, fixed where the profile is derandomized, as in CI, drawn once per run elsewhere), so
each tree is traced once (`_traced` is cached; tracing is most of an example's time) and
every law is checked on it, on as many examples as before.
"""

import functools
import random

import pytest
import torch
from hypothesis import example, given, seed, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard.compiling._split import split
from funcshard.compiling._trace import parameters_of, trace
from funcshard.testing import strategies

CALLS = ("call_function", "call_method", "call_module")
caps = st.tuples(
    st.sampled_from([16, 32, 64, 128, 512, 10**6]), st.sampled_from([8, 16, 64, 10**6])
).map(lambda c: (c[0], min(c)))  # (bucket, first) in bytes, first <= bucket


# (unfreeze every parameter, where to add products of parameters that nobody uses: a bucket
# that starts at such dead reads must be extended to reach an outside user)
variants = st.tuples(st.booleans(), st.sampled_from(["none", "after forward", "after step"]))


def _loss(model, dead_reads, params, x):
    out = fs.call(model, params, x).square().mean()
    if dead_reads == "after forward":
        for p in params.values():
            p.mul(2)
    return out


def _step(model, dead_reads, params, x):
    out = fs.value_and_grad(functools.partial(_loss, model, dead_reads))(params, x)
    if dead_reads == "after step":
        for p in list(params.values())[::2]:
            p.mul(2)
    return out


SAME_DRAWS = seed(0 if settings.default.derandomize else random.getrandbits(64))


@functools.lru_cache(maxsize=256)  # shared by the laws: none changes the graph or its inputs
def _traced(spec: strategies.ModuleSpec, variant: tuple[bool, str]):
    thaw, dead_reads = variant
    model = spec.build()
    if thaw:
        model.requires_grad_(True)
    params, _ = fs.extract(model)
    args = (params, spec.example_input())
    return trace(functools.partial(_step, model, dead_reads), *args), args


# a stack whose last bucket must be extended past three dead reads to reach the output
EXTENDED = {
    "spec": strategies.ModuleSpec(
        tree=("sequential", (("linear", False), ("layernorm", False), ("linear", False))),
        width=4,
        seed=0,
    ),
    "caps": (16, 8),
    "variant": (False, "after step"),
}


def _split(gm, bucket_bytes: int, first_bytes: int):
    if not parameters_of(gm):  # every parameter frozen
        with pytest.raises(ValueError, match="no parameter placeholders"):
            split(gm, bucket_bytes / 2**20, first_bytes / 2**20)
        return None
    return split(gm, bucket_bytes / 2**20, first_bytes / 2**20)


class _LastReads(torch.fx.Interpreter):
    """Runs a graph and records, per parameter placeholder, the last node that reads it."""

    def __init__(self, gm: torch.fx.GraphModule, args: tuple) -> None:
        super().__init__(gm)
        leaves = gm.graph.process_inputs(*args)
        names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        by_name = dict(zip(names, leaves, strict=True))
        self.storage = {
            name: by_name[name].untyped_storage().data_ptr() for name in parameters_of(gm)
        }
        self.reads: dict[str, str] = {}
        self.views: dict[str, str] = {}

    def run_node(self, n: torch.fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out = super().run_node(n)
        if n.op in CALLS:
            taken, given = _storages((args, kwargs)), _storages(out)
            for name, ptr in self.storage.items():
                if ptr in taken:
                    (self.views if ptr in given else self.reads)[name] = n.name
        return out

    def last_reads(self) -> dict[str, str]:
        return {name: self.reads.get(name, self.views.get(name)) for name in self.storage}


def _storages(tree) -> set[int]:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


@SAME_DRAWS
@given(spec=strategies.modules(), caps=caps, variant=variants)
@example(**EXTENDED)
def test_split_computes_exactly_what_the_graph_computes(spec, caps, variant):
    gm, args = _traced(spec, variant)
    pieces = _split(gm, *caps)
    if pieces is None:
        return
    expected = torch.utils._pytree.tree_leaves(gm(*args))
    got = torch.utils._pytree.tree_leaves(pieces(*args))
    assert len(got) == len(expected)
    assert all(
        a is b is None or torch.equal(a, b) for a, b in zip(got, expected, strict=True)
    )  # None: the grad of a frozen parameter


@SAME_DRAWS
@given(spec=strategies.modules(), caps=caps, variant=variants)
def test_every_node_is_in_exactly_one_bucket_and_buckets_run_in_graph_order(spec, caps, variant):
    gm, _ = _traced(spec, variant)
    pieces = _split(gm, *caps)
    if pieces is None:
        return
    calls = [n.name for n in gm.graph.nodes if n.op in CALLS]
    assert [name for b in pieces.buckets for name in b.nodes] == calls
    assert all(b.nodes for b in pieces.buckets)
    if len(pieces.buckets) > 1:  # a parameter-free preamble joins the bucket after it
        assert all(b.params for b in pieces.buckets)


@SAME_DRAWS
@given(spec=strategies.modules(), caps=caps, variant=variants)
def test_each_parameter_counts_once_in_the_bucket_of_its_last_read(spec, caps, variant):
    gm, args = _traced(spec, variant)
    pieces = _split(gm, *caps)
    if pieces is None:
        return
    oracle = _LastReads(gm, args)
    oracle.run(*args)
    params = parameters_of(gm)
    for name, node in oracle.last_reads().items():
        holders = [b for b in pieces.buckets if params[name].name in b.params]
        if node is None:  # never read: counted nowhere
            assert holders == []
        else:
            assert len(holders) == 1 and node in holders[0].nodes, (name, node)
    for b in pieces.buckets:
        assert b.size_bytes == sum(p.nbytes for p in params.values() if p.name in b.params)


def _walk(gm: torch.fx.GraphModule, bucket, bytes_at: dict[str, int]):
    """(size so far, has an outside user so far, node adds parameters) per node of a bucket,
    in the order the walk adds them (from its last node backwards)."""
    members = set(bucket.nodes)
    nodes = {n.name: n for n in gm.graph.nodes}
    size, outside, steps = 0, False, []
    for name in reversed(bucket.nodes):
        size += bytes_at.get(name, 0)
        outside |= any(user.name not in members for user in nodes[name].users)
        steps.append((size, outside, name in bytes_at))
    return steps


def _check_cap(gm, bucket, cap: int, bytes_at: dict[str, int], is_earliest: bool) -> None:
    steps = _walk(gm, bucket, bytes_at)
    last_param = max((j for j, (_, _, adds) in enumerate(steps) if adds), default=-1)
    over = [j for j, (size, outside, _) in enumerate(steps[:last_param]) if size >= cap]
    # a bucket grows past its cap only while none of its nodes has a user outside it
    assert all(not steps[j][1] for j in over), (bucket, cap)
    assert bucket.extended_by >= len(over)
    if not is_earliest:  # closed because it was full and had an outside user
        assert bucket.size_bytes >= cap and steps[-1][1]


def _bytes_at(gm, args) -> dict[str, int]:
    oracle = _LastReads(gm, args)
    oracle.run(*args)
    params = parameters_of(gm)
    bytes_at: dict[str, int] = {}
    for name, node in oracle.last_reads().items():
        if node is not None:
            bytes_at[node] = bytes_at.get(node, 0) + params[name].nbytes
    return bytes_at


@SAME_DRAWS
@given(spec=strategies.modules(), caps=caps, variant=variants)
@example(**EXTENDED)
def test_buckets_respect_the_cap_except_when_extended_to_reach_an_outside_user(spec, caps, variant):
    gm, args = _traced(spec, variant)
    pieces = _split(gm, *caps)
    if pieces is None:
        return
    bytes_at = _bytes_at(gm, args)
    for i, bucket in enumerate(pieces.buckets[:-1]):
        _check_cap(gm, bucket, caps[0], bytes_at, is_earliest=i == 0)


@SAME_DRAWS
@given(spec=strategies.modules(), caps=caps, variant=variants)
@example(**EXTENDED)
def test_the_first_bucket_closed_respects_its_own_cap(spec, caps, variant):
    gm, args = _traced(spec, variant)
    pieces = _split(gm, *caps)
    if pieces is None:
        return
    last = pieces.buckets[-1]  # the walk starts at the output: the last piece closes first
    _check_cap(gm, last, caps[1], _bytes_at(gm, args), is_earliest=len(pieces.buckets) == 1)


@given(
    bucket_mb=st.floats(max_value=0, allow_nan=False) | st.floats(min_value=1e-6, max_value=1e3),
    first_mb=st.floats(max_value=0, allow_nan=False) | st.floats(min_value=1e-6, max_value=1e3),
)
def test_caps_must_be_positive_and_the_first_no_larger(bucket_mb, first_mb):
    gm = trace(lambda p, x: x @ p["w"], {"w": torch.ones(2, 2, requires_grad=True)}, torch.ones(2))
    if bucket_mb > 0 and 0 < first_mb <= bucket_mb:
        assert len(split(gm, bucket_mb, first_mb).buckets) == 1
    else:
        with pytest.raises(ValueError, match=r"funcshard\.split: "):
            split(gm, bucket_mb, first_mb)
