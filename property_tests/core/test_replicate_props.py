"""Laws of DDP bucket plans (policy.buckets) over random module trees and caps."""

import itertools
import warnings

from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard.testing import strategies

MiB = 2**20


@given(
    case=strategies.plans(),
    bucket_kib=st.sampled_from([0.05, 0.2, 1, 25 * 1024]),
    first_kib=st.sampled_from([0.02, 0.1, 1024]),
)
def test_buckets_partition_trainable_params_in_reverse_order_within_their_caps(
    case, bucket_kib, first_kib
):
    model = case.spec.build()
    ignored = case.kwargs(model)["ignored"]
    policy = fs.policy.buckets(bucket_mb=bucket_kib / 1024, first_bucket_mb=first_kib / 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = fs.plan(model, policy=policy, ignored=ignored)
    params = dict(model.named_parameters())
    buckets = [u for u in plan.units if u.name.startswith("<bucket")]
    frozen = [u for u in plan.units if u.name == "<frozen>"]
    trainable = [f for f in params if params[f].requires_grad and f not in plan.ignored]

    in_buckets = [f for u in buckets for f in u.fqns]
    assert sorted(in_buckets) == sorted(trainable)  # each trainable param exactly once
    assert all(not params[f].requires_grad for u in frozen for f in u.fqns)

    order = {f: i for i, f in enumerate(params)}
    for earlier, later in itertools.pairwise(buckets):  # reverse registration order
        assert min(order[f] for f in earlier.fqns) > max(order[f] for f in later.fqns)
    for index, unit in enumerate(buckets):
        cap = (first_kib if index == 0 else bucket_kib) * 1024
        size = sum(params[f].numel() * params[f].element_size() for f in unit.fqns)
        assert size <= cap or len(unit.fqns) == 1, (unit.name, size, cap)
