"""FSDP2's per-module gradient sync (`set_requires_gradient_sync(False, recurse=False)` on
chosen modules) as `fs.value_and_grad(..., keep_local=units)`: the scenarios of
test_fully_shard_training.py's `test_gradient_accumulation` (modes "some_mlps" and
"root_only"), checked against one process at FSDP2's tolerances, with the collectives
each micro-batch issued.
"""

import functools

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard import testing

STEPS, MICRO, DIM = 3, 2, 8
MODES = {"some_mlps": ("1", "2"), "root_only": ("",)}  # the units kept local, per mode


def _model() -> nn.Sequential:
    """FSDP2's model: a linear the root owns, then three MLPs, each a unit. The MLPs differ in
    width so that each unit's collectives have a size of their own."""
    torch.manual_seed(42)
    mlps = [
        nn.Sequential(nn.Linear(DIM, DIM * k), nn.ReLU(), nn.Linear(DIM * k, DIM))
        for k in (2, 3, 4)
    ]
    return nn.Sequential(nn.Linear(DIM, DIM), *mlps)


def _plan(model: nn.Module) -> fs.Plan:
    return fs.plan(model, policy=lambda module, name, numel: name in {"1", "2", "3"})


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    seed = 1000 * step + 10 * micro + rank
    return torch.randn(2, DIM, generator=torch.Generator().manual_seed(seed))


def _sum_loss(model: nn.Module, state, x: torch.Tensor) -> torch.Tensor:
    return fs.call(model, state, x).sum()


def _units_of(records: list, state: fs.ShardedState) -> list[tuple[str, str]]:
    """(op, unit) of each gradient collective, told apart by size (the verdict's int64
    all-gather left out)."""
    layout = state.layout
    sizes = {}
    for flat in layout.flats:
        sizes["reduce_scatter", flat.padded_numel] = flat.unit
        sizes["all_reduce", flat.shard_numel] = flat.unit
    return sorted(
        (r.op, sizes[r.op, r.numel]) for r in records if r.op in ("reduce_scatter", "all_reduce")
    )


def _train(mesh_kwargs: dict, rank: int) -> dict:
    """Every mode on one mesh: three Adam steps of two micro-batches, the chosen units kept
    local in both and reduced once after the last (`fs.reduce`), the others reduced in each."""
    out = {}
    for mode, local in MODES.items():
        model = _model()
        state = fs.shard(model, _plan(model), fs.Mesh(**mesh_kwargs))
        opt = fs.optim.adam(1e-2)
        opt_state = opt.init(state)
        grad_fn = fs.value_and_grad(functools.partial(_sum_loss, model), keep_local=local)
        comms = []
        for step in range(STEPS):
            total = None
            for micro in range(MICRO):
                with fs.comm.record() as log:
                    _, grads = grad_fn(state, _batch(step, micro, rank))
                comms.append(_units_of(log, state))
                total = grads if total is None else fs.accumulate(total, grads)
            kinds = (type(total).__name__, tuple(total.local_units))
            with fs.comm.record() as log:
                reduced = fs.reduce(state, total)
            comms.append(_units_of(log, state))
            state, opt_state = opt.step(reduced, opt_state, state)
        out[mode] = (fs.unshard(state), comms, kinds)
    return out


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each micro-batch's loss the ranks' mean of their summed outputs,
    gradients accumulated over micro-batches, then torch.optim.Adam."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            loss = sum(model(_batch(step, micro, r)).sum() for r in range(world)) / world
            loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _expected_comms(local: tuple[str, ...], hsdp: bool) -> tuple[list, list]:
    """(per micro-batch, at fs.reduce): the units each reduces; on HSDP each reduce-scatter
    followed by its all-reduce across replicas."""
    units = ["", "1", "2", "3"]
    ops = ["reduce_scatter", "all_reduce"] if hsdp else ["reduce_scatter"]
    micro = sorted((op, u) for u in units if u not in local for op in ops)
    final = sorted((op, u) for u in local for op in ops)
    return micro, final


