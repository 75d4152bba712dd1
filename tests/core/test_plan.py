"""funcshard.plan on hand-built models: unit choice, tied weights, the seed's error cases."""

import dataclasses
import re

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard.testing.models import GPT, Block, GPTConfig


def _names(plan: fs.Plan) -> list[str]:
    return [u.name for u in plan.units]


class _Tree(nn.Module):
    """M(S1, S2(SS1, SS2), S3): the seed's post-order example."""

    def __init__(self) -> None:
        super().__init__()
        self.s1 = nn.Linear(2, 2)
        self.s2 = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.s3 = nn.Linear(2, 2)


def test_units_follow_the_seeds_post_order_with_the_root_last():
    plan = fs.plan(_Tree(), policy=fs.policy.module_classes({nn.Linear, nn.Sequential}))
    assert _names(plan) == ["s1", "s2.0", "s2.1", "s3", ""]  # s2 has nothing left: no unit
    plan = fs.plan(_Tree(), policy=fs.policy.size(min_numel=1))
    assert _names(plan) == ["s1", "s2.0", "s2.1", "s3", ""]
    plan = fs.plan(_Tree(), policy=lambda m, fqn, n: fqn in ("s2", "s1"))
    assert _names(plan) == ["s1", "s2", ""]
    assert plan.units[1].fqns == ("s2.0.weight", "s2.0.bias", "s2.1.weight", "s2.1.bias")


def test_no_policy_is_one_root_unit_holding_everything_in_registration_order():
    model = GPT()
    plan = fs.plan(model)
    assert _names(plan) == [""]
    assert plan.units[0].fqns == tuple(n for n, _ in model.named_parameters())


@pytest.mark.quick
def test_gpt_blocks_become_units_and_the_root_keeps_embeddings_and_the_tied_head():
    plan = fs.plan(GPT(GPTConfig(n_layer=3)), policy=fs.policy.module_classes({Block}))
    assert _names(plan) == ["blocks.0", "blocks.1", "blocks.2", ""]
    assert plan.units[-1].fqns == ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    assert plan.units[0].numel == sum(p.numel() for p in Block(GPTConfig()).parameters())


def test_a_tied_weight_goes_to_the_first_unit_in_post_order_under_its_first_fqn():
    plan = fs.plan(GPT(), policy=fs.policy.module_classes({nn.Linear}))
    head = next(u for u in plan.units if u.name == "head")
    assert head.fqns == ("wte.weight",)  # reached first through the head, named as extract does
    assert "wte.weight" not in plan.units[-1].fqns
    plan = fs.plan(GPT(), policy=fs.policy.module_classes({nn.Embedding, nn.Linear}))
    assert next(u for u in plan.units if u.name == "wte").fqns == ("wte.weight",)
    assert all(u.name != "head" for u in plan.units)  # nothing left for the head


def test_size_policy_counts_only_parameters_no_unit_below_owns():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 4), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    )
    plan = fs.plan(model, policy=fs.policy.size(min_numel=12))
    assert _names(plan) == ["0", "1", "2", ""]
    assert plan.units[2].numel == 12 and plan.units[3].fqns == ()


def test_any_of_combines_policies():
    policy = fs.policy.any_of(fs.policy.module_classes({nn.Embedding}), fs.policy.size(40_000))
    plan = fs.plan(GPT(GPTConfig(d_model=64)), policy=policy)  # a block holds ~50k elements
    assert _names(plan) == ["wte", "wpe", "blocks.0", "blocks.1", ""]


def test_frozen_and_trainable_in_one_unit_is_an_error_naming_both_groups():
    model = GPT()
    model.wpe.weight.requires_grad_(False)
    with pytest.raises(ValueError) as info:
        fs.plan(model, policy=fs.policy.module_classes({Block}))
    message = str(info.value)
    assert "the root unit mixes parameters with requires_grad=True and False" in message
    assert "requires_grad=True (2,016 numel): 'wte.weight', 'ln_f.weight', 'ln_f.bias'" in message
    assert "requires_grad=False (512 numel): 'wpe.weight'" in message
    assert "frozen='split'" in message and "put it in a unit of its own" in message


def test_frozen_split_gives_the_frozen_members_flat_buffers_of_their_own():
    """LoRA's case: one unit, its frozen members gathered with it but in a frozen buffer,
    which gets no gradient and no optimizer state."""
    from funcshard.core._layout import layout_of

    model = GPT()
    model.wpe.weight.requires_grad_(False)
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}), frozen="split")
    root = [f for f in layout_of(plan, None, shard_size=2).flats if f.unit == ""]
    assert [(f.fqns, f.frozen, f.frozen_fqns) for f in root] == [
        (("wte.weight", "ln_f.weight", "ln_f.bias"), False, ()),
        (("wpe.weight",), True, ()),
    ]


