"""Non-finite steps by default: a NaN or an empty batch on one rank is skipped on every rank
with a warning naming it (or raised on every rank, with "raise"); finite steps are untouched.
"""

import functools
import threading
import warnings

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing
from funcshard.step import _host_flags as host_flags
from funcshard.step._finite import MAX_CONSECUTIVE_SKIPS, local_flags

MESHES = {
    "fsdp": (2, lambda: fs.Mesh(shard=2)),
    "hsdp": (4, lambda: fs.Mesh(replicate=2, shard=2)),
    "ddp": (2, lambda: fs.Mesh(replicate=2)),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def _state(mesh: str, model: nn.Module, mp=None) -> fs.ShardedState:
    if mesh == "ddp":
        return fs.replicate(model, MESHES[mesh][1](), bucket_mb=0.0001)
    plan = fs.plan(model, policy=fs.policy.module_classes({nn.Linear}))
    return fs.shard(model, plan, MESHES[mesh][1](), mp=mp)


def _loss(model, state, x, scale=1.0):
    return fs.call(model, state, x).square().mean() * scale


def _batch(rank: int, rows: int = 4, poison: bool = False) -> torch.Tensor:
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(100 + rank))
    if poison:
        x[0, 2] = float("nan")
    return x


def _step(model, opt, state, opt_state, x, fused: bool, **options):
    """One step; returns (state, opt_state, the NonFiniteWarnings' messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, grads = fs.value_and_grad(functools.partial(_loss, model), **options)(state, x)
        if fused:
            state, opt_state = opt.step(grads, opt_state, state)
        else:
            updates, opt_state = opt.update(grads, opt_state, state)
            state = fs.apply_updates(state, updates)
    return state, opt_state, [str(w.message) for w in caught if w.category is fs.NonFiniteWarning]


def _copy(params: dict) -> dict:
    """A copy (a replicated state's unshard hands out the parameters an update writes into)."""
    return {k: v.clone() for k, v in params.items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _scenarios(mesh: str, rank: int) -> dict:
    model = _model()
    opt = fs.optim.adamw(1e-2)
    out = {}
    for name, rows, poison in (("nan", 4, rank == 1), ("empty", 0 if rank == 1 else 4, False)):
        for fused in (True, False):
            state = _state(mesh, model)
            opt_state = opt.init(state)
            before = _copy(fs.unshard(state))
            state, new_opt_state, said = _step(
                model, opt, state, opt_state, _batch(rank, rows, poison), fused
            )
            out[name, fused] = (
                _same(before, fs.unshard(state)),
                int(new_opt_state.step),
                said,
            )
    # "raise": the error on every rank, naming the rank
    state = _state(mesh, model)
    try:
        fs.value_and_grad(functools.partial(_loss, model), check_finite="raise")(
            state, _batch(rank, poison=rank == 1)
        )
        out["raise"] = "no error"
    except fs.NonFiniteError as e:
        out["raise"] = str(e)
    # skip_nonfinite as before: counts the skip, says nothing
    skipping = fs.optim.skip_nonfinite(opt)
    state = _state(mesh, model)
    before = _copy(fs.unshard(state))
    state, skip_state, said = _step(
        model, skipping, state, skipping.init(state), _batch(rank, poison=rank == 1), True
    )
    out["skip_nonfinite"] = (_same(before, fs.unshard(state)), int(skip_state.skipped), said)
    # ...also for an empty batch (a NaN loss, finite gradients), and inside a chain whose
    # clip hands it the gradients' verdict
    state = _state(mesh, model)
    _, skip_state, said = _step(
        model, skipping, state, skipping.init(state), _batch(rank, 0 if rank else 4), True
    )
    out["skip_nonfinite empty"] = (int(skip_state.skipped), said)
    chained = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), skipping)
    state = _state(mesh, model)
    before = _copy(fs.unshard(state))
    _, chain_state, said = _step(
        model, chained, state, chained.init(state), _batch(rank, poison=rank == 1), False
    )
    out["chained"] = (_same(before, fs.unshard(state)), int(chain_state.states[1].skipped), said)
    # a finite step is taken, bitwise as with the check off: a batch of one row on rank 0
    results = []
    for check in ("skip", "off"):
        state = _state(mesh, model)
        loss = functools.partial(_loss, model)
        _, grads = fs.value_and_grad(loss, check_finite=check)(state, _batch(rank, 1 + 3 * rank))
        sgd = fs.optim.sgd(0.1)
        updates, _ = sgd.update(grads, sgd.init(state), state)
        results.append(fs.unshard(fs.apply_updates(state, updates)))
    out["one row"] = _same(*results) and not _same(results[0], fs.unshard(_state(mesh, model)))
    # accumulation with reduce=False, then reduce: its default check changes no number
    state = _state(mesh, model)
    local = fs.value_and_grad(functools.partial(_loss, model), reduce=False)
    _, g1 = local(state, _batch(rank))
    _, g2 = local(state, _batch(rank + 7))
    summed = fs.accumulate(g1, g2)
    checked, unchecked = fs.reduce(state, summed), fs.reduce(state, summed, check_finite="off")
    out["accumulated"] = (
        checked.verdict is not None and checked.verdict.finite(),
        all(torch.equal(a, b) for a, b in zip(checked.leaves(), unchecked.leaves(), strict=True)),
    )
    # two reduced micro-batches summed, the second NaN on rank 1: the sum's verdict says so
    state = _state(mesh, model)
    before = _copy(fs.unshard(state))
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    summed = fs.accumulate(
        grad_fn(state, _batch(rank))[1], grad_fn(state, _batch(rank, poison=rank == 1))[1]
    )
    state, _, said = _step_with(opt, summed, state)
    out["accumulated nan"] = (_same(before, fs.unshard(state)), len(said))
    return out


