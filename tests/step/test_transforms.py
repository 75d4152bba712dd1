"""shard/unshard/reshard/reduce on hand-built models: meta init, errors, buffers, precision."""

import functools
import math
import time

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.testing.models import GPT, Block, ConvNet, GPTConfig

BLOCKS = fs.policy.module_classes({Block})


class Rotary(nn.Module):
    """A layer with a computed, non-persistent buffer (like rotary inv_freq)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.scale = nn.Parameter(torch.empty(dim))
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()
        self.reset_buffers()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.scale)

    def reset_buffers(self) -> None:
        self.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))


class Uninitializable(nn.Module):
    """Creates its parameter in __init__ with no reset_parameters: meta init cannot redo it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.alpha = nn.Parameter(torch.randn(3))


def _meta_equals_materialized(world: int, rank: int) -> bool:
    cfg = GPTConfig(n_layer=2)
    torch.manual_seed(123)
    reference = GPT(cfg)
    with torch.device("meta"):
        meta = GPT(cfg)
    state = fs.shard(meta, fs.plan(meta, policy=BLOCKS), fs.Mesh(shard=world), seed=123)
    full = fs.unshard(state)
    assert all(p.is_meta for p in meta.parameters())  # the caller's model is untouched
    return all(torch.equal(full[k], v) for k, v in reference.named_parameters())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_meta_gpt_shards_to_the_values_of_a_materialized_one_on_any_world_size(world):
    assert all(testing.run(functools.partial(_meta_equals_materialized, world), world_size=world))


def _meta_rotary(rank: int) -> tuple:
    torch.manual_seed(5)
    reference = nn.Sequential(Rotary(), nn.BatchNorm1d(8))
    with torch.device("meta"):
        meta = nn.Sequential(Rotary(), nn.BatchNorm1d(8))
    state = fs.shard(meta, fs.plan(meta), fs.Mesh(shard=2), seed=5)
    ref_buffers = dict(reference.named_buffers())
    return all(torch.equal(state.buffers[k], v) for k, v in ref_buffers.items()), sorted(
        state.buffers
    )


def test_meta_init_computes_non_persistent_buffers_and_batchnorm_stats():
    for same, names in testing.run(_meta_rotary, world_size=2):
        assert same
        assert names == ["0.inv_freq", "1.num_batches_tracked", "1.running_mean", "1.running_var"]


def _meta_uninitializable(rank: int) -> None:
    with torch.device("meta"):
        model = Uninitializable()
    fs.shard(model, fs.plan(model), fs.Mesh(shard=2))


def test_a_parameter_left_on_meta_is_named_on_every_rank():
    with pytest.raises(RuntimeError, match=r"still on the meta device .* 'alpha'") as info:
        testing.run(_meta_uninitializable, world_size=2)
    assert "define no reset_parameters()" in str(info.value)
    assert "ranks [1] raised too" in str(info.value.__cause__)


def _mismatched_on_rank1(rank: int) -> None:
    model = GPT(GPTConfig(d_model=32 if rank == 0 else 48))
    fs.shard(model, fs.plan(model, policy=BLOCKS), fs.Mesh(shard=2))


def test_a_model_that_differs_on_one_rank_fails_on_every_rank_naming_the_parameter():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="ranks disagree on the model") as info:
        testing.run(_mismatched_on_rank1, world_size=2, timeout=30)
    assert time.perf_counter() - start < 10
    message = str(info.value)
    assert "'blocks.0.ln1.weight' is (32,) torch.float32 on rank 0" in message
    assert "(48,) torch.float32 on rank 1" in message
    assert "ranks [1] raised too" in str(info.value.__cause__)


def _plan_of_another_model_on_rank0(rank: int) -> None:
    model = GPT()
    other = GPT(GPTConfig(n_layer=3)) if rank == 0 else model
    fs.shard(model, fs.plan(other, policy=BLOCKS), fs.Mesh(shard=2))


def test_a_plan_of_another_model_is_named_on_every_rank():
    with pytest.raises(ValueError, match=r"on rank 0: the plan does not describe this model"):
        testing.run(_plan_of_another_model_on_rank0, world_size=2, timeout=30)