def test_frozen_warn_says_what_the_mixing_costs_and_frozen_units_are_marked():
    model = GPT()
    model.wpe.weight.requires_grad_(False)
    with pytest.warns(UserWarning, match=r"reduced over all 2,528 elements instead of the 2,016"):
        fs.plan(model, policy=fs.policy.module_classes({Block}), frozen="warn")
    plan = fs.plan(model, policy=fs.policy.module_classes({Block, nn.Embedding}))
    assert [u.name for u in plan.units if u.frozen] == ["wpe"]


def test_keep_fp32_isolates_each_module_and_warns_once_when_overriding_the_policy():
    model = GPT(GPTConfig(n_layer=2))
    with pytest.warns(UserWarning, match=r"keep_fp32 made 5 module\(s\) their own units") as rec:
        plan = fs.plan(model, policy=fs.policy.module_classes({Block}), keep_fp32=(nn.LayerNorm,))
    assert len(rec) == 1
    fp32 = [u.name for u in plan.units if u.keep_fp32]
    assert fp32 == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]
    assert _names(plan).index("blocks.0.ln1") < _names(plan).index("blocks.0")


def test_keep_fp32_that_the_policy_already_chose_does_not_warn(recwarn):
    policy = fs.policy.module_classes({Block, nn.LayerNorm})
    plan = fs.plan(GPT(), policy=policy, keep_fp32=(nn.LayerNorm,))
    assert not recwarn.list
    assert sum(u.keep_fp32 for u in plan.units) == 5


def test_ignored_modules_params_and_fqns_stay_out_of_every_unit():
    model = GPT()
    plan = fs.plan(model, ignored=[model.wpe, model.ln_f.bias, "blocks.1.mlp"])
    assert plan.ignored == (
        "wpe.weight",
        "blocks.1.mlp.fc.weight",
        "blocks.1.mlp.fc.bias",
        "blocks.1.mlp.proj.weight",
        "blocks.1.mlp.proj.bias",
        "ln_f.bias",
    )
    assert not set(plan.fqns) & set(plan.ignored)
    assert "ignored (replicated, all-reduced)" in str(plan)
    assert "not reduced" in str(fs.plan(model, ignored=[model.wpe], reduce_ignored=False))


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ignored": ["blocks.7"]}, ValueError, r"ignored names 'blocks\.7', which are not"),
        ({"ignored": [nn.Linear(2, 2)]}, ValueError, "ignored names Linear, which are not"),
        ({"ignored": [""]}, ValueError, "the root module cannot be ignored"),
        ({"policy": 3}, TypeError, "policy must be callable"),
        ({"frozen": "ignore"}, ValueError, "must be 'error', 'split' or 'warn', got 'ignore'"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        fs.plan(GPT(), **kwargs)


def test_policy_constructors_reject_bad_values():
    with pytest.raises(TypeError, match=r"expected nn\.Module subclasses"):
        fs.policy.module_classes({nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="min_numel must be a positive int, got 0"):
        fs.policy.size(0)
    with pytest.raises(TypeError, match="every policy must be callable"):
        fs.policy.any_of(fs.policy.size(1), "Block")


def test_table_shows_padded_bytes_per_rank_for_mixed_dtypes():
    model = nn.Module()
    model.a = nn.Linear(2, 2)  # 6 fp32 elements
    model.b = nn.Linear(2, 1).to(torch.bfloat16)  # 3 bf16 elements
    plan = fs.plan(model)
    unit = plan.units[0]
    assert unit.dtypes == (torch.float32, torch.bfloat16)
    assert unit.bytes_per_rank(4) == 2 * 4 + 1 * 2  # ceil(6/4) fp32 + ceil(3/4) bf16
    table = plan.table(4)
    assert "bytes/rank (world 4)" in table and "float32,bfloat16" in table
    assert re.search(r"total\s+4\s+9\s+10", table)


def test_plan_is_immutable_and_leaves_the_model_alone():
    model = GPT()
    before = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    with pytest.warns(UserWarning, match="keep_fp32"):
        plan = fs.plan(model, policy=fs.policy.module_classes({Block}), keep_fp32=(nn.LayerNorm,))
    after = [(n, p) for n, p in model.named_parameters(remove_duplicate=False)]
    assert [(n, id(p)) for n, p in before] == [(n, id(p)) for n, p in after]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.units = ()


def test_fingerprint_is_stable_and_sees_shapes_and_dtypes():
    policy = fs.policy.module_classes({Block})
    a = fs.plan(GPT(), policy=policy).fingerprint()
    assert a == fs.plan(GPT(), policy=policy).fingerprint()
    assert a != fs.plan(GPT(GPTConfig(vocab_size=62)), policy=policy).fingerprint()
    assert a != fs.plan(GPT().to(torch.bfloat16), policy=policy).fingerprint()
    assert a != fs.plan(GPT()).fingerprint()


def test_plan_of_a_meta_model_allocates_nothing():
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=4))
    plan = fs.plan(model, policy=fs.policy.module_classes({Block}))
    assert len(plan.units) == 5
