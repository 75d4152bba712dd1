"""Composed autograd transforms on sharded states equal one plain single-process PyTorch run.

DESIGN.md §5 and invariant 8: `fs.call` on a state is an ordinary differentiable function of
`state.shards`, so `torch.autograd.grad` (also with `create_graph=True`), `torch.func.grad`,
`vjp`, `vmap` and `jvp` compose with it. Cotangent rule: cotangents of shard-level tensors are
true partials of one global scalar, the mean over data-parallel ranks of each rank's local loss
(the mean over its own examples). With equal slices that global scalar is the loss of one
process on the whole global batch, which is what every test here compares against: gradient
penalties, gradients over shards, Hessian-vector products and MAML steps on FSDP, HSDP and DDP
states equal the plain model's, within 1e-5 relative (fp32).

Every rank returns full tensors (unsharded by `fs.unshard`); the single-process reference runs
in the test process on a freshly built copy of the model with `torch.func.functional_call`.
"""

import functools
import gc
import time
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call

import funcshard as fs
from funcshard import testing
from funcshard.testing.collector import only_new_objects

WORLD = {"fsdp": 2, "hsdp": 4, "ddp": 2}  # data-parallel size == world size on every mesh
MESHES = list(WORLD)
GLOBAL_BATCH = 8  # divides every world size above: equal slices
PENALTY = 0.5  # weight of the input-gradient penalty
ALPHA = 0.3  # MAML inner learning rate
LINEARS = fs.policy.module_classes({nn.Linear})


class _MLP(nn.Module):
    """Linear(6,8)-Tanh-Linear(8,8)-Tanh-Linear(8,3), times a learnable scale on the root."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 3)
        self.scale = nn.Parameter(1.0 + 0.5 * torch.rand(3))  # the root unit's own parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))) * self.scale


def _model() -> _MLP:
    torch.manual_seed(0)
    return _MLP()


def _global_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def _local(t: torch.Tensor, mesh: str, rank: int) -> torch.Tensor:
    """This data-parallel rank's slice of a global-batch tensor."""
    n = t.shape[0] // WORLD[mesh]
    return t[rank * n : (rank + 1) * n]


def _setup(mesh: str, rank: int, seeds=(1,)):
    """The model, its state on `mesh`, and this rank's slice of each global batch in `seeds`."""
    model = _model()
    if mesh == "fsdp":
        state = fs.shard(model, fs.plan(model, policy=LINEARS), fs.Mesh(shard=2))
    elif mesh == "hsdp":
        state = fs.shard(model, fs.plan(model, policy=LINEARS), fs.Mesh(replicate=2, shard=2))
    else:  # ~200-byte buckets for a 632-byte model
        state = fs.replicate(model, fs.Mesh(replicate=2), bucket_mb=2e-4, first_bucket_mb=1e-4)
    assert len(state.layout.flats) >= 2, state
    assert not any(f.frozen for f in state.layout.flats)
    batches = [tuple(_local(t, mesh, rank) for t in _global_batch(s)) for s in seeds]
    return model, state, batches


def _sharded(model, state):
    return lambda x: fs.call(model, state, x)


def _mse(forward, x, y) -> torch.Tensor:
    return (forward(x) - y).square().mean()


