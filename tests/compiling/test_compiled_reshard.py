"""A compiled step reshards as the eager one does (funcshard/compiling/_compiled_schedule.py).

One run on 2 ranks compiles a 4-block GPT's gradient step (FSDP, blocks as units) with
and without `reshard_after_forward`, through an aot_autograd backend that records the
scheduled graph and meters it op by op (LiveTensors inside the compiled graph: a dispatch
mode entered around a compiled call makes dynamo skip the frame). The aot_eager meter does
not see inductor's buffer reuse. Four blocks, the fewest whose resharded peak stays below the
kept one's (at three they are equal); dynamo's tracing, most of this file's time, grows with
the blocks (tests/DURATIONS.md).
"""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import testing
from funcshard.compiling import _compiled_schedule as compiled_schedule
from funcshard.compiling._compiled_schedule import REGATHERED, is_backward, reshard_backend, tag
from funcshard.testing.dynamo import isolated
from funcshard.testing.memory import LiveTensors, metering_compiler
from funcshard.testing.models import GPT, Block, GPTConfig, random_tokens

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, d_model=128, dropout=0.0)
AG = torch.ops._c10d_functional.all_gather_into_tensor.default
RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
UNOPTIMIZED = "aot_inductor.debug_compile"  # inductor's C++ kernels at -O0 -g, not -O3


def _loss(model, state, x, y):
    return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())


def _close(a, b, rtol: float = 1e-5, atol: float = 1e-6) -> bool:
    """Whether two trees of tensors agree leaf by leaf (None leaves on both sides)."""
    leaves = (torch.utils._pytree.tree_leaves(t) for t in (a, b))
    return all(
        (x is None and y is None) or torch.allclose(x.float(), y.float(), rtol=rtol, atol=atol)
        for x, y in zip(*leaves, strict=True)
    )


