"""torch.compile of a whole training step (funcshard/step/_compiled.py).

A step that calls `fs.value_and_grad` and `opt.step` compiles into one graph (no graph
breaks), is not recompiled after its second call, and computes what the eager step
computes, on FSDP, DDP and HSDP meshes.

The GPTs here have one block: the root beside one block unit is two units, which is what
these properties need, and dynamo's tracing, most of this file's time, grows with the blocks
(a 2-block value_and_grad traced in about 1.7 times a 1-block one's time; tests/DURATIONS.md).
"""

import copy
import functools
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing.compare import assert_trees_close
from funcshard.testing.dynamo import isolated
from funcshard.testing.models import GPT, Block, ConvNet, GPTConfig, random_tokens

MESHES = {
    "fsdp": ({"shard": 2}, 2),
    "ddp": ({"replicate": 2}, 2),
    "hsdp": ({"replicate": 2, "shard": 2}, 4),
}


def _gpt_loss(model, state, x, y):
    return F.cross_entropy(fs.call(model, state, x).flatten(0, 1), y.flatten())


def _graph_breaks() -> dict[str, int]:
    return dict(torch._dynamo.utils.counters["graph_break"])


def _clone(tree):
    return torch.utils._pytree.tree_map(lambda t: None if t is None else t.clone(), tree)