def _step_with(opt, grads, state):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, opt_state = opt.step(grads, opt.init(state), state)
    return state, opt_state, [w for w in caught if w.category is fs.NonFiniteWarning]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_bad_batch_on_one_rank_is_skipped_on_every_rank_and_named(mesh):
    world = MESHES[mesh][0]
    results = testing.run(functools.partial(_scenarios, mesh), world_size=world, timeout=120)
    for rank, out in enumerate(results):
        for fused in (True, False):
            intact, count, said = out["nan", fused]
            assert intact and count == 0, (rank, fused, out["nan", fused])
            assert len(said) == 1 and "skipped this step on every rank" in said[0], said
            assert "NaN or inf in the loss on ranks [1]; gradients of unit" in said[0], said
            intact, count, said = out["empty", fused]
            assert intact and count == 0, (rank, fused, out["empty", fused])
            assert len(said) == 1 and "the loss on ranks [1], whose gradients are all " in said[0]
            assert "an empty batch on those ranks?" in said[0], said
        assert out["raise"].startswith(
            "funcshard.value_and_grad(check_finite='raise'): NaN or inf in the loss on ranks [1]"
        ), out["raise"]
        assert out["skip_nonfinite"] == (True, 1, []), out["skip_nonfinite"]
        assert out["skip_nonfinite empty"] == (1, []), out["skip_nonfinite empty"]
        assert out["chained"] == (True, 1, []), out["chained"]
        assert out["one row"]
        assert out["accumulated"] == (True, True)
        assert out["accumulated nan"] == (True, 1)


def _too_many_in_a_row(rank: int) -> tuple[int, str]:
    model = _model()
    state = _state("fsdp", model)
    opt = fs.optim.sgd(0.1)
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    opt_state = opt.init(state)
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fs.NonFiniteWarning)
        try:
            for steps in range(1, 20):  # noqa: B007 (read after the loop)
                _, grads = grad_fn(state, _batch(rank, poison=rank == 0))
                state, opt_state = opt.step(grads, opt_state, state)
        except fs.NonFiniteError as e:
            return steps, str(e)
    return steps, "no error"


def test_too_many_skips_in_a_row_raise_on_every_rank():
    for steps, message in testing.run(_too_many_in_a_row, world_size=2):
        assert steps == MAX_CONSECUTIVE_SKIPS + 1, (steps, message)
        assert f"{MAX_CONSECUTIVE_SKIPS + 1} steps in a row had NaN or inf" in message
        assert "the loss on ranks [0]" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_finite_gradients_whose_sum_overflows_are_finite(dtype):
    big = torch.full((64,), torch.finfo(dtype).max / 4, dtype=dtype)
    assert not big.sum().isfinite()  # the cheap test alone would call it non-finite
    poisoned = big.clone()
    poisoned[3] = float("inf")
    assert local_flags([big, None, poisoned, big[:0]]).tolist() == [0, 0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.complex64])
