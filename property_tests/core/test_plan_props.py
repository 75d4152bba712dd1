"""Laws of funcshard.plan over random module trees and policies (hypothesis)."""

import functools
import warnings

from hypothesis import given, settings

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies


def _plan(case):
    model = case.spec.build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen mixing and keep_fp32 overrides only warn here
        return model, fs.plan(model, **case.kwargs(model))


def _is_ancestor(a: str, b: str) -> bool:
    """True if module `a` strictly contains module `b` (by FQN)."""
    return a != b and (a == "" or b.startswith(a + "."))


@given(case=strategies.plans())
def test_units_and_ignored_partition_the_parameters(case):
    model, plan = _plan(case)
    planned = [f for unit in plan.units for f in unit.fqns]
    assert len(planned) == len(set(planned)), "a parameter is in two units"
    assert not set(planned) & set(plan.ignored)
    assert set(planned) | set(plan.ignored) == {n for n, _ in model.named_parameters()}


@given(case=strategies.plans())
def test_units_come_in_post_order_with_the_root_last(case):
    model, plan = _plan(case)
    pre_order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = [u.name for u in plan.units]
    assert names[-1] == "" and names.count("") == 1
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            # in post-order, a precedes b iff a is inside b, or a comes first and holds no b
            assert _is_ancestor(b, a) or (pre_order[a] < pre_order[b] and not _is_ancestor(a, b))


@given(case=strategies.plans())
def test_each_parameter_belongs_to_the_first_unit_that_reaches_it(case):
    model, plan = _plan(case)
    owner = {f: i for i, unit in enumerate(plan.units) for f in unit.fqns}
    for fqn, i in owner.items():
        param = model.get_parameter(fqn)
        reaches = [
            j
            for j, unit in enumerate(plan.units)
            if any(p is param for p in model.get_submodule(unit.name).parameters())
        ]
        assert i == reaches[0], (fqn, plan.units[i].name, plan.units[reaches[0]].name)


@given(case=strategies.plans())
def test_keep_fp32_modules_are_units_of_their_own(case):
    model, plan = _plan(case)
    by_name = {u.name: u for u in plan.units}
    ignored = set(plan.ignored)
    earlier_owned: set[str] = set()
    for unit in plan.units:
        module = model.get_submodule(unit.name)
        is_fp32_class = isinstance(module, case.keep_fp32) and unit.name != ""
        assert unit.keep_fp32 == is_fp32_class
        earlier_owned.update(unit.fqns)
    first_fqn = {id(p): n for n, p in model.named_parameters()}
    for name, module in model.named_modules():
        if name and isinstance(module, case.keep_fp32) and name not in by_name:
            # not a unit: everything it holds went to earlier units or was ignored
            assert all(first_fqn[id(p)] in earlier_owned | ignored for p in module.parameters())


@given(case=strategies.plans())
def test_unit_records_describe_their_parameters(case):
    model, plan = _plan(case)
    for unit in plan.units:
        params = [model.get_parameter(f) for f in unit.fqns]
        assert unit.shapes == tuple(tuple(p.shape) for p in params)
        assert unit.numel == sum(p.numel() for p in params)
        assert set(unit.dtypes) == {p.dtype for p in params}
        assert unit.frozen == (bool(params) and not any(p.requires_grad for p in params))


def _fingerprint(case, rank: int) -> str:
    return _plan(case)[1].fingerprint()


@settings(max_examples=10)
@given(case=strategies.plans())
def test_plans_are_the_same_in_every_process(case):
    here = _fingerprint(case, 0)
    assert testing.run(functools.partial(_fingerprint, case), world_size=2) == [here, here]
