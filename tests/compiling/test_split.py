"""Tracing a training step and splitting it into buckets (DESIGN.md §7).

A GPT step traced on two gloo ranks splits into pieces that, compiled with aot_eager, give
eager's loss and grads; on forward graphs the bucket assignment is torch's DDPOptimizer's.

The GPTs have the fewest blocks that still give three buckets or more (two; one for DDP's
0.01 MB buckets): tracing, and compiling each piece, grow with the blocks (tests/DURATIONS.md).
"""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as activation_checkpoint
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.compiling._split import Bucket, SplitGraph, split
from funcshard.compiling._trace import parameters_of, trace
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

MiB = 2**20
# A GPT with Block units holds 50,816 bytes per block and 10,112 in the root:
# these caps close a bucket at every unit
BLOCK_CAPS = {"bucket_mb": 30_000 / MiB, "first_bucket_mb": 10_000 / MiB}


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Count the collective nodes by op name; fail on any outside the functional namespace."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        namespace = getattr(node.target, "namespace", None)
        assert namespace not in ("c10d", "_c10d_functional_autograd"), node.format_node()
        if namespace == "_c10d_functional":
            name = node.target._opname
            counts[name] = counts.get(name, 0) + 1
    return counts


def _same(a, b, exact: bool) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    if len(la) != len(lb):
        return False
    compare = torch.equal if exact else functools.partial(torch.allclose, rtol=1e-5, atol=1e-5)
    return all(compare(x, y) for x, y in zip(la, lb, strict=True))


def _sharded_step(mesh_kwargs: dict, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(**mesh_kwargs)
    )
    x, y = random_tokens(model.cfg, 2, seed=rank)

    def step(state, x, y):
        return fs.value_and_grad(functools.partial(_loss, model))(state, x, y)

    eager = step(state, x, y)
    gm = trace(step, state, x, y)
    pieces = split(gm, **BLOCK_CAPS)
    compiled = pieces.compile(backend="aot_eager")
    return {
        "collectives": _collectives(gm),
        "params": sorted(p.name for p in parameters_of(gm).values()),
        "compiled_pieces": all(hasattr(p, "_orig_mod") for p in compiled.pieces),
        "buckets": len(pieces.buckets),
        "table": str(pieces),
        "graph_matches_eager": _same(gm(state, x, y), eager, exact=True),
        "split_matches_graph": _same(pieces(state, x, y), gm(state, x, y), exact=True),
        "compiled_matches_eager": _same(compiled(state, x, y), eager, exact=False),
        "grads_type": type(compiled(state, x, y)[1]).__name__,
    }


def test_gpt_step_splits_into_buckets_that_compile_to_eagers_loss_and_grads():
    results = testing.run(functools.partial(_sharded_step, {"shard": 2}), world_size=2, timeout=180)
    for r in results:
        # one gather per unit in forward, again per block but the last in backward; one
        # reduce-scatter each (the root and 2 blocks)
        assert r["collectives"] == {
            "all_gather_into_tensor": 4,
            "reduce_scatter_tensor": 3,
            "wait_tensor": 7,
        }
        assert r["params"] == sorted(
            ["<root>[float32]", *(f"blocks.{i}[float32]" for i in range(2))]
        )
        assert r["buckets"] >= 3, r["table"]
        assert r["graph_matches_eager"] and r["split_matches_graph"]
        assert r["compiled_pieces"] and r["compiled_matches_eager"]
        assert r["grads_type"] == "ShardedGrads"


