"""FSDP2 scenarios of per-unit choices (issue 51, items 5 and 8), each named after the FSDP2
test it answers: units of several sibling modules (`fully_shard([layers[1], layers[2]])`,
test_fully_shard_training.py's module groupings "mem_eff" and "mem_eff_weight_tied") and
mixed precision on one unit (test_fully_shard_mixed_precision.py's
`test_float16_on_one_submodule`), against one process at FSDP2's tolerances.
"""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.planning._estimate import estimate
from funcshard.testing.memory import LiveTensors
from funcshard.testing.models import GPT, Block, GPTConfig

WORLD = 2
STEPS = 3


class _CheckpointedGPT(GPT):
    """The reference GPT with every block recomputed in backward (FSDP2's "utils")."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x)) * self.cfg.d_model**-0.5


def _gpt(tied: bool) -> GPT:
    torch.manual_seed(0)
    return _CheckpointedGPT(GPTConfig(n_layer=3, tie_embeddings=tied))


def _groups(model: GPT, tied: bool) -> list:
    """FSDP2's "mem_eff" grouping by FQN, or "mem_eff_weight_tied" by module object."""
    if tied:
        return [[model.wte, model.head]]
    return [["blocks.1", "blocks.2"], ["wte", "wpe"], ["ln_f", "head"]]


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(61, (2, 17), generator=torch.Generator().manual_seed(11 + rank))
    return tokens[:, :-1], tokens[:, 1:]


def _loss(model, params, x, y):
    return F.cross_entropy(fs.call(model, params, x).flatten(0, 1), y.flatten())


def _grouped(tied: bool, path: str, rank: int) -> dict:
    """Training resharded after forward and not (FSDP2's "mem_eff" grouping), or resharded
    only (its "mem_eff_weight_tied")."""
    out = {r: _grouped_training(tied, r, f"{path}/{r}", rank) for r in (True, False)[: 2 - tied]}
    # one process's run, here: a worker computes with one thread, as fast as it goes on 2
    # busy cores
    return out, _reference_training(tied) if rank == 0 else None


def _grouped_training(tied: bool, reshard: bool, path: str, rank: int) -> dict:
    model = _gpt(tied)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), groups=_groups(model, tied))
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), reshard_after_forward=reshard)
    opt = fs.optim.adam(1e-2, eps=1e-3)
    opt_state = opt.init(state)
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    x, y = _batch(rank)
    losses = []
    for _ in range(STEPS):
        loss, grads = grad_fn(state, x, y)
        state, opt_state = opt.step(grads, opt_state, state)
        losses.append(fs.pmean(loss.detach(), state.layout.mesh).item())
    out = {"losses": losses, "params": fs.unshard(state), "units": [u.name for u in plan.units]}
    # one all-gather per flat buffer per forward: a group is gathered once for its members
    with torch.no_grad(), fs.comm.record() as log:
        fs.call(model, state, x)
    out["gathers"] = sum(r.op.startswith("all_gather") for r in log), len(state.layout.flats)
    if not tied and reshard:  # while blocks.2 runs, blocks.1 (its group) is gathered; then not
        seen = []
        weight = lambda: type(model.blocks[1].mlp.fc.weight).__name__  # noqa: E731
        hooks = [
            m.register_forward_pre_hook(lambda m, a: seen.append(weight()))
            for m in (model.blocks[2], model.ln_f)
        ]
        with torch.no_grad():
            fs.call(model, state, x)
        for hook in hooks:
            hook.remove()
        out["blocks.1 during blocks.2, during ln_f"] = seen
        # and the peak of a step, for the estimate
        with LiveTensors() as memory:
            memory.adopt((state, opt_state))
            loss, grads = grad_fn(state, x, y)
            state, opt_state = opt.step(grads, opt_state, state)
        out["peak"] = memory.peak
    fs.checkpoint.save(path, state, opt_state, step=STEPS)
    loaded, _, step, _ = fs.checkpoint.load(path, like=(state, opt.init(state)))
    out["checkpoint"] = step == STEPS and all(
        torch.equal(a, b) for a, b in zip(loaded.shards, state.shards, strict=True)
    )
    return out


def _reference_training(tied: bool) -> tuple[list[float], dict]:
    model = _gpt(tied)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    batches = [_batch(rank) for rank in range(WORLD)]
    x, y = (torch.cat(parts) for parts in zip(*batches, strict=True))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


