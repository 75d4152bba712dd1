"""What `fs.testing.check` runs on every rank: a user's model trained under one configuration,
observed for the laws of DESIGN.md §10.

[Note: one run per configuration]
Starting ranks costs seconds and a configuration is cheap, so each configuration is one
`fs.testing.run` call that observes every law at once, and the parent judges the
observations (funcshard/testing/judge.py). On each rank the call:

1. builds the model (on the meta device where `shard` can initialize it, else on the CPU
   after `torch.manual_seed(seed)`), in eval mode with batch-norm layers in train mode
   (dropout off, batch statistics on), and shards it: the round trip `reshard(state,
   unshard(state))` must give the same shards bitwise, and padding must be zero;
2. trains `steps` steps (the standard step, funcshard/testing/harness.py), recording each
   step's collectives (`collectives.record`) and the ones never waited for, with every
   collective compared across ranks before it is issued (`check_collectives`), the first
   step's live all-gathered bytes counted (`LiveTensors`), and every input of every step
   (the state, the optimizer state, the batch) and the model itself compared after it;
3. saves a checkpoint before the last step (funcshard/testing/resume.py, which a second
   call at another world size loads);
4. trains again from a fresh state under `fs.testing.chaos` (other timing, the same
   program): the losses, shards, buffers and collectives must be bitwise the same;
5. on rank 0 only, trains the one-process reference (funcshard/testing/reference.py).

A failure inside a phase is raised as `PhaseFailed` naming the law it breaks, so the parent
reports it by name even when the ranks never finish the call; the reference communicates
nothing, so its failure is returned instead, with everything else observed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch import Tensor, nn

from funcshard.comm import _collectives as collectives
from funcshard.comm._chaos import chaos
from funcshard.core._layout import FlatLayout, shard_pieces
from funcshard.core._rng import manual_seed
from funcshard.core._state import ShardedState
from funcshard.step._metrics import pmean
from funcshard.step._unsharding import reshard, unshard
from funcshard.testing import probes
from funcshard.testing.harness import (
    LAWS,
    Case,
    Config,
    PhaseFailed,
    bitwise,
    build,
    first_lines,
    has_batch_stats,
    local_batch,
    make_step,
    mesh_of,
    optimizer,
    phase,
    user_setup,
)
from funcshard.testing.reference import reference
from funcshard.testing.resume import save

__all__ = ["LAWS", "observe"]


def observe(case: Case, config: Config, path: str | None, rank: int) -> dict[str, Any]:
    """Run one configuration on this rank (see [Note: one run per configuration]); save the
    checkpoint under `path`."""
    with user_setup(case):
        return _observe(case, config, path, rank)


def _observe(case: Case, config: Config, path: str | None, rank: int) -> dict[str, Any]:
    model, state, built_on = build(case, config, mesh_of(config))
    batch_stats = has_batch_stats(model) if case.batch_stats is None else case.batch_stats
    out: dict[str, Any] = {"built_on": built_on, "batch_stats": batch_stats}
    names = _names(model)
    values = _values(model)
    with phase("round_trip"):
        out["round_trip"] = _round_trip(model, state, built_on)
        first = {k: v.clone() for k, v in unshard(state).items()}
        first_buffers = {k: v.clone() for k, v in state.buffers.items()}
    save_to = path if "checkpoint" in case.laws else None
    out["run"] = _train(case, config, model, state, names, rank, save_to)
    if "determinism" in case.laws:
        _, again, _ = build(case, config, state.layout.mesh)
        with chaos(config.seed, delay_chance=0.3, max_delay=0.002, gc_chance=0.0):
            out["again"] = _train(case, config, model, again, names, rank, None)
        out["same_again"] = _same_runs(out["run"], out["again"])
    out["model_written"] = [
        k for k, v in _values(model).items() if k in values and not bitwise(v, values[k])
    ]
    if rank == 0 and "parity" in case.laws:  # no collectives: a failure is kept, not raised
        try:
            out["reference"] = reference(case, model, config, batch_stats, first, first_buffers)
        except Exception as e:
            out["reference"] = f"{type(e).__name__}: {first_lines(e)}"
    return out


def _names(model: nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer of the model by name: its shape and dtype."""
    named = [("parameter", model.named_parameters()), ("buffer", model.named_buffers())]
    return {f"{kind} {n}": (tuple(t.shape), t.dtype) for kind, ts in named for n, t in ts}


