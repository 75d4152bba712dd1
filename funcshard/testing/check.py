"""Check the laws of sharded training (DESIGN.md §10) on your own model, in one call.

`fs.testing.check(make_model, make_batch, loss_fn)` trains the model sharded over gloo ranks
in many configurations (FSDP, HSDP and DDP meshes of the world sizes given, plans,
`reshard_after_forward`, mixed precision, seeds) and checks, on each: the round trip of
`shard` and `unshard`, parity with one plain process, determinism, checkpoints that load at
another world size, collectives, purity and gathered memory. See docs/guides/checking.md.

Which configurations run, and how the smallest failure is found, is funcshard/testing/search.py
(see [Note: hypothesis drives the configurations] there); each is checked by
funcshard/testing/examine.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import optree
import torch.nn.functional as F
from torch import Tensor, nn

from funcshard.optim._base import Optimizer
from funcshard.testing.harness import LAWS, Case, Config, global_batch
from funcshard.testing.recipe import Axes, OptimizerChoice
from funcshard.testing.report import LawResult, LawViolation, Report
from funcshard.testing.search import Search, explore, qualified_name

__all__ = ["LAWS", "LawResult", "LawViolation", "Report", "check", "default_loss"]


def check(
    make_model: Callable[[], nn.Module],
    make_batch: Callable[[int], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    *,
    policy: Any = None,
    world_sizes: Sequence[int] = (1, 2, 4),
    steps: int = 3,
    examples: int = 8,
    mixed_precision: bool = False,
    recipes: bool | Axes = True,
    backend: str = "aot_eager",
    optimizer: OptimizerChoice = "adamw",
    lr: float = 1e-2,
    laws: Sequence[str] = LAWS,
    seed: int = 0,
    database: Any = None,
    shrink_budget: int = 8,
    batch_stats: bool | None = None,
    meta: bool | None = None,
    setup: Callable[[], contextlib.AbstractContextManager] | None = None,
    quick: bool = False,
    timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
    raise_on_failure: bool = True,
) -> Report:
    """Check the sharding laws on a model; return a `Report`, raise `LawViolation` on failure.

    `make_model()` builds the model (on every rank, and on the meta device where
    `fs.shard` can initialize it: `meta=None` tries, `True` insists, `False` builds on the
    CPU; a `make_model` that builds inside `fs.deferred_init()` is replayed, with no seed).
    `make_batch(step)` returns the global batch `(inputs, targets)`: tensors, tuples of
    tensors or a dict of keyword tensors, split along dim 0 over the data-parallel ranks; the
    model is called as `model(*inputs)`, `model(**inputs)` or `model(inputs)`.
    `loss_fn(outputs, targets)` is a mean loss (default: `default_loss`). All three must be
    module-level functions (every rank unpickles them). Dropout is off on both sides: the
    model runs in eval mode, its batch-norm layers in train mode.

    `policy` is the plan's policy (default: several drawn: the blocks inside the first
    ModuleList, a size threshold, the root alone). `world_sizes` are the meshes' sizes (each
    must divide the batch); `examples` configurations are drawn, `steps` optimizer steps
    each (`optimizer` "adamw" with eps 1e-3, or "sgd" with momentum, at `lr`; or a
    module-level function returning your own `fs.optim.Optimizer`, whose rates are its own:
    parity then compares it on the shards with the same optimizer on one process's params
    dict, where each leaf is a whole parameter, and no parameter groups or schedule are
    drawn for it);
    `mixed_precision=True` also draws bf16 gathers. `recipes` draws the features a real
    step combines on top (see [Note: recipes compose] in funcshard/testing/recipe.py):
    activation checkpointing of every other block, each block's first Linear frozen
    (`frozen="split"`), the step compiled by `fs.compile(backend=backend)`, clipping,
    accumulation over 2 micro-batches (where the batch splits), two parameter groups, a
    warmup schedule, a user `fs.Comm` and the owned placement (`plan(placement=...)`, each
    unit within its bound); an `Axes` picks some, False none. `laws` picks
    among `LAWS`.
    `batch_stats` says whether the model normalizes by batch statistics (default: whether it
    holds batch-norm layers): then the reference runs each rank's micro-batch apart. `setup()`
    returns a context manager entered on every rank around each configuration's work (to
    patch something under test, say). `quick=True` checks world sizes up to 2, 3
    configurations of 2 steps, with every recipe axis but compilation. `seed` fixes the
    configurations drawn; with `database` (a hypothesis database, or a directory) they are
    drawn afresh instead, and the failures saved there by earlier checks replayed first.
    `progress(line)` hears of each configuration as it ends.
    """
    axes = recipes if isinstance(recipes, Axes) else Axes() if recipes else Axes.none()
    if callable(optimizer):  # its groups and rates are its own
        axes = dataclasses.replace(axes, groups=False, schedule=False)
    if quick:
        world_sizes = [w for w in world_sizes if w <= 2] or [min(world_sizes)]
        steps, examples, shrink_budget = min(steps, 2), min(examples, 3), min(shrink_budget, 4)
        axes = dataclasses.replace(axes, compiled=False)
    case = Case(
        make_model=make_model,
        make_batch=make_batch,
        loss_fn=loss_fn if loss_fn is not None else default_loss,
        policy=policy,
        steps=steps,
        optimizer=optimizer,
        lr=lr,
        batch_stats=batch_stats,
        meta=meta,
        setup=setup,
        laws=tuple(laws),
        backend=backend,
    )
    worlds = _validated(case, world_sizes, steps, examples)
    micro = (1, 2) if axes.micro_batches and _splits(case, [2 * w for w in worlds]) else (1,)
    start = time.monotonic()
    search = Search(case, worlds, examples, shrink_budget, timeout, progress)
    search.recipes = axes != Axes.none()
    explore(search, worlds, mixed_precision, axes, micro, examples, seed, database)
    report = Report(
        results=tuple(r for results in search.results.values() for r in results),
        smallest=search.failing[-1] if search.failing else None,
        seed=seed if database is None else None,
        seconds=time.monotonic() - start,
        model=qualified_name(make_model),
        notes=tuple(dict.fromkeys(search.notes)),
    )
    if raise_on_failure and not report.ok:
        raise LawViolation(report)
    return report


def default_loss(outputs: Any, targets: Tensor) -> Tensor:
    """Cross entropy for integer targets (class scores along the last dim), mean squared error
    for float targets; of `output_logits(outputs)` (a transformers output's `.logits`, a
    dict's "logits", a tuple's first element)."""
    outputs = output_logits(outputs)
    if targets.is_floating_point():
        return F.mse_loss(outputs, targets)
    return F.cross_entropy(outputs.flatten(0, -2).float(), targets.flatten())


def output_logits(outputs: Any) -> Any:
    """The scores in a model's outputs: the outputs themselves when a tensor, a transformers
    output's `.logits`, a dict's "logits", or a tuple's or list's first element (nanoGPT's
    `(logits, loss)`); anything else as it is."""
    if isinstance(outputs, Tensor):
        return outputs
    if hasattr(outputs, "logits"):
        return outputs.logits
    if isinstance(outputs, Mapping):
        return outputs.get("logits", outputs)
    if isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    return outputs


def _validated(
    case: Case, world_sizes: Sequence[int], steps: int, examples: int
) -> tuple[int, ...]:
    """Check the arguments on the caller's side, before any rank starts."""
    worlds = tuple(sorted(set(world_sizes)))
    if not worlds or any(not isinstance(w, int) or w < 1 for w in worlds):
        raise ValueError(f"fs.testing.check: world_sizes must be positive ints, got {world_sizes}.")
    unknown = [law for law in case.laws if law not in LAWS]
    if unknown or not case.laws:
        raise ValueError(f"fs.testing.check: laws must be among {LAWS}, got {case.laws}.")
    if steps < 2 or examples < 1:
        raise ValueError(
            f"fs.testing.check: steps must be at least 2 (the checkpoint is saved before the "
            f"last) and examples at least 1, got steps={steps}, examples={examples}."
        )
    _check_optimizer(case.optimizer)
    try:
        pickle.dumps(case)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"fs.testing.check: make_model, make_batch, loss_fn, policy and setup are sent to "
            f"every rank, so they must pickle by reference, got {e}. Define them as "
            f"module-level functions (not lambdas or closures), or use functools.partial of one."
        ) from e
    _check_batch(case, worlds)
    return worlds