@pytest.mark.parametrize("tied", [False, True], ids=["mem_eff", "mem_eff_weight_tied"])
def test_train_parity_with_activation_checkpointing(tied, tmp_path):
    """test_fully_shard_training.py::test_train_parity_with_activation_checkpointing with
    FSDP2's module groupings: units of several sibling modules, blocks recomputed in
    backward, resharded after forward or not, equal one process (Adam, 3 steps); each
    group gathered once per forward and released after its last member; a checkpoint
    round trip bitwise; fs.estimate's peak for the grouped plan within 10% of the step's."""
    results = testing.run(functools.partial(_grouped, tied, str(tmp_path)), world_size=WORLD)
    ranks = [by_reshard for by_reshard, _ in results]
    expected_losses, expected = results[0][1]
    for out in (out for by_reshard in ranks for out in by_reshard.values()):
        assert out["losses"] == pytest.approx(expected_losses, rel=1e-5)
        for name, p in out["params"].items():
            torch.testing.assert_close(p, expected[name].detach(), rtol=1e-5, atol=1e-6)
        gathers, flats = out["gathers"]
        assert gathers == flats, out["units"]
        assert out["checkpoint"]
        if tied:
            assert out["units"] == ["blocks.0", "blocks.1", "blocks.2", "<wte+head>", ""]
        else:
            assert out["units"] == [
                "<wte+wpe>",
                "blocks.0",
                "<blocks.1+blocks.2>",
                "<ln_f+head>",
                "",
            ]
    if tied:
        return
    assert ranks[0][True]["blocks.1 during blocks.2, during ln_f"] == ["Tensor", "Ungathered"]
    model = _gpt(False)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), groups=_groups(model, False))
    x, y = _batch(0)
    planned = estimate(
        plan,
        WORLD,
        model=model,
        loss_fn=functools.partial(_loss, model),
        args=(x, y),
        device="cpu",
        donate=True,
        loop=False,
    )
    measured = max(by_reshard[True]["peak"] for by_reshard in ranks)
    assert abs(planned.peak - measured) / measured < 0.10
    assert "<blocks.1+blocks.2>" in plan.table(WORLD)


def test_groups_refuse_overlaps_strangers_and_missing_modules_by_name():
    model = GPT(GPTConfig(n_layer=3))
    blocks = fs.policy.module_classes({Block})
    for groups, words in (
        ([["blocks.1", "blocks.2"], ["blocks.2"]], "'blocks.2' is in two groups"),
        ([["blocks.1", "ln_f"]], "mixes modules of different parents"),
        ([["blocks.1", "blocks.1.mlp"]], "mixes modules of different parents"),
        ([["blocks.1", "blocks.7"]], "names 'blocks.7', which is not a module of this GPT"),
        ([["wte.weight"]], "names 'wte.weight', which is not a module"),
        ([[nn.Linear(2, 2)]], "names a Linear module, which is not a module of this GPT"),
        ([[model]], "names the root module"),
        ([["blocks.1", "blocks.1"]], "lists 'blocks.1' twice"),
        ([[]], "an empty group"),
    ):
        with pytest.raises(ValueError, match=words):
            fs.plan(model, policy=blocks, groups=groups)
    with pytest.raises(ValueError, match=r"'blocks.0', which is ignored"):
        fs.plan(model, policy=blocks, groups=[["blocks.0", "blocks.1"]], ignored=["blocks.0"])
    with pytest.raises(ValueError, match=r"'ln_f' is in the group .* keep_fp32"):
        fs.plan(model, groups=[["ln_f", "head"]], keep_fp32=[nn.LayerNorm])
    with pytest.raises(ValueError, match="groups applies to module units"):
        fs.plan(model, policy=fs.policy.buckets(1.0), groups=[["ln_f", "head"]])
    with pytest.raises(TypeError, match="groups is a list of groups"):
        fs.plan(model, groups="ln_f")
    group = fs.plan(model, groups=[["ln_f", "head"]], policy=blocks)
    one = fs.plan(model, groups=[[model.ln_f]], policy=blocks)  # a group of one: a plain unit
    assert [u.name for u in one.units if u.name == "ln_f"] == ["ln_f"]
    assert group.fingerprint() != fs.plan(model, policy=blocks).fingerprint()
    with pytest.raises(ValueError, match="forward_methods names '<ln_f\\+head>'"):
        fs.plan(model, groups=[["ln_f", "head"]], forward_methods={"<ln_f+head>": "forward"})