def _values(model: nn.Module) -> dict[str, Tensor]:
    """Copies of the model's own tensors on a real device (a meta model has none)."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {k: t.detach().clone() for k, t in tensors.items() if not t.is_meta}


def _round_trip(model: nn.Module, state: ShardedState, built_on: str) -> list[str]:
    """What breaks the round trip: `reshard(unshard(state))` against the state, the model's
    own values (for a model built on the CPU), and padding that is not zero."""
    full = unshard(state)
    back = reshard(state, full)
    flats = state.layout.flats
    problems = [
        f"shard of {flat.name} changed through unshard and reshard"
        for a, b, flat in zip(state.shards, back.shards, flats, strict=True)
        if not bitwise(a, b)
    ]
    again = unshard(back)
    problems += [
        f"{k} changed through reshard and unshard" for k in full if not bitwise(full[k], again[k])
    ]
    bumped = {k: v + 1 for k, v in full.items()}  # other values: a reshard that ignores them fails
    through = unshard(reshard(state, bumped))
    problems += [
        f"{k}: reshard lost new values" for k in full if not bitwise(bumped[k], through[k])
    ]
    if built_on == "cpu":
        params = dict(model.named_parameters())
        problems += [f"{k} unlike the model's" for k in full if not bitwise(full[k], params[k])]
    rank = state.layout.mesh.shard_rank
    for shard, flat in zip(state.shards, flats, strict=True):
        if not bool(shard[_padding_mask(flat, rank)].eq(0).all()):
            problems.append(f"padding of {flat.name} is not zero on shard rank {rank}")
    return problems


def _train(
    case: Case,
    config: Config,
    model: nn.Module,
    state: ShardedState,
    names: dict[str, tuple],
    rank: int,
    save_to: str | None,
) -> dict[str, Any]:
    """Train `case.steps` steps from `state`, observing collectives, memory and purity."""
    mesh = state.layout.mesh
    opt = optimizer(case, config)
    opt_state = opt.init(state)
    step = make_step(case, config, model, opt)
    run: dict[str, Any] = {"losses": [], "collectives": [], "unwaited": [], "mutated": []}
    for s in range(case.steps):
        if save_to is not None and s == case.steps - 1:
            with phase("checkpoint"):
                run["saved"] = save(case, config, model, state, opt_state, s, save_to, rank)
        inputs, targets = local_batch(case, config, s, mesh)
        before = _copies((state, opt_state, inputs, targets))
        manual_seed(config.seed, mesh, s)
        with (
            _model_kept(model, names, s),
            phase("parity"),
            collectives.record() as log,
            probes.gathered_bytes(s == 0 and "memory" in case.laws) as memory,
            probes.unwaited() as issued,
        ):
            loss, new_state, new_opt_state = step(state, opt_state, inputs, targets)
        run["mutated"] += _written(before, (state, opt_state, inputs, targets), s)
        state, opt_state = new_state, new_opt_state
        run["losses"].append(pmean(loss, mesh).item())
        run["collectives"].append([(r.op, len(r.ranks), r.numel, r.dtype) for r in log])
        run["unwaited"] += [f"step {s}: {i.what}" for i in issued if not i.waited]
        if memory is not None:
            run["gathered"] = (memory.peak_bytes, probes.gathered_bound(model, state))
    run["final"] = {k: v.clone() for k, v in unshard(state).items()}
    run["shards"] = [s.clone() for s in state.shards]
    run["buffers"] = {k: v.clone() for k, v in state.buffers.items()}
    return run


@contextlib.contextmanager
def _model_kept(model: nn.Module, names: dict[str, tuple], at: int) -> Iterator[None]:
    """Raise `PhaseFailed("purity")` when the block changed the model's own parameters or
    buffers (a parameter created in forward), whether or not the step failed because of it."""
    try:
        yield
    finally:
        now = _names(model)
        words = [
            f"the model gained {n} in step {at} (created in forward?)"
            for n in now
            if n not in names
        ]
        words += [f"the model lost {n} in step {at}" for n in names if n not in now]
        words += [
            f"the model's {n} changed shape or dtype in step {at}"
            for n in now
            if n in names and now[n] != names[n]
        ]
        if words:
            raise PhaseFailed("purity", "; ".join(words))


def _copies(tree: Any) -> list[Tensor]:
    return [t.detach().clone() for t in optree.tree_leaves(tree) if isinstance(t, Tensor)]


def _written(before: list[Tensor], tree: Any, at: int) -> list[str]:
    """What a step wrote of its inputs: the state, the optimizer state and the batch."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    tensors = [(p, t) for p, t in zip(paths, leaves, strict=True) if isinstance(t, Tensor)]
    names = ("the state", "the optimizer state", "the inputs", "the targets")
    return [
        f"step {at} wrote {names[path[0]]}{''.join(f'[{k!r}]' for k in path[1:])}"
        for (path, t), old in zip(tensors, before, strict=True)
        if not bitwise(t, old)
    ]


def _same_runs(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Where two runs of one configuration differ bitwise."""
    problems = [
        f"step {i} loss {x!r} then {y!r}"
        for i, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True))
        if x != y
    ]
    problems += [
        f"shard {i}"
        for i, (x, y) in enumerate(zip(a["shards"], b["shards"], strict=True))
        if not bitwise(x, y)
    ]
    problems += [f"buffer {k}" for k, v in a["buffers"].items() if not bitwise(v, b["buffers"][k])]
    if a["collectives"] != b["collectives"]:
        problems.append("the collectives issued")
    return problems


def _padding_mask(flat: FlatLayout, rank: int) -> Tensor:
    """Which elements of shard rank `rank`'s shard of `flat` are padding."""
    mask = torch.ones(flat.shard_numel, dtype=torch.bool)
    for p in shard_pieces(flat, rank):
        mask[p.at : p.at + p.stop - p.start] = False
    return mask