@isolated()
def _train(mesh_kwargs: dict, optimizer: str, rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(**mesh_kwargs)
    )
    opt = fs.optim.sgd(0.1, momentum=0.9) if optimizer == "sgd" else fs.optim.adamw(1e-3)
    loss_fn = functools.partial(_gpt_loss, model)

    def step(state, opt_state, x, y):
        loss, grads = fs.value_and_grad(loss_fn)(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
        return loss, state, opt_state

    compiled_step = fs.compile(step, backend="aot_eager", fullgraph=True)  # resharding
    eager, compiled = (_clone(state), opt.init(state)), (_clone(state), opt.init(state))
    losses = []
    for i in range(4):
        x, y = random_tokens(model.cfg, 2, seed=10 * rank + i)
        if i == 2:  # from the third step on, any recompilation raises
            torch._dynamo.config.error_on_recompile = True
        before = compiled
        compiled_loss, *compiled = compiled_step(*compiled, x, y)
        eager_loss, *eager = step(*eager, x, y)
        donated = _donation_errors(before[0], before[1])
        losses.append((compiled_loss.item(), eager_loss.item()))
        if i == 0:
            first = _clone((compiled[0].shards, eager[0].shards))
    torch._dynamo.config.error_on_recompile = False
    return {
        "losses": losses,
        "first shards": first,
        "shards": (compiled[0].shards, eager[0].shards),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "breaks": _graph_breaks(),
        "donated": donated,
    }


def _donation_errors(state: fs.ShardedState, opt_state) -> list[str]:
    """What reading a state and optimizer state after a compiled step donated them raises."""
    errors = []
    for read in (
        lambda: state.shards[0],
        lambda: state.replace(),
        lambda: fs.unshard(state),
        lambda: torch.utils._pytree.tree_leaves(opt_state)[1] + 1,
    ):
        try:
            read()
            errors.append("nothing raised")
        except fs.DonatedError as e:
            errors.append(str(e).split(",")[0])
    return errors


# FSDP's compiled step is in the quick lane; DDP's and HSDP's run in the whole suite.
@pytest.mark.parametrize(
    "mesh", [pytest.param(m, marks=[pytest.mark.quick] if m == "fsdp" else []) for m in MESHES]
)
def test_a_compiled_sgd_step_is_one_graph_and_trains_like_the_eager_step(mesh):
    mesh_kwargs, world = MESHES[mesh]
    for r in testing.run(functools.partial(_train, mesh_kwargs, "sgd"), world, timeout=240):
        assert r["breaks"] == {} and r["graphs"] == 1
        assert all("was donated to" in e for e in r["donated"]), r["donated"]
        for compiled_loss, eager_loss in r["losses"]:
            assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
        for a, b in zip(*r["shards"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_compiled_adamw_step_matches_the_eager_step():
    # torch's fused AdamW kernel has no functional form to trace, so the compiled step runs
    # the unfused math. Rounding apart, they agree: parameters after one step to 1e-6. Later
    # steps drift (Adam divides tiny moments; torch's own fused and single-tensor AdamW
    # drift alike), so after that only the losses are compared.
    for r in testing.run(functools.partial(_train, {"shard": 2}, "adamw"), 2, timeout=240):
        assert r["breaks"] == {} and r["graphs"] == 1
        assert all("was donated to" in e for e in r["donated"]), r["donated"]
        for compiled_loss, eager_loss in r["losses"]:
            assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
        for a, b in zip(*r["first shards"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@isolated()
def _grads_both_ways(variant: str, rank: int) -> tuple:
    """One value_and_grad, compiled and eager, for a variant of the model or its options."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    mesh, options, mp, units, frozen = {"shard": 2}, {}, None, {Block}, "error"
    groups, per_unit = (), None
    if variant == "frozen unit":
        model.wpe.weight.requires_grad_(False)
        units = {Block, nn.Embedding}
    elif variant == "frozen member":
        model.wpe.weight.requires_grad_(False)
        frozen = "warn"
    elif variant == "bf16":  # with a unit of two modules, and one reduced in its own bf16
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        groups, per_unit = [["ln_f", "head"]], {"blocks.0": fs.MixedPrecision(torch.bfloat16)}
    elif variant == "reduce=False":
        options = {"reduce": False}
    elif variant == "all_reduce=False":
        mesh, options = {"replicate": 2, "shard": 2}, {"all_reduce": False}
    elif variant == "keep_local":
        options = {"keep_local": ("blocks.0",)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen="warn" warns
        policy = fs.policy.module_classes(units)
        plan = fs.plan(model, policy, frozen=frozen, groups=groups, mp=per_unit)
    state = fs.shard(model, plan, fs.Mesh(**mesh), mp=mp)
    x, y = random_tokens(model.cfg, 2, seed=rank)

    def loss_and_logits(state, x, y):
        logits = fs.call(model, state, x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), logits.sum()

    value_and_grad = fs.value_and_grad(loss_and_logits, has_aux=True, **options)
    compiled = torch.compile(value_and_grad, backend="aot_eager", fullgraph=True)(state, x, y)
    return compiled, value_and_grad(state, x, y), _graph_breaks()


@pytest.mark.parametrize(
    "variant",
    ["frozen unit", "frozen member", "bf16", "reduce=False", "all_reduce=False", "keep_local"],
)
def test_compiled_gradients_equal_eager_ones(variant):
    world = 4 if variant == "all_reduce=False" else 2
    for compiled, eager, breaks in testing.run(
        functools.partial(_grads_both_ways, variant), world, timeout=240
    ):
        assert breaks == {}
        assert type(compiled[1]) is type(eager[1])
        # None (frozen) where eager has None, the same numbers everywhere else
        assert_trees_close(compiled, eager)


@isolated()
def _batch_norm_step(rank: int) -> tuple:
    torch.manual_seed(0)
    model = ConvNet().train()
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=2))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(rank))
    labels = torch.randint(10, (4,), generator=torch.Generator().manual_seed(rank))

    def loss_fn(state, x, labels):
        logits, buffers = fs.call(model, state, x, mutable=True)
        return F.cross_entropy(logits, labels), buffers

    value_and_grad = fs.value_and_grad(loss_fn, has_aux=True)
    compiled = torch.compile(value_and_grad, backend="aot_eager", fullgraph=True)
    return compiled(state, x, labels), value_and_grad(state, x, labels), state.buffers


def test_a_compiled_step_returns_updated_buffers_and_leaves_the_states_alone():
    for compiled, eager, before in testing.run(_batch_norm_step, 2, timeout=240):
        assert_trees_close(compiled, eager)
        moved = compiled[0][1]["features.1.running_mean"]
        assert not torch.equal(moved, before["features.1.running_mean"])


@isolated(trace_autograd_ops=False)
def _without_trace_autograd_ops(rank: int) -> tuple:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=2))
    x, y = random_tokens(model.cfg, 2, seed=rank)
    value_and_grad = fs.value_and_grad(functools.partial(_gpt_loss, model))
    compiled = torch.compile(value_and_grad, backend="aot_eager")(state, x, y)
    breaks = _graph_breaks()
    return compiled, value_and_grad(state, x, y), breaks


def test_without_trace_autograd_ops_it_still_works_breaking_only_at_autograd_grad():
    for compiled, eager, breaks in testing.run(_without_trace_autograd_ops, 2, timeout=240):
        assert_trees_close(compiled, eager)
        assert [b.split(" with")[0] for b in breaks] == ["using `torch.autograd.grad`"], breaks


@isolated()
def _other_transforms(what: str, rank: int) -> tuple:
    """A function of other funcshard transforms, compiled and eager."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    x, y = random_tokens(model.cfg, 2, seed=rank)
    loss_fn = functools.partial(_gpt_loss, model)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), fs.optim.sgd(0.1))

    def clipped_step(state, opt_state, x, y):
        _, grads = fs.value_and_grad(loss_fn)(state, x, y)
        return opt.step(grads, opt_state, state)

    def accumulated(state, x, y):
        _, first = fs.value_and_grad(loss_fn, reduce=False)(state, x, y)
        _, second = fs.value_and_grad(loss_fn, reduce=False)(state, y, x)
        return fs.reduce(state, fs.accumulate(first, second))

    def unsharded_and_evaluated(state, x):
        with torch.no_grad():
            return fs.unshard(state), fs.call(model, state, x)

    fn, args = {
        "clip and sgd": (clipped_step, (state, opt.init(state), x, y)),
        "accumulate and reduce": (accumulated, (state, x, y)),
        "unshard and eval": (unsharded_and_evaluated, (state, x)),
    }[what]
    compiled = fs.compile(fn, backend="aot_eager", fullgraph=True)(*_clone(args))
    return compiled, fn(*_clone(args)), _graph_breaks()


@pytest.mark.parametrize("what", ["clip and sgd", "accumulate and reduce", "unshard and eval"])
def test_other_transforms_compile_into_one_graph_too(what):
    for compiled, eager, breaks in testing.run(
        functools.partial(_other_transforms, what), 2, timeout=240
    ):
        assert breaks == {}
        assert_trees_close(compiled, eager)


@isolated()
def _edge_case(case: str, rank: int) -> tuple:
    """A value_and_grad where compiling could change the answer, compiled and eager."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    x, y = random_tokens(model.cfg, 2, seed=rank)
    loss_fn = functools.partial(_gpt_loss, model)

    def with_a_term_on_the_shards(state, x, y):  # gradients flow only through fs.call
        return loss_fn(state, x, y) + sum(s.square().sum() for s in state.shards)

    def without_grad(state, x, y):
        with torch.no_grad():
            return loss_fn(state, x, y)

    def unsharding_inside(state, x, y):
        return loss_fn(state, x, y) + 0 * fs.unshard(state)["wte.weight"].sum()

    if case == "compiled loss, eager value_and_grad":
        step = fs.value_and_grad(torch.compile(loss_fn, backend="aot_eager"))
        return step(state, x, y), fs.value_and_grad(loss_fn)(state, x, y)
    if case == "copied state":
        copied = copy.deepcopy(state)
        step = fs.value_and_grad(loss_fn)
        return fs.compile(step, backend="aot_eager", fullgraph=True)(copied, x, y), step(
            state, x, y
        )
    f, options = {
        "a term on the shards": (with_a_term_on_the_shards, {}),
        "no grad": (without_grad, {}),
        "unshard inside, reduce=False": (unsharding_inside, {"reduce": False}),
    }[case]
    step = fs.value_and_grad(f, **options)
    return fs.compile(step, backend="aot_eager", fullgraph=True)(state, x, y), step(state, x, y)


@pytest.mark.parametrize(
    "case",
    [
        "compiled loss, eager value_and_grad",
        "copied state",
        "a term on the shards",
        "no grad",
        "unshard inside, reduce=False",
    ],
)
def test_compiling_does_not_change_the_answer_at_the_edges(case):
    for compiled, eager in testing.run(functools.partial(_edge_case, case), 2, timeout=240):
        assert_trees_close(compiled, eager)
        grads = torch.utils._pytree.tree_leaves(compiled[1])
        assert any(g.abs().sum() > 0 for g in grads) == (case != "no grad")


class _CheckpointedBlock(Block):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


@isolated(trace_autograd_ops=False)
def _checkpointed_blocks_compiled(rank: int) -> tuple:
    # torch's rematerialization in a traced forward-loss-backward graph refuses RNG ops in
    # recomputed regions (CPU attention counts as one), so this runs in dynamo's default
    # mode: the backward left to AOTAutograd's joint graph, one break at autograd.grad
    torch.manual_seed(0)
    # one checkpointed unit is what this needs; tracing grows with the blocks
    model = GPT(GPTConfig(n_layer=1))
    state = fs.shard(
        model, fs.plan(model, policy=fs.policy.module_classes({Block})), fs.Mesh(shard=2)
    )
    x, y = random_tokens(model.cfg, 2, seed=rank)
    step = fs.value_and_grad(functools.partial(_gpt_loss, model))
    for block in model.blocks:
        block.__class__ = _CheckpointedBlock
    compiled = torch.compile(step, backend="aot_eager")(state, x, y)
    for block in model.blocks:
        block.__class__ = Block
    return compiled, step(state, x, y)


def test_checkpointed_blocks_in_a_compiled_step_give_the_unchecked_gradients():
    for compiled, eager in testing.run(_checkpointed_blocks_compiled, 2, timeout=240):
        assert_trees_close(compiled, eager)


@isolated()
def _compiled_dict_steps() -> tuple[list[str], int]:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = fs.optim.sgd(0.1, momentum=0.9)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(params, opt_state, x):
        _, grads = fs.value_and_grad(lambda p: fs.call(model, p, x).sum())(params)
        return opt.step(grads, opt_state, params)

    opt_state, errors = opt.init(params), []
    for _ in range(3):
        old = params
        params, opt_state = step(params, opt_state, torch.randn(2, 4))
        with pytest.raises(fs.DonatedError) as caught:
            old["weight"] + 1
        errors.append(str(caught.value))
    return errors, torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_a_params_dict_a_compiled_step_donated_raises_when_read():
    errors, graphs = _compiled_dict_steps()
    assert graphs == 1
    assert all("donated to apply_updates(donate=True)" in e for e in errors), errors


@isolated(trace_autograd_ops=False)
def _fs_compile_step(rank: int) -> dict:
    """A step compiled with fs.compile and no flag set, called three times; then rank 1 skips
    the next step, so rank 0's collectives inside the graph time out."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1))
    mesh = fs.Mesh(shard=2, timeout=timedelta(seconds=3))
    state = fs.shard(model, fs.plan(model, policy=fs.policy.module_classes({Block})), mesh)
    opt = fs.optim.sgd(0.1)

    @fs.compile(backend="aot_eager", fullgraph=True)
    def train_step(state, opt_state, x, y):
        loss, grads = fs.value_and_grad(functools.partial(_gpt_loss, model))(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
        return loss, state, opt_state

    opt_state, result = opt.init(state), {"root": state.layout.flats[-1].name}
    for i in range(3):
        x, y = random_tokens(model.cfg, 2, seed=10 * rank + i)
        _, state, opt_state = train_step(state, opt_state, x, y)
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["breaks"] = _graph_breaks()
    result["flag after"] = torch._dynamo.config.trace_autograd_ops
    if rank == 1:
        time.sleep(4)  # past rank 0's 3 s timeout
    else:
        started = time.monotonic()
        with pytest.raises(fs.CollectiveError) as caught:
            train_step(state, opt_state, x, y)
        result["error"], result["seconds"] = str(caught.value), time.monotonic() - started
    return result


def test_a_collective_that_times_out_inside_a_compiled_step_raises_collective_error():
    """One compiled step checks both: before the hang, three calls of it on both ranks are one
    graph without breaks, leaving dynamo's flag as it was; then a collective in it that times
    out raises a CollectiveError on rank 0 (one compilation, on the fresh ranks the timeout
    needs, where two compiled the same step)."""
    results = testing.run(_fs_compile_step, 2, timeout=240, fresh=True)
    for r in results:
        assert r["graphs"] == 1 and r["breaks"] == {}
        assert r["flag after"] is False  # scoped to the compiled calls
    r = results[0]
    assert r["seconds"] < 6, r["seconds"]
    assert r["error"].startswith(
        "rank 0: a collective inside the compiled step "
        "'_fs_compile_step.<locals>.train_step' over the mesh replicate=1 x shard=2 "
        "(ranks [0, 1]) did not complete: "
    ), r["error"]
    assert "Timed out" in r["error"]
    assert (  # the root's gather comes first: the embedding reads it first
        "The last collective this call issued on the shard axis was its #1 there (ranks [0, 1]): "
        f"the all-gather of unit {r['root']!r}" in r["error"]
    ), r["error"]


def test_a_users_list_of_inductor_pre_passes_is_kept_and_the_schedule_runs_after_it():
    """inductor accepts a list of post-grad pre-passes; fs.compile keeps the user's, in order,
    and appends its schedule (it used to wrap the list as one pass, which inductor then
    called: "'list' object is not callable")."""
    from torch._inductor import config

    from funcshard.compiling import _jit

    def users_pass(graph):
        pass

    with config.patch(post_grad_custom_pre_pass=[users_pass]):
        with _jit._inductor_pass():
            passes = config.post_grad_custom_pre_pass
            assert isinstance(passes, list) and passes[0] is users_pass and len(passes) == 2
            assert isinstance(passes[1], _jit._guarded_pass_class())
            with _jit._inductor_pass():  # a nested call: the schedule once, not twice
                assert len(config.post_grad_custom_pre_pass) == 2
        assert config.post_grad_custom_pre_pass == [users_pass]