def _penalized(forward, x, y) -> torch.Tensor:
    """MSE plus PENALTY * the mean squared norm of each example's input gradient (WGAN-GP)."""
    x = x.detach().requires_grad_()
    out = forward(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return (out - y).square().mean() + PENALTY * gx.square().sum(dim=1).mean()


def _full(state, shards) -> dict[str, torch.Tensor]:
    """Shard-shaped tensors (grads, directions) as full tensors by FQN."""
    assert len(shards) == len(state.shards)
    for s, ref in zip(shards, state.shards, strict=True):
        assert s is not None and s.shape == ref.shape, (None if s is None else s.shape, ref.shape)
    full = fs.unshard(state.replace(shards=tuple(s.detach() for s in shards)))
    return {k: v.clone() for k, v in full.items()}


def _reference():
    """The plain model, and its parameters as fresh leaves requiring grad."""
    model = _model()
    return model, {k: p.detach().clone().requires_grad_() for k, p in model.named_parameters()}


def _plain(model, params):
    return lambda x: functional_call(model, params, (x,))


def _reference_grads(loss_fn, seed: int = 1):
    """One process: the loss on the global batch and its gradient by FQN."""
    model, params = _reference()
    loss = loss_fn(_plain(model, params), *_global_batch(seed))
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss, dict(zip(params, grads, strict=True))


def _assert_close(actual, expected, what: str) -> None:
    """Every tensor of `actual` within 1e-5 relative of `expected` (dicts, tuples or tensors)."""
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (what, sorted(actual), sorted(expected))
        pairs = [(f"{what}[{k}]", actual[k], expected[k]) for k in expected]
    elif isinstance(expected, tuple | list):
        assert len(actual) == len(expected), what
        pairs = [
            (f"{what}[{i}]", a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))
        ]
    else:
        pairs = [(what, actual, expected)]
    for name, a, e in pairs:
        assert a is not None, f"{name}: got None"
        assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        a, e = a.detach().double(), e.detach().double()
        err, scale = (a - e).abs().max().item(), e.abs().max().item()
        ratio = a.flatten() @ e.flatten() / (e.flatten() @ e.flatten()).clamp_min(1e-30)
        assert err <= 1e-5 * scale + 1e-7, (
            f"{name}: max abs error {err:.3e} against max |expected| {scale:.3e} "
            f"(best scalar fit actual ~ {ratio.item():.4f} * expected)"
        )


def _per_rank(results, key: str):
    return [(rank, r[key]) for rank, r in enumerate(results)]


# --- 1. gradient penalty on the inputs -----------------------------------------------------


def _gradient_penalty(mesh: str, rank: int) -> dict:
    model, state, [(x, y)] = _setup(mesh, rank)
    loss, grads = fs.value_and_grad(lambda s: _penalized(_sharded(model, s), x, y))(state)
    assert isinstance(grads, fs.ShardedGrads)
    return {"loss": loss, "grads": _full(state, grads.shards)}


@pytest.mark.parametrize("mesh", MESHES)
def test_gradient_penalty_on_inputs_matches_one_process(mesh):
    """Law: a loss holding `autograd.grad(out.sum(), x, create_graph=True)` of a sharded call
    (WGAN-GP) has `fs.value_and_grad` equal to one process's gradient on the global batch, and
    the mean of the ranks' losses equals that process's loss."""
    results = testing.run(functools.partial(_gradient_penalty, mesh), world_size=WORLD[mesh])
    loss, expected = _reference_grads(_penalized)
    _assert_close(torch.stack([r["loss"] for r in results]).mean(), loss, "mean loss")
    for rank, grads in _per_rank(results, "grads"):
        _assert_close(grads, expected, f"rank {rank} grads")


# --- 2. torch.autograd.grad over the shards ------------------------------------------------


def _autograd_over_shards(mesh: str, rank: int) -> dict:
    model, state, [(x, y)] = _setup(mesh, rank)

    def loss_fn(s):
        return _mse(_sharded(model, s), x, y)

    expected = fs.grad(loss_fn)(state).shards
    shards = tuple(s.detach().requires_grad_() for s in state.shards)
    found = torch.autograd.grad(loss_fn(state.replace(shards=shards)), shards)
    return {"found": found, "fs_grad": expected, "full": _full(state, found)}