# test_float16_on_one_submodule: a model that records the dtype each module's forward sees


class _SavesInputs(nn.Module):
    def __init__(self, seen: dict, name: str, casts_itself: bool) -> None:
        super().__init__()
        self.lin, self.seen, self.name, self.casts_itself = (
            nn.Linear(8, 8),
            seen,
            name,
            casts_itself,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen[self.name] = x.dtype
        return self.lin(x.to(self.lin.weight.dtype) if self.casts_itself else x)


class _TwoChildren(nn.Module):
    def __init__(self, casts_itself: bool = False) -> None:
        super().__init__()
        self.seen: dict = {}
        self.c1 = _SavesInputs(self.seen, "c1", casts_itself)
        self.c2 = _SavesInputs(self.seen, "c2", casts_itself)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["root"] = x.dtype
        return self.c2(self.c1(x))


HALF = fs.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
SUBTESTS = {  # FSDP2's three: (which child, its policy, the child casts its own inputs)
    "fp16 c2": ("c2", HALF, False),
    "fp16 c2, the module casts": (
        "c2",
        fs.MixedPrecision(torch.float16, torch.float32, cast_inputs=False),
        True,
    ),
    "fp16 c1, fp32 outputs": (
        "c1",
        fs.MixedPrecision(torch.float16, torch.float32, torch.float32),
        False,
    ),
}


def _square_loss(model, state, x):
    return fs.call(model, state, x).float().square().sum()


def _x(rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(5 + rank))


def _one_half_unit(rank: int) -> dict:
    out = {}
    for subtest, (child, policy, casts_itself) in SUBTESTS.items():
        torch.manual_seed(0)
        model = _TwoChildren(casts_itself)
        units = fs.policy.module_classes({_SavesInputs})
        plan = fs.plan(model, policy=units, mp={child: policy})
        state = fs.shard(model, plan, fs.Mesh(shard=WORLD))  # no state-wide policy
        loss_fn = functools.partial(_square_loss, model)
        loss, grads = fs.value_and_grad(loss_fn, reduce=False)(state, _x(rank))
        out[subtest] = (dict(model.seen), loss.item(), grads.grads)
    # by class, beside a state-wide bf16 policy: every _SavesInputs unit in fp16, the root
    # (the model's own input cast) in bf16
    torch.manual_seed(0)
    model = _TwoChildren()
    plan = fs.plan(model, policy=fs.policy.module_classes({_SavesInputs}), mp={_SavesInputs: HALF})
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), mp=fs.MixedPrecision(torch.bfloat16))
    fs.call(model, state, _x(rank))
    out["by class"] = dict(model.seen), [str(s.dtype) for s in state.shards]
    return out


def _reference(child: str, policy: fs.MixedPrecision, casts_itself: bool, rank: int):
    """FSDP2's arithmetic on one process: the chosen child a copy in its param dtype, its
    inputs cast to it (unless the policy does not cast), its outputs to its output dtype."""
    torch.manual_seed(0)
    model = _TwoChildren(casts_itself)
    low = getattr(model, child)
    low.to(policy.param_dtype)
    if policy.cast_inputs:
        low.register_forward_pre_hook(lambda m, args: tuple(a.to(policy.param_dtype) for a in args))
    if policy.output_dtype is not None:
        low.register_forward_hook(lambda m, args, out: out.to(policy.output_dtype))
    loss = model(_x(rank)).float().square().sum()
    loss.backward()
    return dict(model.seen), loss.item(), {k: p.grad for k, p in model.named_parameters()}