@pytest.mark.parametrize(
    ("mesh_kwargs", "world"), [({"shard": 2}, 2), ({"replicate": 2, "shard": 2}, 4)]
)
def test_gradient_accumulation_some_mlps_and_root_only(mesh_kwargs, world):
    """test_fully_shard_training.py::test_gradient_accumulation, modes "some_mlps" (two MLPs'
    sync off until the last micro-batch) and "root_only" (`recurse=False` on the root): the
    units kept local issue no reduction in any micro-batch and one at `fs.reduce`; three
    Adam steps equal one process within 1e-5 relative, on FSDP and HSDP 2x2."""
    expected = _reference(world)
    hsdp = "replicate" in mesh_kwargs
    for per_rank in testing.run(functools.partial(_train, mesh_kwargs), world_size=world):
        for mode, local in MODES.items():
            params, comms, kinds = per_rank[mode]
            assert kinds == ("LocalGrads", local), (mode, kinds)
            micro, final = _expected_comms(local, hsdp)
            for step in range(STEPS):
                rows = comms[step * (MICRO + 1) : (step + 1) * (MICRO + 1)]
                assert rows[:MICRO] == [micro] * MICRO, (mode, step, rows)
                assert rows[MICRO] == final, (mode, step, rows)
            for name, p in params.items():
                torch.testing.assert_close(p, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def _misuses(rank: int) -> list[str]:
    """Every refusal, on every rank, before any collective (or after, where one rank's
    collective-free check decides alike on all)."""
    model = _model()
    for p in model[3].parameters():  # a frozen unit
        p.requires_grad_(False)
    state = fs.shard(model, _plan(model), fs.Mesh(shard=2))
    x = _batch(0, 0, rank)
    loss = functools.partial(_sum_loss, model)
    messages = []

    def attempt(fn):
        try:
            with fs.comm.record() as log:
                fn()
            messages.append("no error")
        except (ValueError, TypeError) as e:
            messages.append(f"{type(e).__name__}: {e} [{len(log)} collectives]")

    attempt(lambda: fs.value_and_grad(loss, keep_local=("9",))(state, x))
    attempt(lambda: fs.value_and_grad(loss, keep_local=("3",))(state, x))
    attempt(lambda: fs.value_and_grad(loss, keep_local=(model[1],))(state, x))
    attempt(lambda: fs.value_and_grad(loss, keep_local="1")(state, x))
    _, partial = fs.value_and_grad(loss, keep_local=("1",))(state, x)
    _, whole = fs.value_and_grad(loss)(state, x)
    _, other = fs.value_and_grad(loss, keep_local=("2",))(state, x)
    opt = fs.optim.adam(1e-2)
    opt_state = opt.init(state)
    attempt(lambda: opt.step(partial, opt_state, state))
    attempt(lambda: fs.accumulate(partial, whole))
    attempt(lambda: fs.accumulate(partial, other))
    attempt(lambda: fs.reduce(state, partial, divide_factor=4.0))
    return messages


def test_keep_local_refuses_what_it_cannot_do_naming_the_unit():
    """An unknown unit, a frozen unit, a module object, a bare string; an optimizer handed
    gradients with local units; adding a unit local in one gradient to the same unit
    reduced in the other; a divide factor for partly reduced gradients: each raises,
    naming the unit, before any collective, identically on every rank."""
    per_rank = testing.run(_misuses, world_size=2)
    assert per_rank[0] == per_rank[1]
    unknown, frozen, module, string, optimizer, mixed, differ, divide = per_rank[0]
    assert unknown.startswith("ValueError") and "'9'" in unknown and "[0 collectives]" in unknown
    assert "'3'" in frozen and "frozen" in frozen and "[0 collectives]" in frozen
    assert module.startswith("TypeError") and "Sequential" in module, module
    assert "[0 collectives]" in module
    assert string.startswith("TypeError") and "'1'" in string, string
    assert "'1'" in optimizer and "funcshard.reduce" in optimizer, optimizer
    assert optimizer.endswith("[0 collectives]"), optimizer
    assert "'1'" in mixed and "[0 collectives]" in mixed, mixed
    assert "'1'" in differ and "'2'" in differ, differ
    assert "divide_factor" in divide and "[0 collectives]" in divide, divide