def _unseeded(rank: int) -> None:
    torch.manual_seed(rank)
    model = GPT()
    fs.shard(model, fs.plan(model, policy=BLOCKS), fs.Mesh(shard=2))


def test_ranks_holding_different_initial_values_are_an_error_not_a_stitched_state():
    with pytest.raises(
        ValueError,
        match=r"'blocks\.0\.attn\.qkv\.weight' holds different values on rank 0 and rank 1",
    ):
        testing.run(_unseeded, world_size=2)


def _integer_param(rank: int) -> None:
    model = nn.Module()
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    fs.shard(model, fs.plan(model), fs.Mesh(shard=2))


def test_non_float_parameters_are_named():
    with pytest.raises(ValueError, match=r"parameters 'steps' are not floating point"):
        testing.run(_integer_param, world_size=2)


def _bad_reshard(value, rank: int) -> None:
    model = GPT()
    fs.shard(model, fs.plan(model), fs.Mesh(shard=4), reshard_after_forward=value)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (3, ValueError, r"must divide the shard size 4; choose one of \[1, 2, 4\]"),
        (2.0, TypeError, "must be True, False or an int"),
    ],
)
def test_reshard_after_forward_must_divide_the_shard_size(value, error, message):
    with pytest.raises(error, match=message):
        testing.run(functools.partial(_bad_reshard, value), world_size=4)


def _buffers_from_rank0(rank: int) -> list:
    torch.manual_seed(0)
    model = ConvNet()
    torch.manual_seed(rank)  # every rank holds different buffers
    for b in model.buffers():
        if b.is_floating_point():
            b.normal_()
    state = fs.shard(model, fs.plan(model), fs.Mesh(shard=2))
    return [state.buffers[k] for k in sorted(state.buffers)]


def test_buffers_are_broadcast_from_the_first_rank():
    rank0, rank1 = testing.run(_buffers_from_rank0, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(rank0, rank1, strict=True))


def _hsdp_reduce(kwargs: dict, rank: int) -> tuple:
    torch.manual_seed(0)
    model = GPT()
    mesh = fs.Mesh(replicate=2, shard=2)
    state = fs.shard(model, fs.plan(model, policy=BLOCKS), mesh)
    grads = {k: torch.full_like(v, float(rank + 1)) for k, v in model.named_parameters()}
    reduced = fs.reduce(state, grads, **kwargs)
    values = torch.cat(
        [
            s[: f.numel - mesh.shard_rank * f.shard_numel]
            for s, f in zip(reduced.shards, state.layout.flats, strict=True)
        ]
    )
    return mesh.replicate_rank, values.unique().tolist()


def test_hsdp_reduce_averages_over_all_ranks_or_only_the_shard_group():
    # ranks 0,1 hold replica 0 (grads 1, 2); ranks 2,3 replica 1 (grads 3, 4)
    assert [v for _, v in testing.run(functools.partial(_hsdp_reduce, {}), 4)] == [[2.5]] * 4
    partial = testing.run(functools.partial(_hsdp_reduce, {"all_reduce": False}), 4)
    assert partial == [(0, [1.5]), (0, [1.5]), (1, [3.5]), (1, [3.5])]
    summed = testing.run(functools.partial(_hsdp_reduce, {"divide_factor": 2.0}), 4)
    assert [v for _, v in summed] == [[5.0]] * 4


def _mixed_precision_reduce(rank: int) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    plan = fs.plan(model, keep_fp32=(nn.LayerNorm,), policy=fs.policy.size(1))
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    state = fs.shard(model, plan, fs.Mesh(shard=2), mp=mp)
    third = 1.0 / 3.0 + rank  # not exact in bf16
    grads = {k: torch.full_like(v, third) for k, v in model.named_parameters()}
    reduced = fs.reduce(state, grads)
    return [(s.dtype, s[0].item()) for s in reduced.shards]


def test_mixed_precision_reduces_in_reduce_dtype_and_returns_the_param_dtype():
    out = testing.run(_mixed_precision_reduce, world_size=2)[0]
    (linear_dtype, linear), (ln_dtype, ln) = out
    assert linear_dtype == ln_dtype == torch.float32  # master dtype
    exact = (1 / 3 + 4 / 3) / 2
    assert linear != exact and abs(linear - exact) < 1e-2  # went through bf16
    assert ln == pytest.approx(exact, rel=1e-6)  # keep_fp32 unit reduced in fp32