def test_flags_are_exactly_the_tensors_holding_nan_or_inf(dtype):
    big = torch.finfo(dtype).max / 4  # a sum of 64 overflows; the values are finite
    tensors = [torch.tensor(float("nan"), dtype=dtype), None, torch.zeros(0, dtype=dtype)]
    for poison in (None, float("nan"), float("inf"), -float("inf")):
        for fill in (1.0, big, -big):
            t = torch.full((64,), fill, dtype=dtype)
            if poison is not None:
                t[17] = poison
            tensors.append(t)
    if dtype.is_complex:  # NaN or inf in the imaginary part alone counts too
        tensors += [torch.full((8,), complex(1, float(x)), dtype=dtype) for x in ("nan", "inf")]
    expected = [int(t is not None and not bool(t.isfinite().all())) for t in tensors]
    assert expected[0] == 1 and sum(expected) == len(expected) - 5  # (the test's own sanity)
    assert local_flags(tensors).tolist() == expected


def test_check_finite_refuses_an_unknown_policy_naming_the_choices():
    with pytest.raises(ValueError, match=r"'skip' \(the default.*'raise'.*'off', got 'warn'"):
        fs.value_and_grad(lambda p: p["w"].sum(), check_finite="warn")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_check_leaves_the_tensors_bit_for_bit(dtype):
    # the one-call check writes fp32/fp64 values back: same bits, NaN payloads too
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
    half = 0x7D01 if dtype == torch.float16 else 0x7F81
    signaling = {2: half, 4: 0x7F800001, 8: 0x7FF0000000000001}
    g = torch.Generator().manual_seed(7)
    clean = torch.randn(300, generator=g).to(dtype)
    poisoned = torch.randn(300, generator=g).to(dtype).view(ints)
    poisoned[11] = signaling[dtype.itemsize]
    poisoned = poisoned.view(dtype)
    inf = torch.randn(300, generator=g).to(dtype)
    inf[5] = -float("inf")
    tensors = [clean, poisoned, inf]
    bits = [t.view(ints).clone() for t in tensors]
    versions = [t._version for t in tensors]
    assert local_flags(tensors).tolist() == [0, 1, 1]
    assert local_flags([clean]).tolist() == [0]
    assert all(torch.equal(t.view(ints), b) for t, b in zip(tensors, bits, strict=True))
    assert [t._version for t in tensors] == versions


def test_tensors_the_one_call_check_refuses_are_summed_instead():
    overlapping = torch.tensor([1.0, float("inf")]).expand(3, 2)  # one element, three places
    with torch.inference_mode():
        inference = torch.tensor([float("nan"), 1.0])
    assert local_flags([torch.ones(4), overlapping, inference]).tolist() == [0, 1, 1]
    assert local_flags([torch.ones(4), torch.ones(2).expand(3, 2)]).tolist() == [0, 0]


def test_the_one_call_check_works_in_a_new_thread_whatever_the_default_dtype():
    # its flag and scale are made per thread; the scaler's check takes fp32 ones only
    seen = {}

    def check_here():
        torch._amp_foreach_non_finite_check_and_unscale_(
            [torch.ones(3)], host_flags._FOUND.flag, host_flags._FOUND.one
        )  # raises on a float64 flag
        seen["flags"] = local_flags([torch.ones(3), torch.tensor([1.0, float("nan")])]).tolist()

    torch.set_default_dtype(torch.float64)
    try:
        thread = threading.Thread(target=check_here)
        thread.start()
        thread.join()
    finally:
        torch.set_default_dtype(torch.float32)
    assert seen["flags"] == [0, 1]


def test_a_loss_that_requires_grad_is_read_and_its_graph_left_alone():
    w = torch.randn(4, requires_grad=True, generator=torch.Generator().manual_seed(3))
    loss = (w * float("nan")).sum()
    version = loss._version
    assert local_flags([loss, torch.ones(2)]).tolist() == [1, 0]
    assert loss._version == version and loss.requires_grad
    loss.backward()  # the graph is still whole
    assert w.grad is not None