def _ddp_step(rank: int) -> tuple:
    """A DDP step of a 1-block GPT traced and split: a block and the root still fill three
    buckets of 0.01 MB (two blocks filled three of 0.02 MB), and each piece compiles apart,
    so fewer blocks trace faster."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=0.01, first_bucket_mb=0.01)
    x, y = random_tokens(model.cfg, 2, seed=rank)

    def step(state, x, y):
        return fs.value_and_grad(functools.partial(_loss, model))(state, x, y)

    eager = step(state, x, y)
    gm = trace(step, state, x, y)
    pieces = split(gm, bucket_mb=0.01, first_bucket_mb=0.01)
    return (
        len(state.shards),
        _collectives(gm),
        len(pieces.buckets),
        _same(pieces(state, x, y), eager, exact=True),
        _same(pieces.compile(backend="aot_eager")(state, x, y), eager, exact=False),
    )


def test_a_ddp_step_splits_with_its_in_place_all_reduces_as_graph_nodes():
    for flats, collectives, buckets, same, compiled_same in testing.run(_ddp_step, world_size=2):
        assert collectives == {"all_reduce_": flats, "wait_tensor": flats}  # one per DDP bucket
        assert buckets >= 3 and same and compiled_same


# --- the same buckets as torch's DDPOptimizer ------------------------------------------------


def _ddp_optimizer_buckets(gm: torch.fx.GraphModule, args: tuple, cap: int, first: int) -> list:
    """Drive DDPOptimizer.compile_fn on a forward graph with no process group; return its
    buckets as sets of node names, in graph order.

    It reads each parameter placeholder's `meta["example_value"]` (an nn.Parameter that
    requires grad), and the Dynamo bookkeeping it copies onto the pieces must exist.
    """
    from torch._dynamo.backends.distributed import DDPOptimizer

    leaves = gm.graph.process_inputs(*args)
    for node, leaf in zip(gm.graph.find_nodes(op="placeholder"), leaves, strict=True):
        node.meta["example_value"] = nn.Parameter(leaf) if leaf.requires_grad else leaf
        node._dynamo_source = None
    gm._param_name_to_source = {}
    optimizer = DDPOptimizer(
        bucket_bytes_cap=cap, backend_compile_fn=lambda m, _: m.forward, first_bucket_cap=first
    )
    optimizer.compile_fn(gm, list(leaves))
    return [{n.name for n in b.nodes if n.op != "get_attr"} for b in optimizer.buckets]


class Dense(nn.Module):
    """`x @ weight + bias`: a layer whose traced graph reads its parameters directly (an
    nn.Linear reads its weight through a transposed view, which DDPOptimizer does not follow)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def _mlp(widths: tuple[int, ...]) -> nn.Sequential:
    layers = []
    for d_in, d_out in itertools.pairwise(widths):
        layers += [Dense(d_in, d_out), nn.LayerNorm(d_out), nn.GELU()]
    return nn.Sequential(*layers)


def _forward(model, params, x):
    return fs.call(model, params, x)


@pytest.mark.parametrize(
    ("cap", "first"),
    [(2_000, 500), (6_000, 6_000), (100, 100), (10**9, 10**9), (4_000, 300), (1_500, 1_000)],
)
def test_forward_buckets_equal_ddp_optimizers_for_the_same_caps(cap, first):
    torch.manual_seed(0)
    model = _mlp((16, 32, 24, 32, 16, 8))
    params, _ = fs.extract(model)
    x = torch.randn(4, 16)
    ours = split(trace(functools.partial(_forward, model), params, x), cap / MiB, first / MiB)
    theirs = _ddp_optimizer_buckets(
        trace(functools.partial(_forward, model), params, x), (params, x), cap, first
    )
    assert [set(b.nodes) for b in ours.buckets] == theirs
    assert len(theirs) > 1 or cap == 10**9


def test_a_bucket_short_of_an_external_output_is_extended_and_the_table_says_so():
    def forward(p, x):
        h = torch.tanh(x @ p["w1"])
        h = torch.tanh(h @ p["w2"])
        h = h @ p["w3"]
        p["w3"].mul(2)  # read last, used by nothing: its bucket has no output until h
        return h

    params = {f"w{i}": torch.randn(8, 8, requires_grad=True) for i in (1, 2, 3)}
    x = torch.randn(4, 8)
    gm = trace(forward, params, x)
    pieces = split(gm, bucket_mb=200 / MiB, first_bucket_mb=200 / MiB)
    assert [b.params for b in pieces.buckets] == [("w1",), ("w2",), ("w3",)]
    assert pieces.buckets[-1].extended_by == 1 and pieces.buckets[0].extended_by == 0
    assert "warning: bucket 2 was extended by 1 nodes" in str(pieces)
    theirs = _ddp_optimizer_buckets(trace(forward, params, x), (params, x), 200, 200)
    assert [set(b.nodes) for b in pieces.buckets] == theirs
    assert torch.equal(pieces(params, x), gm(params, x))


# --- activation checkpointing ----------------------------------------------------------------


def _checkpointed_forward(model, params, x):
    """GPT's forward with every block checkpointed, each block called on its own params so the
    recomputation in backward binds them again."""
    T = x.shape[1]
    h = F.embedding(x, params["wte.weight"]) + params["wpe.weight"][:T]
    for i, block in enumerate(model.blocks):
        prefix = f"blocks.{i}."
        own = {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}
        h = activation_checkpoint.checkpoint(fs.call, block, own, h, use_reentrant=False)
    h = F.layer_norm(h, (model.cfg.d_model,), params["ln_f.weight"], params["ln_f.bias"])
    return F.linear(h, params["wte.weight"]) * model.cfg.d_model**-0.5