def _frozen_and_mixed_dtypes(rank: int) -> tuple:
    torch.manual_seed(0)
    model = nn.Module()
    model.frozen = nn.Linear(3, 3)
    model.frozen.requires_grad_(False)
    model.mixed = nn.Linear(3, 5)
    model.mixed.weight.data = model.mixed.weight.data.bfloat16()
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    full = fs.unshard(state)
    grads = {k: torch.ones_like(v) for k, v in model.named_parameters()}
    reduced = fs.reduce(state, grads)
    return (
        [(f.name, f.frozen) for f in state.layout.flats],
        [None if g is None else g.dtype for g in reduced.shards],
        all(torch.equal(full[k], v) for k, v in model.named_parameters()),
    )


def test_frozen_units_are_not_reduced_and_a_unit_may_hold_two_dtypes():
    flats, grad_dtypes, roundtrip = testing.run(_frozen_and_mixed_dtypes, world_size=2)[0]
    assert flats == [
        ("frozen[float32]", True),
        ("mixed[bfloat16]", False),
        ("mixed[float32]", False),
    ]
    assert grad_dtypes == [None, torch.bfloat16, torch.float32]
    assert roundtrip


def _partial_and_async(rank: int) -> tuple:
    torch.manual_seed(0)
    model = GPT()
    state = fs.shard(model, fs.plan(model, policy=BLOCKS), fs.Mesh(shard=2), offload=True)
    block = fs.unshard(state, units=["blocks.1"])
    handle = fs.unshard_async(state)
    full = handle.wait()
    try:
        fs.unshard(state, units=["blocks.9"])
    except ValueError as e:
        error = str(e)
    params = dict(model.named_parameters())
    return (
        sorted(block) == sorted(k for k in params if k.startswith("blocks.1.")),
        all(torch.equal(full[k], v) for k, v in params.items()),
        error,
    )


def test_unshard_of_some_units_and_async_unshard():
    only_block, full_ok, error = testing.run(_partial_and_async, world_size=2)[0]
    assert only_block and full_ok
    assert "units ['blocks.9'] are not in this state" in error


def _state_as_pytree(rank: int) -> tuple:
    import torch._dynamo

    torch.manual_seed(0)
    model = ConvNet()
    state = fs.shard(model, fs.plan(model, policy=fs.policy.size(100)), fs.Mesh(shard=2))
    leaves = optree.tree_leaves(state)
    torch_leaves = torch_pytree.tree_leaves(state)
    doubled = optree.tree_map(lambda t: t * 2, state)
    torch_doubled = torch_pytree.tree_map(lambda t: t * 2, state)
    return (
        len(leaves) == len(torch_leaves) == len(state.shards) + len(state.buffers),
        {id(t) for t in leaves} == {id(t) for t in torch_leaves},  # optree sorts dict keys
        type(doubled) is fs.ShardedState and doubled.layout == state.layout,
        all(torch.equal(a * 2, b) for a, b in zip(state.shards, torch_doubled.shards, strict=True)),
        repr(state).count("\n"),
        math.prod(state.shards[0].shape) == state.layout.flats[0].shard_numel,
    )


def test_a_state_is_a_pytree_for_optree_and_torch_whose_leaves_are_its_tensors():
    leaves_ok, same_order, mapped, torch_mapped, repr_lines, shard_numel = testing.run(
        _state_as_pytree, world_size=2
    )[0]
    assert leaves_ok and same_order and mapped and torch_mapped and shard_numel
    assert repr_lines >= 3