@pytest.mark.parametrize("mesh", MESHES)
def test_autograd_grad_over_shards_equals_fs_grad(mesh):
    """Law: `torch.autograd.grad(loss(state.replace(shards=leaves)), leaves)` equals
    `fs.grad(loss)(state).shards` on every rank, padding included, and unsharded it equals one
    process's gradient on the global batch."""
    results = testing.run(functools.partial(_autograd_over_shards, mesh), world_size=WORLD[mesh])
    _, expected = _reference_grads(_mse)
    for rank, r in enumerate(results):
        _assert_close(r["found"], r["fs_grad"], f"rank {rank} autograd.grad vs fs.grad")
        _assert_close(r["full"], expected, f"rank {rank} autograd.grad vs one process")


# --- 3. torch.func.grad, grad_and_value and vjp --------------------------------------------


def _torch_func(mesh: str, rank: int) -> dict:
    model, state, [(x, y)] = _setup(mesh, rank)

    def loss_fn(s):
        return _mse(_sharded(model, s), x, y)

    def of_shards(shards):
        return loss_fn(state.replace(shards=shards))

    expected = fs.grad(loss_fn)(state).shards
    grad = torch.func.grad(of_shards)(state.shards)
    grad_and_value, value = torch.func.grad_and_value(of_shards)(state.shards)
    out, vjp_fn = torch.func.vjp(of_shards, state.shards)
    (vjp,) = vjp_fn(torch.ones_like(out))
    of_state = torch.func.grad(loss_fn)(state)
    assert isinstance(of_state, fs.ShardedState), type(of_state)
    return {
        "fs_grad": expected,
        "grad": tuple(grad),
        "grad_and_value": tuple(grad_and_value),
        "value": value,
        "vjp": tuple(vjp),
        "vjp_out": out,
        "of_state": tuple(of_state.shards),
        "full": _full(state, grad),
        "loss": loss_fn(state).detach(),
    }


@pytest.mark.parametrize("mesh", MESHES)
def test_torch_func_grad_and_vjp_equal_fs_grad(mesh):
    """Law: `torch.func.grad`, `grad_and_value` and `vjp` (cotangent 1) of the loss as a function
    of `state.shards`, and `torch.func.grad` of it as a function of the whole state (a pytree),
    equal `fs.grad(loss)(state).shards`, which unsharded equals one process's gradient."""
    results = testing.run(functools.partial(_torch_func, mesh), world_size=WORLD[mesh])
    _, expected = _reference_grads(_mse)
    for rank, r in enumerate(results):
        for key in ("grad", "grad_and_value", "vjp", "of_state"):
            _assert_close(r[key], r["fs_grad"], f"rank {rank} torch.func {key} vs fs.grad")
        _assert_close(r["value"], r["loss"], f"rank {rank} grad_and_value's value")
        _assert_close(r["vjp_out"], r["loss"], f"rank {rank} vjp's output")
        _assert_close(r["full"], expected, f"rank {rank} torch.func.grad vs one process")


# --- 4. Hessian-vector products by double backward -----------------------------------------


def _direction(model: nn.Module) -> dict[str, torch.Tensor]:
    """A random full direction by FQN, the same on every rank and in the reference (drawn in
    the model's parameter order, whatever order a layout keeps them in)."""
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(p.shape, generator=g) for k, p in model.named_parameters()}


def _hvp(loss_fn, leaves, v):
    g = torch.autograd.grad(loss_fn(leaves), leaves, create_graph=True)
    dot = sum((gi * vi).sum() for gi, vi in zip(g, v, strict=True))
    return torch.autograd.grad(dot, leaves)


def _sharded_hvp(mesh: str, rank: int) -> dict:
    model, state, [(x, y)] = _setup(mesh, rank)
    v = fs.reshard(state, _direction(model)).shards
    shards = tuple(s.detach().requires_grad_() for s in state.shards)
    loss = lambda sh: _mse(_sharded(model, state.replace(shards=sh)), x, y)  # noqa: E731
    hv = _hvp(loss, shards, v)
    _, forward_over_reverse = torch.func.jvp(torch.func.grad(loss), (state.shards,), (v,))
    return {"hv": _full(state, hv), "jvp_of_grad": _full(state, forward_over_reverse)}