def _checkpointed_loss(model, params, x, y):
    return F.cross_entropy(_checkpointed_forward(model, params, x).flatten(0, 1), y.flatten())


def test_activation_checkpointing_is_inlined_by_tracing_and_still_splits_per_block():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2))
    params, _ = fs.extract(model)
    x, y = random_tokens(model.cfg, 2, seed=0)
    step = fs.value_and_grad(functools.partial(_checkpointed_loss, model))
    plain = fs.value_and_grad(functools.partial(_loss, model))(params, x, y)
    eager = step(params, x, y)
    assert _same(eager, plain, exact=False)  # checkpointing changes memory, not values

    gm = trace(step, params, x, y)
    plain_gm = trace(fs.value_and_grad(functools.partial(_loss, model)), params, x, y)
    mm = [
        len([n for n in g.graph.nodes if n.target is torch.ops.aten.addmm.default])
        for g in (gm, plain_gm)
    ]
    assert mm[0] > mm[1]  # the recomputed forward of the blocks is in the graph
    pieces = split(gm, bucket_mb=40_000 / MiB, first_bucket_mb=10_000 / MiB)
    assert len(pieces.buckets) >= 3, str(pieces)
    assert _same(pieces(params, x, y), gm(params, x, y), exact=True)
    assert _same(pieces.compile(backend="aot_eager")(params, x, y), eager, exact=False)


def test_a_graph_that_keeps_checkpoint_higher_order_ops_still_splits_between_them():
    """DDPOptimizer puts a graph with higher-order ops in one bucket (pytorch#104674)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    def block(h, w):
        return torch.tanh(h @ w)

    def forward(w1, w2, w3, x):
        for w in (w1, w2, w3):
            x = activation_checkpoint.checkpoint(block, x, w, use_reentrant=False)
        return x.sum()

    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    x = torch.randn(4, 8)
    torch.compile(forward, backend=capture, fullgraph=True)(*ws, x)
    gm = captured[0]
    hops = [
        n for n in gm.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint
    ]
    assert len(hops) == 3
    by_name = dict(zip(["l_x_", "l_w1_", "l_w2_", "l_w3_"], [x, *ws], strict=True))
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]  # Dynamo's order
    inputs = [by_name[n] for n in names]
    pieces = split(gm, 200 / MiB, 200 / MiB, params={n: 256 for n in names if n.startswith("l_w")})
    assert len(pieces.buckets) == 3
    assert all(sum(h.name in b.nodes for b in pieces.buckets) == 1 for h in hops)
    out, expected = pieces(*inputs)[0], gm(*inputs)[0]
    assert torch.equal(out, expected)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            torch.autograd.grad(out, ws), torch.autograd.grad(expected, ws), strict=True
        )
    )


# --- errors -----------------------------------------------------------------------------------


def _tiny_graph():
    params = {"w": torch.randn(4, 4, requires_grad=True)}
    return trace(lambda p, x: x @ p["w"], params, torch.randn(2, 4))


def test_a_graph_without_parameters_is_refused_with_the_fix():
    gm = trace(lambda x: x.sin(), torch.randn(3))
    with pytest.raises(ValueError, match="no parameter placeholders"):
        split(gm)


def test_a_graph_that_computes_nothing_is_refused():
    gm = trace(lambda p: p, {"w": torch.ones(2, requires_grad=True)})
    with pytest.raises(ValueError, match="computes nothing"):
        split(gm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_mb": -1}, "bucket_mb must be positive"),
        ({"first_bucket_mb": 0}, "first_bucket_mb must be positive"),
        ({"bucket_mb": 1, "first_bucket_mb": 2}, "must not exceed bucket_mb"),
        ({"params": {"nope": 4}}, "not placeholders of the graph"),
    ],
)
def test_bad_caps_and_names_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split(_tiny_graph(), **kwargs)


def test_a_non_tensor_argument_is_refused_by_trace():
    with pytest.raises(TypeError, match=r"args\[1\]\['steps'\] must be a tensor or None"):
        trace(lambda p, b: p["w"] * b["steps"], {"w": torch.ones(2)}, {"steps": 3})
    with pytest.raises(TypeError, match="must be callable"):
        trace(3, torch.ones(2))


def test_records_are_what_the_design_names():
    pieces = split(_tiny_graph(), bucket_mb=25, first_bucket_mb=1)
    assert isinstance(pieces, SplitGraph)
    (bucket,) = pieces.buckets
    assert bucket == Bucket(size_bytes=64, params=("w",), nodes=bucket.nodes, extended_by=0)
    assert "1 buckets" in repr(pieces) and "bucket" in str(pieces)
