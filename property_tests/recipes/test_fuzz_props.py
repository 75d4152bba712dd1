"""The whole path, fuzzed: random module tree, plan and mesh; shard, train, save; load at
another world size, train on; the result matches one plain process trained on every batch."""

import functools
import shutil
import tempfile
import warnings

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import testing
from funcshard.testing import strategies

BATCH = 4  # rows of the global batch, split evenly over the ranks
STEPS_BEFORE, STEPS_AFTER = 2, 1
LR, MOMENTUM = 0.1, 0.9


def _batch(case: strategies.PlanCase, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = case.spec.example_input(BATCH, seed=seed + step)
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed - step - 1))
    return x, target


def _loss(model, params, x, target):
    return (fs.call(model, params, x) - target).square().mean()


def _model(case: strategies.PlanCase):
    return case.spec.build().eval()  # eval: BatchNorm uses its running stats, per sample


def _sharded_steps(case, mesh_shape, seed, directory, resume: bool, rank: int):
    """Train on this rank's rows; the first run saves, the second loads and returns params."""
    model = _model(case)
    mesh = mesh_shape.build()
    state = fs.shard(model, _plan(case, model), mesh)
    opt = fs.optim.sgd(LR, momentum=MOMENTUM)
    opt_state = opt.init(state)
    first = 0
    if resume:
        state, opt_state, first, _ = fs.checkpoint.load(directory, like=(state, opt_state))
    steps = STEPS_BEFORE + STEPS_AFTER if resume else STEPS_BEFORE
    grad_fn = fs.value_and_grad(functools.partial(_loss, model))
    for step in range(first, steps):
        x, target = _batch(case, step, seed)
        rows = BATCH // mesh.size
        mine = slice(rank * rows, (rank + 1) * rows)
        _, grads = grad_fn(state, x[mine], target[mine])
        updates, opt_state = opt.update(grads, opt_state, state)
        state = fs.apply_updates(state, updates)
    if not resume:
        fs.checkpoint.save(directory, state, opt_state, step=steps)
        return None
    return fs.unshard(state)


def _plain_run(case, seed: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch, torch.optim.SGD over what funcshard trains: every
    parameter that requires grad, ignored (replicated) ones included."""
    model = _model(case)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM) if trained else None
    for step in range(STEPS_BEFORE + STEPS_AFTER):
        x, target = _batch(case, step, seed)
        loss = (model(x) - target).square().mean()
        if opt is not None:
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}


def _plan(case, model) -> fs.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frozen and trainable mixed in a unit only warn
        return fs.plan(model, **case.kwargs(model))


# Found by this test: frozen members of a trainable unit were trained (plan(frozen="warn"))
_MIXED_FROZEN = strategies.PlanCase(
    spec=strategies.ModuleSpec(("sequential", (("linear", False), ("linear", True))), 2, 0),
    policy=fs.policy.module_classes([torch.nn.LayerNorm]),
    keep_fp32=(),
    ignored=(),
)
# ...and a unit that is a ModuleList (no forward of its own) was never gathered
_MODULE_LIST_UNIT = strategies.PlanCase(
    spec=strategies.ModuleSpec(("stack", (("batchnorm", False), ("batchnorm", False))), 8, 0),
    policy=fs.policy.size(30),
    keep_fp32=(),
    ignored=(),
)


@settings(max_examples=25)
@example(_MIXED_FROZEN, strategies.MeshShape(2, 1), strategies.MeshShape(1, 1), 1)
@example(_MODULE_LIST_UNIT, strategies.MeshShape(1, 2), strategies.MeshShape(1, 1), 1)
@given(
    case=strategies.plans(),
    before=strategies.meshes(world_sizes=(2, 4)),
    after=strategies.meshes(world_sizes=(1, 2)),
    seed=st.integers(1, 2**20),
)
def test_train_save_load_elsewhere_train_equals_one_plain_process(case, before, after, seed):
    directory = tempfile.mkdtemp(prefix="funcshard-fuzz-")
    try:
        testing.run(
            functools.partial(_sharded_steps, case, before, seed, directory, False),
            world_size=before.world_size,
        )
        results = testing.run(
            functools.partial(_sharded_steps, case, after, seed, directory, True),
            world_size=after.world_size,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    expected = _plain_run(case, seed)
    for rank_params in results:
        assert set(rank_params) <= set(expected)
        for fqn, value in rank_params.items():
            torch.testing.assert_close(value, expected[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