def _check_optimizer(optimizer: Any) -> None:
    """'adamw', 'sgd', or a factory that pickles by reference and returns an Optimizer."""
    if isinstance(optimizer, str) and optimizer in ("adamw", "sgd"):
        return
    if not callable(optimizer):
        raise ValueError(
            f"fs.testing.check: optimizer must be 'adamw', 'sgd' or a module-level function "
            f"returning an fs.optim.Optimizer, got {optimizer!r}."
        )
    try:
        pickle.dumps(optimizer)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"fs.testing.check: optimizer={qualified_name(optimizer)} is sent to every rank, so it "
            f"must pickle by reference, got {e}. Define the factory as a module-level "
            f"function returning an fs.optim.Optimizer (not a lambda or closure), or pass "
            f"functools.partial of one."
        ) from e
    made = optimizer()
    if not isinstance(made, Optimizer):
        raise TypeError(
            f"fs.testing.check: optimizer={qualified_name(optimizer)} must return an "
            f"fs.optim.Optimizer, got {type(made).__name__}. Return "
            f"fs.optim.Optimizer(init, update)."
        )


def _first_batch(case: Case) -> Any:
    return global_batch(case, Config(1, 1, False, "root", True, None, 0, 1), 0)


def _splits(case: Case, parts: Sequence[int]) -> bool:
    """Whether the batch's rows split evenly into each of `parts`."""
    tensors = [t for t in optree.tree_leaves(_first_batch(case)) if isinstance(t, Tensor)]
    return all(t.dim() and t.shape[0] % p == 0 for t in tensors for p in parts)


def _check_batch(case: Case, worlds: tuple[int, ...]) -> None:
    """The batch is a pair whose tensors all split evenly over every world size."""
    batch = _first_batch(case)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise TypeError(
            f"fs.testing.check: make_batch(step) must return (inputs, targets), got "
            f"{type(batch).__name__}. Return e.g. ((x,), y) or ({{'input_ids': x}}, y)."
        )
    leaves = optree.tree_leaves(cast("optree.PyTree[Any]", batch), none_is_leaf=False)
    tensors = [t for t in leaves if isinstance(t, Tensor)]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if not tensors or None in sizes or len(sizes) != 1:
        raise ValueError(
            f"fs.testing.check: every tensor of make_batch's (inputs, targets) must hold the "
            f"batch along dim 0 with one size, got sizes {sorted(map(str, sizes))}."
        )
    size = sizes.pop()
    assert size is not None  # checked above: every tensor holds the batch along dim 0
    bad = [w for w in worlds if size % w]
    if bad:
        raise ValueError(
            f"fs.testing.check: the global batch of {size} rows does not split evenly over "
            f"world sizes {bad}. Return a batch whose size every world size divides (e.g. "
            f"{math.lcm(*worlds)} rows), or pass other world_sizes."
        )