class _DataInit(nn.Module):
    """Initializes through .data, which does not move the version counter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.w.data.normal_()


def _meta_data_init(rank: int) -> bool:
    torch.manual_seed(3)
    reference = _DataInit()
    with torch.device("meta"):
        meta = _DataInit()
    state = fs.shard(meta, fs.plan(meta), fs.Mesh(shard=2), seed=3)
    return torch.equal(fs.unshard(state)["w"], reference.w)


def test_meta_init_through_data_counts_as_initialized():
    """Regression: an init writing through .data was reported as never initialized."""
    assert all(testing.run(_meta_data_init, world_size=2))


def _odd_dtypes(rank: int) -> tuple:
    torch.manual_seed(0)
    model = nn.Module()
    model.z = nn.Parameter(torch.randn(3, dtype=torch.complex128))
    model.step = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    plan = fs.plan(model, ignored=["step"])
    state = fs.shard(model, plan, fs.Mesh(shard=2))
    full = fs.unshard(state)
    full["step"].add_(1)  # the caller's copy: the state is not written
    root = fs.unshard(state, "")  # one unit named by a string
    return torch.equal(full["z"], model.z), state.replicated["step"].tolist(), sorted(root)


def test_complex_params_shard_and_ignored_params_may_be_integers():
    same, step, root = testing.run(_odd_dtypes, world_size=2)[0]
    assert same and step == [0, 0] and root == ["z"]


def _seeded_per_rank(rank: int) -> str:
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    try:
        fs.shard(meta, fs.plan(meta), fs.Mesh(shard=2), seed=rank)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_seed_that_differs_across_ranks_is_refused_on_every_rank_saying_how_to_seed_each():
    """`shard(meta_model, ..., seed=rank)` was accepted: each rank initialized its slice of
    the model under its own seed, a model stitched from two inits."""
    for message in testing.run(_seeded_per_rank, world_size=2):
        assert message.startswith(
            "funcshard.shard: seed must be the same on every rank (it initializes one model, "
            "the same on any world size), got 0 on rank 0, 1 on rank 1."
        ), message
        assert "funcshard.rank_seed(seed, mesh)" in message
        assert "funcshard.manual_seed(seed, mesh, step)" in message


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fs.shard({"fc.weight": torch.ones(2, 2)}, None, None),
         r"funcshard\.shard: model must be a torch\.nn\.Module instance, got a dict \(keys "
         r"'fc\.weight'\)\. Pass the module"),
        (lambda: fs.plan(_Net), r"funcshard\.plan: model must be a torch\.nn\.Module instance, "
         r"got the class _Net itself\. Build the model first, e\.g\. _Net\(config\)"),
        (lambda: fs.replicate(_Net, None), r"funcshard\.replicate: model must be a torch\.nn\."
         r"Module instance, got the class _Net itself"),
        (lambda: fs.replicate(_Net(), {"replicate": 2}),
         r"funcshard\.replicate: mesh must be a funcshard\.Mesh, got dict\. Make one with"),
        (lambda: fs.shard(_Net(), fs.policy.size(min_numel=1), None),
         r"funcshard\.shard: plan must be a funcshard\.Plan, got .*\. The arguments are "
         r"shard\(model, plan, mesh, \.\.\.\): make the plan with funcshard\.plan"),
        (lambda: fs.shard(_Net(), fs.plan(_Net()), "mesh"),
         r"funcshard\.shard: mesh must be a funcshard\.Mesh, got str"),
    ],
)  # fmt: skip
def test_a_non_module_class_or_dict_is_refused_naming_the_argument_and_what_it_takes(call, message):
    """These were a bare AttributeError ('dict' object has no attribute 'named_parameters',
    'Linear' has no attribute ...), raised where the value was first used."""
    with pytest.raises(TypeError, match=message):
        call()


def _pickled_state(rank: int) -> bytes:
    import pickle

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return pickle.dumps(fs.shard(model, fs.plan(model), fs.Mesh(shard=2)))


def _unpickled(data: bytes, rank: int) -> str:
    import pickle

    try:
        pickle.loads(data)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_state_pickled_in_another_world_is_refused_saying_its_groups_are_not_here():
    """A state pickled in a world of 2 and read in a world of 4 raised "Could not resolve
    the process group registered under the name 1", or resolved a group of other ranks
    that happened to have the same name."""
    data, _ = testing.run(_pickled_state, world_size=2)
    for rank, message in enumerate(testing.run(functools.partial(_unpickled, data), 4)):
        assert message.startswith(
            "funcshard.Mesh(replicate=1, shard=2): a mesh whose process groups exist in this "
            "world, got one read back from a pickle made in another (over ranks [0, 1]; "
        ), (rank, message)
        assert "build the state again in this job" in message
