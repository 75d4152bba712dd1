"""One training step run on the meta device, counting the bytes alive at every op.

[Note: dry run]
`funcshard.estimate(..., model=, loss_fn=, args=)` needs the memory a step's activations
take, which depends on the model's code and the batch, not on its plan. So it runs the step
once on meta tensors (no memory, no process group) while a dispatch mode counts the bytes of
every tensor alive after each op, as `funcshard.testing.memory.LiveTensors` does on a real
device. Only the communication is left out; the parameters live as they do in
`funcshard.call` on a sharded state (see [Note: per-unit gathering] and [Note: resharding
after forward]):

- each rank's shards, the replicated parameters, the buffers and the optimizer state are
  allocated first and held throughout (the state the caller keeps);
- a unit's flat buffers are allocated (instead of all-gathered) when its module starts, and
  the next unit's when the prefetch would issue them; the root and other whole-call units at
  the start of the call. A unit's buffers are dropped when its module returns, and autograd
  keeps handles instead of their views (saved-tensor hooks); the first unpack in backward
  allocates them again, with the prefetch of the unit that ran before it;
- each unit's gradients come back from autograd one per parameter (a tied weight's partial
  gradients summed as autograd sums them), are concatenated into one full flat gradient,
  cast to the reduce dtype and reduced into a new shard-size tensor; issuing a reduce drops
  the previous reduce's input (one reduce in flight, as
  `funcshard.step._deferred_reduce._Throttle` keeps);
- the optimizer's `update` and `apply_updates` (or `step`, donating) run on the meta shards,
  as the ShardedState and ShardedGrads a step passes (see [Note: the optimizer on a meta
  state] in funcshard/planning/_meta_state.py), and what the caller's variables stop
  holding is dropped where they would drop it (in a loop, the previous step's gradients and
  updates; see `carried`).

`funcshard.planning._meta_step.MetaStep` does the parameters' part, `funcshard.planning._metabytes`
the counting, `funcshard.planning._attention_kernels` the attention kernel the target device would
run (see [Note: attention kernels without the device]: a GPU is planned for without one), and
`funcshard.planning._meta_predicates` the answers of a plain batch to the model's `all`/`any` checks
(see [Note: a plain batch's answers]).

[Note: recomputation in the dry run]
Activation checkpointing keeps a checkpointed region's inputs instead of its saved tensors
and runs the region again in backward. In the dry run the forward needs nothing new: torch's
checkpoint pushes its own saved-tensor hooks inside the region, so the region's saved
tensors (the unit's parameter views included) never reach `MetaStep.pack` and are dropped
with forward, while the gather nodes stay in the graph and reduce as usual. In backward the
recomputation runs the region's modules again after the model's call returned, when their
slots hold placeholders. So while autograd runs, a global module pre-hook (the mirror of
`funcshard.core._recompute.recomputing` and `call_recomputation.Recomputation`) puts the units
owning parameters under a recomputed module back: its buffers regathered (allocated, with the
prefetch of the unit before it) if they were resharded, as fresh leaves that require grad as
forward's parameters did, so that autograd saves the same tensors; they come out when the
module's forward ends. The recomputed tensors then live until the unit's backward consumes
them, which MetaBytes counts as it counts forward's. This covers every checkpoint that
recomputes inside the outer backward: `torch.utils.checkpoint(..., use_reentrant=False)`
(around a module's `__call__` or a function calling `fs.call`), torch's `checkpoint_wrapper`
(non-reentrant by default) and transformers 5's `activation_checkpointing_enable` and its
deprecated alias `gradient_checkpointing_enable` (non-reentrant by default; they wrap each
layer's `forward`, so the layer's own hooks run once, outside the region, and only its
submodules start again). `use_reentrant=True` recomputes in a backward of its own, which
torch refuses under `torch.autograd.grad` (what `funcshard.value_and_grad` and the dry run
differentiate with), naming the fix, use_reentrant=False: such a step cannot run, so it is
not planned either.

What it cannot see: allocator caching and fragmentation (CUDA reserves more than it
allocates), buffers inside the collective libraries, and kernels whose device version
allocates other intermediates than the meta version describes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch import Tensor, nn

from funcshard.core._binding import bind, restore_snapshot, snapshot_slots
from funcshard.core._layout import Layout
from funcshard.core._precision import MixedPrecision
from funcshard.core._state import ShardedState
from funcshard.optim._base import Optimizer
from funcshard.optim._params import apply_updates
from funcshard.planning._attention_kernels import DeviceKernels, Target
from funcshard.planning._meta_predicates import PlainBatch
from funcshard.planning._meta_state import grads_like, meta_state
from funcshard.planning._meta_step import MetaStep
from funcshard.planning._metabytes import MetaBytes


@dataclass(frozen=True)
class Phases:
    """The most bytes alive at once in each phase of a step, held state included."""

    forward: int
    backward: int
    optimizer: int


@dataclass(frozen=True)
class StepSpec:
    """What one dry-run step runs: the loss function and its arguments after the state, the
    optimizer, and the options of `funcshard.shard` that change what is alive."""

    loss_fn: Callable[..., Tensor]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    optimizer: Optimizer
    donate: bool  # Optimizer.step (in place) instead of update + apply_updates
    mp: MixedPrecision | None
    reshard_after_forward: bool | int
    prefetch: bool
    loop: bool  # the previous step's gradients (and updates) are alive: see `carried`
    target: Target  # the device whose attention kernels the step would run


def run_step(
    model: nn.Module, layout: Layout, replicate: int, shard: int, spec: StepSpec
) -> Phases:
    """Run one step of `spec` on meta tensors; the most bytes alive in each phase."""
    binding = bind(model, layout)
    originals = snapshot_slots(binding)
    args, kwargs = _to_meta((spec.args, dict(spec.kwargs)))  # the batch is not counted
    placeholders = _placeholders(layout)
    try:
        with MetaBytes() as live:
            step = MetaStep(
                binding, layout, (replicate, shard), spec.mp, spec.reshard_after_forward,
                spec.prefetch,
            )  # fmt: skip
            params = {**placeholders, **step.replicated}
            state = meta_state(
                layout, (replicate, shard), [t.detach() for t in step.shards],
                {f: t.detach() for f, t in step.replicated.items()}, spec.mp,
            )  # fmt: skip
            held = carried(state, spec.optimizer, spec.donate, spec.loop)
            handles = step.install_hooks(model)
            try:
                with (
                    torch.autograd.graph.saved_tensors_hooks(step.pack, step.unpack),
                    _modes(spec.target),
                ):
                    loss = spec.loss_fn(params, *args, **kwargs)
            except Exception as e:
                if str(e).startswith("funcshard."):  # the dry run's own, with its fix
                    raise
                raise ValueError(
                    f"funcshard.estimate: loss_fn failed on the meta device, where the dry "
                    f"run calls it with meta parameters and a meta batch: {type(e).__name__}: "
                    f"{e}. A loss function that reads values (.item(), printing, data-"
                    f"dependent branches) cannot run there; estimate without loss_fn, or "
                    f"move such code out of it."
                ) from e
            finally:
                for handle in handles:
                    handle.remove()
            loss = _scalar(loss)
            forward = live.restart_peak()
            with step.recomputing(model, functools.partial(_modes, spec.target)):
                grads = torch.autograd.grad(loss, step.leaves(), allow_unused=True)
            del loss
            step.finish()
            held["grads"] = grads_like(  # `loss, grads = ...` drops the previous step's
                state,
                [  # an unused parameter's: zero
                    torch.zeros_like(p) if g is None else g
                    for p, g in zip(step.leaves(), grads, strict=True)
                ],
            )
            del grads, state
            backward = live.restart_peak()
            optimizer = optimizer_phase(live, held, spec.optimizer, spec.donate, spec.loop)
    finally:
        restore_snapshot(originals)
    return Phases(forward, backward, optimizer)


def carried(params: ShardedState, optimizer: Optimizer, donate: bool, loop: bool) -> dict[str, Any]:
    """What is alive when a step starts: the parameters and the optimizer state, and in a
    loop the previous step's gradients and updates, which the loop's variables hold until
    this step returns new ones (`Optimizer.step` donates the gradients: they are gone).
    `params` is a meta state (see [Note: the optimizer on a meta state])."""
    held: dict[str, Any] = {"params": params, "opt_state": optimizer.init(params)}
    if loop and not donate:
        held["grads"] = grads_like(params)
        held["updates"] = grads_like(params)
    return held


def optimizer_phase(
    live: MetaBytes, held: dict[str, Any], optimizer: Optimizer, donate: bool, loop: bool
) -> int:
    """The optimizer's update, dropping what the caller's variables stop holding: a step
    function's caller keeps the old state and optimizer state until it returns; a loop
    (`updates, opt_state = opt.update(...)`, then `state = fs.apply_updates(state,
    updates)`) drops the old optimizer state and updates when `update` returns."""
    params, grads = held.pop("params"), held.pop("grads")
    if donate:
        optimizer.step(grads, held.pop("opt_state"), params)  # in place
        return live.restart_peak()
    updates, new_state = optimizer.update(grads, held["opt_state"], params)
    if loop:
        held.pop("updates", None)
        held.pop("opt_state")
    new_params = apply_updates(params, updates)
    del updates, new_state, new_params
    return live.restart_peak()


@contextlib.contextmanager
def _modes(target: Target) -> Iterator[None]:
    """What the step's code runs under: the target's attention kernels, a plain batch's
    answers."""
    with DeviceKernels(target), PlainBatch():
        yield


def _placeholders(layout: Layout) -> dict[str, Tensor]:
    """What the loss function gets for the sharded parameters: a dict FQN -> meta tensor
    (`funcshard.call` takes a dict as it takes a state); the hooks put the gathered
    parameters in place when each unit runs. Made before counting starts: they stand for
    nothing a rank holds."""
    return {
        fqn: torch.empty(shape, dtype=flat.dtype, device="meta")
        for flat in layout.flats
        for fqn, shape in zip(flat.fqns, flat.shapes, strict=True)
    }


def _scalar(loss: Any) -> Tensor:
    if isinstance(loss, tuple | list) and loss:
        loss = loss[0]  # (loss, aux)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(
            f"funcshard.estimate: loss_fn must return a scalar tensor (or a tuple whose first "
            f"element is one), got {type(loss).__name__}. Pass the function you give "
            f"funcshard.value_and_grad."
        )
    return loss


def _to_meta(tree: Any) -> Any:
    return optree.tree_map(
        lambda x: x.to("meta") if isinstance(x, Tensor) else x, tree, none_is_leaf=True
    )