def _describe(graph: torch.fx.Graph) -> dict:
    """Per buffer: its all-gathers (position, regathered?) and reduce-scatters, and the
    position of the first compute node reading its forward gather."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    buffers: dict = {}
    for node in nodes:
        mark = tag(node)
        if mark is None:
            continue
        entry = buffers.setdefault(mark[0], {"unit": mark[1], "ag": [], "rs": 0, "reader": None})
        if node.target is AG:
            entry["ag"].append((position[node], bool(node.meta.get(REGATHERED))))
        elif node.target is RS:
            entry["rs"] += 1
            wait = next(iter(node.users))
            between = nodes[position[node] + 1 : position[wait]]
            entry["overlapped"] = sum(1 for n in between if is_backward(n) and tag(n) is None)
        elif not node.meta.get(REGATHERED) and not is_backward(node):
            for user in node.users:
                if tag(user) is None and not compiled_schedule._is_view(user):
                    first = entry["reader"]
                    entry["reader"] = (
                        position[user] if first is None else min(first, position[user])
                    )
    return buffers


@isolated()
def _compiled_runs(rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(CFG)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    x, y = random_tokens(CFG, 2, seed=rank)
    results = {}
    for reshard in (True, False):
        state = fs.shard(model, plan, fs.Mesh(shard=2), reshard_after_forward=reshard)
        step = fs.value_and_grad(functools.partial(_loss, model))
        with LiveTensors() as meter:
            eager = step(state, x, y)
        graphs, peaks = [], []
        metering = metering_compiler(peaks)

        def metered(gm, example_inputs, graphs=graphs, metering=metering):
            graphs.append(_describe(gm.graph))
            return metering(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(step, backend=reshard_backend(metered), fullgraph=True)
        got = compiled(state, x, y)
        difference = max(
            ((a - b).abs() / (b.abs() + 1e-6)).max().item()
            for a, b in zip(
                *(torch.utils._pytree.tree_leaves(t) for t in (got, eager)), strict=True
            )
        )
        results[reshard] = {
            "eager": meter.peak,
            "compiled": max(peaks),
            "graph": graphs[0],
            "difference": difference,
        }
    return results


@functools.cache
def _runs() -> dict:
    return testing.run(_compiled_runs, world_size=2, timeout=600)[0]


def test_compiled_step_with_resharding_peaks_near_eager_and_below_keeping_units_gathered():
    runs = _runs()
    eager, compiled, kept = runs[True]["eager"], runs[True]["compiled"], runs[False]["compiled"]
    print(
        f"peak: eager {eager / 1e6:.1f} MB, compiled {compiled / 1e6:.1f} MB (resharding), "
        f"{kept / 1e6:.1f} MB (reshard_after_forward=False)"
    )
    assert compiled <= 1.15 * eager
    assert compiled < kept


def test_compiled_graph_gathers_each_resharded_buffer_twice_and_reduces_each_once():
    buffers = _runs()[True]["graph"]
    assert len(buffers) == CFG.n_layer + 1  # a buffer per block, and the root's
    for entry in buffers.values():
        regathered = [r for _, r in entry["ag"]]
        if entry["unit"] == "":  # the root runs around the whole call: gathered once
            assert regathered == [False], entry
        else:
            assert regathered == [False, True], entry
        assert entry["rs"] == 1, entry
    kept = _runs()[False]["graph"]
    assert all(len(entry["ag"]) == 1 for entry in kept.values())


def test_each_reduce_scatter_but_the_last_overlaps_backward_compute():
    buffers = _runs()[True]["graph"].values()
    overlapped = sorted(entry.get("overlapped", 0) > 0 for entry in buffers)
    assert overlapped == [False] + [True] * (len(buffers) - 1), overlapped


def test_each_forward_all_gather_is_issued_before_the_compute_of_the_buffer_before_it():
    buffers = _runs()[True]["graph"]
    order = sorted(buffers.values(), key=lambda e: e["reader"])  # forward order of use
    for before, after in itertools.pairwise(order):
        forward_ag = next(p for p, regathered in after["ag"] if not regathered)
        assert forward_ag < before["reader"], (before["unit"], after["unit"])


@pytest.mark.parametrize("reshard", [True, False])
def test_compiled_loss_and_gradients_equal_eager(reshard):
    assert _runs()[reshard]["difference"] <= 1e-5


@isolated()
def _mixed_precision_and_frozen(rank: int) -> dict:
    """bf16 parameters, fp32 reduce, block 1 frozen: the compiled resharded step against
    eager, and the scheduled graph."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=3, n_head=2, d_model=32, dropout=0.0)
    model = GPT(cfg)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2), mp=mp)
    x, y = random_tokens(cfg, 2, seed=rank)
    step = fs.value_and_grad(functools.partial(_loss, model))
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(_describe(gm.graph))
        return gm.forward

    got = torch.compile(step, backend=reshard_backend(capture), fullgraph=True)(state, x, y)
    eager = step(state, x, y)
    close = _close(got, eager)
    return {"close": close, "graph": graphs[0]}


def test_mixed_precision_and_a_frozen_unit_reshard_too():
    result = testing.run(_mixed_precision_and_frozen, world_size=2, timeout=300)[0]
    assert result["close"]
    units = {entry["unit"]: entry for entry in result["graph"].values()}
    assert [r for _, r in units["blocks.1"]["ag"]] == [False, True]  # regathered, frozen
    assert units["blocks.1"]["rs"] == 0 and units["blocks.0"]["rs"] == 1


def _tiny_gpt_step(rank: int, n_layer: int = 2) -> tuple:
    """A GPT of `n_layer` blocks sharded on 2 ranks, this rank's batch and its gradient step."""
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64, block_size=16, n_layer=n_layer, n_head=2, d_model=32, dropout=0.0
    )
    model = GPT(cfg)
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    x, y = random_tokens(cfg, 2, seed=rank)
    return model, state, x, y, fs.value_and_grad(functools.partial(_loss, model))


@isolated()
def _blocks_compiled_one_by_one(rank: int) -> bool:
    model, state, x, y, step = _tiny_gpt_step(rank)
    eager = step(state, x, y)
    for block in model.blocks:
        block.compile(backend="aot_eager")  # as FSDP2 users compile each block
    got = step(state, x, y)
    return _close(got, eager)


def test_blocks_compiled_one_by_one_inside_an_eager_sharded_step_give_eager_gradients():
    assert all(testing.run(_blocks_compiled_one_by_one, world_size=2, timeout=300))