@pytest.mark.parametrize("mesh", MESHES)
def test_hessian_vector_product_matches_one_process(mesh):
    """Law: the HVP by double backward over the shards, against a direction sharded like them
    (each rank's local dot of its shards is its part of one global sum), and by forward over
    reverse (`jvp` of `grad`), unsharded equals one process's HVP on the global batch with the
    full direction. Regression: forward over reverse raised torch's NotImplementedError."""
    results = testing.run(functools.partial(_sharded_hvp, mesh), world_size=WORLD[mesh])
    model, params = _reference()
    x, y = _global_batch(1)
    names, leaves = list(params), tuple(params.values())
    v = tuple(_direction(model)[k] for k in names)

    def loss_fn(ps):
        return _mse(_plain(model, dict(zip(names, ps, strict=True))), x, y)

    expected = dict(zip(names, _hvp(loss_fn, leaves, v), strict=True))
    assert all(h.abs().max() > 1e-3 for h in expected.values())  # a real second derivative
    for rank, hv in _per_rank(results, "hv"):
        _assert_close(hv, expected, f"rank {rank} HVP")
    for rank, hv in _per_rank(results, "jvp_of_grad"):  # forward over reverse
        _assert_close(hv, expected, f"rank {rank} HVP by torch.func.jvp of torch.func.grad")


# --- 5. MAML: two inner SGD steps with create_graph ----------------------------------------


def _maml(loss_fn, leaves, inner, outer):
    sh = leaves
    for _ in range(2):
        g = torch.autograd.grad(loss_fn(sh, *inner), sh, create_graph=True)
        sh = tuple(s - ALPHA * gi for s, gi in zip(sh, g, strict=True))
    outer_loss = loss_fn(sh, *outer)
    return outer_loss, torch.autograd.grad(outer_loss, leaves)


def _sharded_maml(mesh: str, rank: int) -> dict:
    model, state, [inner, outer] = _setup(mesh, rank, seeds=(2, 3))
    shards = tuple(s.detach().requires_grad_() for s in state.shards)

    def loss_fn(sh, x, y):
        return _mse(_sharded(model, state.replace(shards=sh)), x, y)

    loss, grads = _maml(loss_fn, shards, inner, outer)
    return {"loss": loss.detach(), "grads": _full(state, grads)}


@pytest.mark.parametrize("mesh", MESHES)
def test_maml_two_inner_steps_match_one_process(mesh):
    """Law: two inner SGD steps on the shards (their gradients are already the global ones)
    with `create_graph=True`, then the outer gradient w.r.t. the original shards, equal the
    same meta-gradient of one process on the global inner and outer batches."""
    results = testing.run(functools.partial(_sharded_maml, mesh), world_size=WORLD[mesh])
    model, params = _reference()
    names, leaves = list(params), tuple(params.values())

    def loss_fn(ps, x, y):
        return _mse(_plain(model, dict(zip(names, ps, strict=True))), x, y)

    loss, grads = _maml(loss_fn, leaves, _global_batch(2), _global_batch(3))
    expected = dict(zip(names, grads, strict=True))
    for rank, found in _per_rank(results, "grads"):
        _assert_close(found, expected, f"rank {rank} meta-gradient")
    _assert_close(torch.stack([r["loss"] for r in results]).mean(), loss, "mean outer loss")


# --- 6. vmap and jvp for inference ---------------------------------------------------------


def _tangent() -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, 6, generator=torch.Generator().manual_seed(11))


def _inference(mesh: str, rank: int) -> dict:
    model, state, [(x, _)] = _setup(mesh, rank)
    t = _local(_tangent(), mesh, rank)
    with torch.no_grad():
        batched = fs.call(model, state, x)
        mapped = torch.func.vmap(lambda xi: fs.call(model, state, xi[None]))(x)[:, 0]
    out, tangent_out = torch.func.jvp(lambda xi: fs.call(model, state, xi), (x,), (t,))
    return {"batched": batched, "mapped": mapped, "out": out, "tangent_out": tangent_out}