def test_float16_on_one_submodule():
    """test_fully_shard_mixed_precision.py::test_float16_on_one_submodule: a per-unit policy
    (plan(mp=...)) beside none state-wide; the dtypes each module's forward sees are FSDP2's,
    and the gradients equal one process with the same per-module casts (1e-5)."""
    expected_seen = {
        "fp16 c2": {"root": torch.float32, "c1": torch.float32, "c2": torch.float16},
        "fp16 c2, the module casts": {
            "root": torch.float32,
            "c1": torch.float32,
            "c2": torch.float32,
        },
        "fp16 c1, fp32 outputs": {"root": torch.float32, "c1": torch.float16, "c2": torch.float32},
    }
    for rank, out in enumerate(testing.run(_one_half_unit, world_size=WORLD)):
        for subtest, (child, policy, casts_itself) in SUBTESTS.items():
            seen, loss, grads = out[subtest]
            plain_seen, plain_loss, plain_grads = _reference(child, policy, casts_itself, rank)
            assert seen == expected_seen[subtest] == plain_seen, subtest
            assert loss == pytest.approx(plain_loss, rel=1e-5), subtest
            for name, grad in grads.items():  # (local grads come in the reduce dtype, fp32)
                torch.testing.assert_close(grad, plain_grads[name].float(), rtol=1e-5, atol=1e-5)
        seen, dtypes = out["by class"]
        assert seen == {"root": torch.bfloat16, "c1": torch.float16, "c2": torch.float16}
        assert dtypes == ["torch.float32"] * 2  # the sharded master copies stay fp32


def _reduced_in_the_units_dtype(rank: int) -> list:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    bf16 = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    plan = fs.plan(model, policy=fs.policy.size(1), mp={"1": fs.MixedPrecision()})
    state = fs.shard(model, plan, fs.Mesh(shard=WORLD), mp=bf16)
    third = 1.0 / 3.0 + rank  # not exact in bf16
    reduced = fs.reduce(state, {k: torch.full_like(v, third) for k, v in model.named_parameters()})
    return [s[0].item() for s in reduced.shards]


def test_a_units_own_policy_sets_its_reduce_dtype():
    """keep_fp32 as a per-unit policy: `mp={"1": MixedPrecision()}` reduces that unit in
    fp32 beside a state-wide bf16 reduction (as test_transforms' keep_fp32 check)."""
    bf16_unit, fp32_unit = testing.run(_reduced_in_the_units_dtype, world_size=WORLD)[0]
    exact = (1 / 3 + 4 / 3) / 2
    assert bf16_unit != exact and abs(bf16_unit - exact) < 1e-2
    assert fp32_unit == pytest.approx(exact, rel=1e-6)


def test_per_unit_mp_refuses_unknown_units_classes_values_and_conflicts():
    model = _TwoChildren()
    units = fs.policy.module_classes({_SavesInputs})
    for mp, error, words in (
        ({"c3": HALF}, ValueError, "mp names 'c3', which is not a module of this _TwoChildren"),
        ({"c1.lin": HALF}, ValueError, "mp names 'c1.lin', which is not a unit's module"),
        ({nn.Linear: HALF}, ValueError, "names the class Linear, but no unit is made of"),
        ({"c1": torch.float16}, TypeError, r"mp\['c1'\] must be a funcshard.MixedPrecision"),
        ({"c1": HALF, "<bucket 0>": HALF}, ValueError, "'<bucket 0>', which is not a unit's"),
        ([("c1", HALF)], TypeError, "mp maps units"),
    ):
        with pytest.raises(error, match=words):
            fs.plan(model, policy=units, mp=mp)
    with pytest.raises(ValueError, match="'<root>' a policy, but it holds no parameters"):
        fs.plan(model, policy=units, mp={"": HALF})
    with pytest.raises(ValueError, match="'c1' is a keep_fp32 unit"):
        fs.plan(model, policy=units, keep_fp32=[_SavesInputs], mp={"c1": HALF})
    with pytest.raises(ValueError, match="'c1', a member of the unit '<c1\\+c2>'"):
        fs.plan(model, groups=[["c1", "c2"]], mp={model.c1: HALF})
    grouped = fs.plan(model, groups=[["c1", "c2"]], mp={"<c1+c2>": HALF})
    assert [u.mp for u in grouped.units] == [HALF, None]
    plain = fs.plan(model, policy=units)
    halves = fs.plan(model, policy=units, mp={"c1": HALF})
    assert plain.fingerprint() != halves.fingerprint()  # every rank agrees on the policies
    assert "mp param=float16,reduce=float32" in halves.table()
    by_name = fs.plan(model, policy=units, mp={_SavesInputs: fs.MixedPrecision(), "c2": HALF})
    assert [u.mp for u in by_name.units] == [fs.MixedPrecision(), HALF, None]
    assert copy.deepcopy(halves) == halves