class _Hidden(torch.nn.Module):
    """A unit of one linear layer and tanh: its weight is read again in backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.linear(x))


@isolated()
def _inductor(rank: int) -> dict:
    """fs.compile with inductor (its default backend): the schedule runs on inductor's
    post-grad graph, where funcshard's tags and the backward marks survive. A root of two
    linear layers around one resharding unit (a linear layer and tanh): that is all the
    property needs, and inductor's time grows with the kernels it writes and compiles, each
    a gcc launch (a 1-block GPT wrote 19; tests/DURATIONS.md). Its C++ kernels compile in
    this process: the suite sets TORCHINDUCTOR_COMPILE_THREADS=1 (conftest.py). They compile
    at -O0 (inductor's `aot_inductor.debug_compile`, which CPU kernels read too): how fast
    they run is not what this checks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), _Hidden(), torch.nn.Linear(16, 1))
    plan = fs.plan(model, policy=fs.policy.module_classes({_Hidden}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    step = fs.value_and_grad(lambda s, x, y: (fs.call(model, s, x) - y).square().mean())
    regathered = []
    schedule = compiled_schedule.schedule

    def spy(graph):
        schedule(graph)
        regathered.append(sum(1 for n in graph.nodes if n.target is AG and n.meta.get(REGATHERED)))

    compiled_schedule.schedule = spy
    try:
        with torch._inductor.config.patch(fx_graph_cache=False, **{UNOPTIMIZED: True}):
            got = fs.compile(step, fullgraph=True)(state, x, y)
    finally:
        compiled_schedule.schedule = schedule
    eager = step(state, x, y)
    close = _close(got, eager, rtol=1e-4, atol=1e-5)  # inductor's kernels sum in other orders
    return {"regathered": regathered, "close": close}


def test_fs_compile_with_inductor_regathers_the_blocks_in_backward():
    result = testing.run(_inductor, world_size=2, timeout=300)[0]
    assert result["regathered"] == [1]  # one graph; the unit regathered, not the root
    assert result["close"]


@isolated()
def _resharded_to_two(rank: int) -> dict:
    """FSDP over 4 ranks with reshard_after_forward=2: backward regathers each block over 2
    ranks from the half each kept."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, dropout=0.0)
    model = GPT(cfg)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=4), reshard_after_forward=2)
    x, y = random_tokens(cfg, 2, seed=rank)
    step = fs.value_and_grad(functools.partial(_loss, model))
    gathers = []

    def capture(gm, example_inputs):
        gathers.extend(
            (tag(n)[1], n.args[1], bool(n.meta.get(REGATHERED)))
            for n in gm.graph.nodes
            if n.target is AG and tag(n) is not None
        )
        return gm.forward

    got = fs.compile(step, backend=reshard_backend(capture), fullgraph=True)(state, x, y)
    return {"close": _close(got, step(state, x, y)), "gathers": sorted(gathers)}


def test_resharding_to_k_ranks_regathers_from_groups_of_k():
    for result in testing.run(_resharded_to_two, world_size=4, timeout=300):
        assert result["close"]
        assert result["gathers"] == [
            ("", 4, False),  # the root: gathered once over the shard axis
            ("blocks.0", 2, True),  # regathered over 2 ranks from the half each kept
            ("blocks.0", 4, False),
            ("blocks.1", 2, True),
            ("blocks.1", 4, False),
        ], result["gathers"]


class _ProjectThenNorm(torch.nn.Module):
    """A unit whose first reader of its gather reads a view: the bias-free projection's
    matmul reads only `t` of its weight; the norm reads its parameters directly, later."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(x))


@isolated()
def _read_through_views(rank: int) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_ProjectThenNorm(), _ProjectThenNorm())
    plan = fs.plan(model, policy=fs.policy.module_classes({_ProjectThenNorm}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    step = fs.value_and_grad(lambda s, x: fs.call(model, s, x).square().mean())
    got = fs.compile(step, backend="aot_eager", fullgraph=True)(state, x)
    return _close(got, step(state, x))


def test_a_gather_first_read_through_a_view_is_placed_before_that_read():
    assert all(testing.run(_read_through_views, world_size=2, timeout=300))