@pytest.mark.parametrize("mesh", MESHES)
def test_composed_transforms_keep_working_for_inference(mesh):
    """Law: `torch.func.vmap` over single examples of a sharded call (no grad) equals the call
    on the batch, and `torch.func.jvp` of a sharded call w.r.t. its input equals the plain
    model's jvp on the same examples."""
    results = testing.run(functools.partial(_inference, mesh), world_size=WORLD[mesh])
    x, _ = _global_batch(1)
    out, tangent_out = torch.func.jvp(_plain(*_reference()), (x,), (_tangent(),))
    for rank, r in enumerate(results):
        _assert_close(r["mapped"], r["batched"], f"rank {rank} vmap vs batch")
        _assert_close(r["batched"], _local(out, mesh, rank), f"rank {rank} call vs one process")
        _assert_close(r["out"], _local(out, mesh, rank), f"rank {rank} jvp primal")
        _assert_close(r["tangent_out"], _local(tangent_out, mesh, rank), f"rank {rank} jvp tangent")


def _shard_jvp(mesh: str, rank: int) -> dict:
    model, state, [(x, _)] = _setup(mesh, rank)
    # a direction in shard space: one per shard rank, the same across replicas
    g = torch.Generator().manual_seed(100 + state.layout.mesh.shard_rank)
    v = tuple(torch.randn(s.shape, generator=g) for s in state.shards)
    direction = _full(state, v)  # the same direction over the full parameters

    def forward(shards):
        return fs.call(model, state.replace(shards=shards), x)

    out, tangent_out = torch.func.jvp(forward, (state.shards,), (v,))
    with fwAD.dual_level():  # torch.autograd.forward_ad, the same rule
        duals = tuple(fwAD.make_dual(s, t) for s, t in zip(state.shards, v, strict=True))
        dual_tangent = fwAD.unpack_dual(forward(duals)).tangent
    return {"out": out, "tangent": tangent_out, "dual": dual_tangent, "direction": direction}


@pytest.mark.parametrize("mesh", ["fsdp", "ddp"])
def test_jvp_over_shards_matches_one_process(mesh):
    """Law: forward mode (`torch.func.jvp`, `torch.autograd.forward_ad`) of a sharded call
    w.r.t. the state's shards, along a random direction in shard space, equals the plain
    model's jvp w.r.t. its full parameters along that direction gathered. Regression: the
    shards carried a tangent but no grad, so the call gathered them outside autograd and
    the tangent came out zero (None under forward_ad), silently."""
    results = testing.run(functools.partial(_shard_jvp, mesh), world_size=WORLD[mesh])
    model, params = _reference()
    x, _ = _global_batch(1)
    direction = results[0]["direction"]
    for r in results[1:]:
        _assert_close(r["direction"], direction, "the direction, the same on every rank")

    def plain(p):
        return functional_call(model, p, (x,))

    primals = {k: p.detach() for k, p in params.items()}
    out, tangent_out = torch.func.jvp(plain, (primals,), ({k: direction[k] for k in primals},))
    for rank, r in enumerate(results):
        _assert_close(r["out"], _local(out, mesh, rank), f"rank {rank} jvp primal")
        _assert_close(r["tangent"], _local(tangent_out, mesh, rank), f"rank {rank} jvp tangent")
        _assert_close(r["dual"], _local(tangent_out, mesh, rank), f"rank {rank} forward_ad")


# --- 7. What torch.func cannot do on a state, said clearly ---------------------------------


def _per_example(rank: int) -> str:
    model, state, [(x, y)] = _setup("fsdp", rank)

    def loss(shards, xi, yi):
        return _mse(_sharded(model, state.replace(shards=shards)), xi[None], yi[None])

    try:
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(state.shards, x, y)
    except ValueError as e:
        return str(e)
    return "no error"


