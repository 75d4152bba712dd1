"""Laws of extract/call over random module trees (hypothesis)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard.testing import strategies


def _clone(tensors: dict) -> dict:
    return {k: v.detach().clone() for k, v in tensors.items()}


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@given(spec=strategies.modules(), train=st.booleans())
def test_call_of_extract_equals_calling_the_module(spec, train):
    model = spec.build().train(train)
    params, buffers = fs.extract(model)
    params_before, buffers_before = _clone(params), _clone(buffers)
    x = spec.example_input()

    out, new_buffers = fs.call(model, params, x, buffers=buffers, mutable=True)
    assert _bitwise_equal(params, params_before)  # call is pure
    assert _bitwise_equal(buffers, buffers_before)

    expected = model(x)  # updates the module's (and so the extracted) buffers in place
    assert torch.equal(out, expected)
    assert _bitwise_equal(new_buffers, dict(model.named_buffers()))


@given(spec=strategies.modules())
def test_call_gives_the_modules_gradients_for_trainable_params(spec):
    model = spec.build()
    params, buffers = fs.extract(model)
    x = spec.example_input()
    trainable = {k: p for k, p in params.items() if p.requires_grad}
    if not trainable:
        return
    out = fs.call(model, params, x, buffers=buffers).square().sum()
    grads = torch.autograd.grad(out, list(trainable.values()))
    expected = torch.autograd.grad(
        model(x).square().sum(), [model.get_parameter(k) for k in trainable]
    )
    for g, e in zip(grads, expected, strict=True):
        assert torch.equal(g, e)


@given(spec=strategies.modules())
def test_extract_lists_every_distinct_tensor_once_under_its_first_fqn(spec):
    model = spec.build()
    params, _ = fs.extract(model)
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    assert list(params) == list(first.values())
    for name, p in params.items():
        assert p.requires_grad == model.get_parameter(name).requires_grad


@given(spec=strategies.modules())
def test_a_spec_builds_bitwise_the_same_module_every_time(spec):
    a, b = fs.extract(spec.build())[0], fs.extract(spec.build())[0]
    assert _bitwise_equal(a, b)


@given(shape=strategies.meshes())
def test_drawn_meshes_factor_their_world_size(shape):
    assert shape.replicate * shape.shard == shape.world_size <= 4


@given(tree=strategies.pytrees())
def test_drawn_pytrees_hold_random_nonzero_data(tree):
    assert tree and all(t.dtype in strategies.DTYPES for t in tree.values())
    assert any(t.ne(0).any() for t in tree.values())