def test_per_example_gradients_on_a_state_are_refused_with_the_reason():
    """vmap over grad would average example i of every rank: refused, naming the unit and
    the way that works (per-example gradients on the full parameters)."""
    for message in testing.run(_per_example, world_size=2):
        assert "per-example gradients" in message and "funcshard.unshard(state)" in message
        assert "unit '" in message


def _func_warning(rank: int) -> list[str]:
    from funcshard.step import _unit_schedule as unit_schedule

    model, state, [(x, y)] = _setup("fsdp", rank)
    unit_schedule._warned_kept_gathered = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.func.grad(lambda s: _mse(_sharded(model, s), x, y))(state)
        fs.grad(lambda s: _mse(_sharded(model, s), x, y))(state)
    return [str(w.message) for w in caught if "funcshard" in str(w.message)]


def test_torch_func_on_a_resharding_state_warns_once_that_units_stay_gathered():
    """torch.func refuses saved-tensor hooks, so reshard_after_forward cannot regather there:
    said once per process, and not by fs.grad, which keeps resharding."""
    for messages in testing.run(_func_warning, world_size=2):
        assert len(messages) == 1, messages
        assert "units stay gathered" in messages[0]


def _misuses(rank: int) -> list[str]:
    model, state, [(x, y)] = _setup("fsdp", rank)
    messages = []

    def weight_decay(s):
        return _mse(_sharded(model, s), x, y) + sum(t.square().sum() for t in s.shards)

    def scaled(s):
        return _mse(_sharded(model, s.replace(shards=tuple(2 * t for t in s.shards))), x, y)

    for f in (weight_decay, scaled):
        try:
            fs.value_and_grad(f, reduce=False)(state)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    shards = tuple(s.detach().requires_grad_() for s in state.shards)
    out = _sharded(model, state.replace(shards=shards))(x)
    try:
        torch.autograd.grad(out.sum(0), shards, torch.eye(3), is_grads_batched=True)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    return messages


def test_what_local_or_batched_gradients_cannot_express_is_refused():
    """reduce=False takes gradients w.r.t. the gathered parameters: a loss that also uses the
    shards, or calls the model on shards it computed, would silently lose that part; batched
    cotangents would need a reduce per row. Each raises, saying why."""
    for wd, scaled, batched in testing.run(_misuses, world_size=2):
        assert "uses the state's shards directly" in wd, wd
        assert "shards it computed" in scaled, scaled
        assert "batched gradients through a sharded call" in batched, batched


def _forward_only(rank: int) -> list[int]:
    """Live tensor bytes after each of 4 forwards. Inside `only_new_objects()` (a freeze):
    the collects and walks see only objects made here, not the 300k a worker holds after the
    suite's compiled tests (tests/step/test_memory.py's [Note: walking only the task's
    objects]); a graph kept alive is made here, so it is still seen."""
    with only_new_objects():
        return _forward_sizes(rank)


def _forward_sizes(rank: int) -> list[int]:
    model, state, [(x, y)] = _setup("fsdp", rank)
    shards = tuple(s.detach().requires_grad_() for s in state.shards)
    sizes = []
    for _ in range(4):
        _mse(_sharded(model, state.replace(shards=shards)), x, y)  # never backpropagated
        time.sleep(0.05)  # gloo's worker threads let go of finished all-gathers' inputs
        gc.collect()
        sizes.append(
            sum(
                o.untyped_storage().nbytes()
                for o in gc.get_objects()
                if type(o) is torch.Tensor
                and not o.is_meta
                and not torch._C._functorch.is_functorch_wrapped_tensor(o)
            )
        )
    return sizes


def test_a_graph_never_backpropagated_is_freed():
    """Regression: the resharding pack hook returned saved outputs as they were, a cycle
    through C++ (node -> saved tensor -> node) that kept every such graph alive."""
    for sizes in testing.run(_forward_only, world_size=2):
        assert sizes[1] == sizes[2] == sizes[3], sizes  # (the first call fills caches)
