"""Memory and communication of a plan on a mesh, per rank, without allocating anything.

    est = fs.estimate(plan, fs.Mesh(shard=8))           # a Mesh, a world size, or (R, S)
    est = fs.estimate(plan, 8, model=model, loss_fn=loss_fn, args=(x, y))  # + activations
    est.peak, est.peak_phase, est.phases, print(est.table())

[Note: what the estimate counts]
Per unit and rank, by arithmetic on the plan: the parameter shard (in the parameter dtype,
padded to the shard size), its gradient shard, the optimizer state (what `optimizer.init`
makes for the unit's shards on a meta state: AdamW's two moments by default), the full unit
while gathered (in the mixed-precision param dtype), its full gradient, and the bytes the
rank sends per step with ring collectives: an all-gather or reduce-scatter over S ranks
sends (S - 1) shards, an all-reduce over R replicas 2 (R - 1) / R of the shard. An owned
unit on device="cpu" (gloo) sends no padding in its all-gathers and reduce-scatters, and
each rank a different amount (see [Note: the uneven exchange] in
funcshard/comm/_exchange.py): for those the estimate counts the mean over the shard axis's
ranks, (S - 1) / S of the unpadded buffer per collective; its most loaded rank sends more
in gathers and less in reduce-scatters. On "cuda" (NCCL) they send the padded shards.

`peak` is the most bytes alive at once during one training step, in whichever phase holds
it (forward, backward, or the optimizer's update). Besides the shards, gradient shards and
optimizer state, it counts what the step makes on the way:
- gathered units: the root (and any unit whose parameters are used outside its module) for
  the whole call, each other unit while its module runs and the next one prefetched; in
  backward each is gathered again, with the one that ran before it. Resharding, the root
  lives on in backward only as long as what autograd saved of it (see [Note: whole-call
  units in backward] in funcshard/step/_regather.py): the dry run follows that; the walk
  by arithmetic takes a language model's case, the output head (read first) its last
  reader, and drops it once backward reaches the last unit;
- each unit's full gradient: autograd's per-parameter gradients, their concatenation into
  one flat buffer (and its cast to the reduce dtype) and the reduce's shard-size output,
  while the previous unit's reduce is in flight. The root's gradient lives from the output
  head's backward to the embedding's; with a tied embedding its two partial gradients and
  their sum are alive at once, so the end of backward holds the root three to four times
  over (this was missing: the planner's peak was 21% under a measured step);
- the optimizer's update: its own `update` and `apply_updates` (or `step`), run on a
  `ShardedState` of meta shards whose mesh's collectives only allocate their results (see
  [Note: the optimizer on a meta state] in funcshard/planning/_meta_state.py), so what any
  optimizer makes is counted as it makes it: without `donate`, AdamW's new moments and
  updates, then the new parameters while the old ones are held (8x the parameter shards);
  a decay mask, `partition`'s packed groups, `whole_params`' exchanges with the owners,
  clipping's norm; `donate=True` (`opt.step`) updates in place;
- with `loop=True` (the default: README's training loop), the previous step's gradients
  and updates, which the loop's variables hold until this step returns new ones (unless
  `opt.step` donated them);
- given the step (`model`, `loss_fn`, `args`), the activations and whatever else the
  step's code allocates, by running it once on the meta device (see [Note: dry run] in
  funcshard/planning/_dryrun.py). Without it backward is walked unit by unit by arithmetic and
  activations are left out (the table says so).

A `funcshard.replicate` state is the same step on a mesh whose shard axis is 1, in DDP's
buckets: `replicate=True` (see [Note: estimating a replicate state] in
funcshard/planning/_replicas.py).

Not counted: the batch itself, allocator caching and fragmentation, buffers inside the
collective libraries. With the step given, the peak of the three models of
benchmarks/estimate.py is within 0.2% of what `funcshard.testing.memory.LiveTensors`
counts in a real 2-rank step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from tabulate import tabulate
from torch import Tensor, nn

from funcshard.comm import _host_rows as host_rows
from funcshard.comm._mesh import Mesh
from funcshard.core._binding import bind
from funcshard.core._layout import Layout, layout_of
from funcshard.core._plan import Plan
from funcshard.core._precision import MixedPrecision, gather_dtype, reduce_dtype
from funcshard.optim._base import Optimizer
from funcshard.optim._kernels import adamw
from funcshard.planning import _dryrun as dryrun
from funcshard.planning import _meta_state as meta_state
from funcshard.planning import _replicas
from funcshard.planning._attention_kernels import Target
from funcshard.planning._dryrun import Phases
from funcshard.planning._metabytes import MetaBytes
from funcshard.step import _usage as usage


def format_bytes(n: int | float) -> str:
    """`n` bytes in B, KiB, MiB or GiB with three or so significant digits: `512 B`,
    `40.0 KiB`, `0.98 MiB`, `1.52 MiB`, `150 MiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale * 1000 / 1024:  # 1,000 KiB reads better as 0.98 MiB
            v = n / scale
            digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
            return f"{v:,.{digits}f} {unit}"
    return f"{n:,.0f} B"


@dataclass(frozen=True)
class UnitEstimate:
    """Bytes per rank for one unit."""

    name: str
    params: int  # the parameter shard
    grads: int  # the gradient shard (0 for a frozen unit)
    optimizer: int  # the optimizer state of the shard
    gathered: int  # the full unit, in the gather dtype
    sent_per_step: int
    full_grad: int = 0  # the full gradient before its reduce, in the compute dtype
    reduced_copy: int = 0  # the full gradient cast to the reduce dtype, if that differs
    in_flight: int = 0  # the reduce's input while it is in flight
    chunk: int = 0  # the reduce's output, in the reduce dtype
    placement: str = "even"  # as its layout records it (see [Note: owned placement])


@dataclass(frozen=True)
class Estimate:
    """Per-unit bytes and the peak per phase a rank needs for one training step."""

    units: tuple[UnitEstimate, ...]
    replicate: int
    shard: int
    phases: Phases = field(default_factory=lambda: Phases(0, 0, 0))
    activations: bool = False  # whether a dry run of the step counted them
    checks: int = 0  # bytes the step's own checks send (the non-finite verdict's)

    @property
    def persistent(self) -> int:
        """Parameters, gradients and optimizer state held for the whole step."""
        return sum(u.params + u.grads + u.optimizer for u in self.units)

    @property
    def gathered_peak(self) -> int:
        """The root gathered all step, plus the two largest other units (running + prefetched)."""
        root = sum(u.gathered for u in self.units if u.name == "")
        others = sorted((u.gathered for u in self.units if u.name != ""), reverse=True)
        return root + sum(others[:2])

    @property
    def sent_per_step(self) -> int:
        return sum(u.sent_per_step for u in self.units) + self.checks

    @property
    def peak(self) -> int:
        """The most bytes alive at once during the step, per rank."""
        return max(self.phases.forward, self.phases.backward, self.phases.optimizer)

    @property
    def peak_phase(self) -> str:
        """Which phase the peak is in: "forward", "backward" or "optimizer"."""
        values = {n: getattr(self.phases, n) for n in ("forward", "backward", "optimizer")}
        return max(values, key=values.__getitem__)

    def table(self, max_rows: int = 12) -> str:
        """One row per unit (the first and last few past `max_rows`), then the totals; a
        placement column where some unit is not "even"."""
        placed = any(u.placement != "even" for u in self.units)
        rows = [
            [u.name or "<root>"]
            + ([u.placement] if placed else [])
            + [format_bytes(v) for v in (u.params, u.grads, u.optimizer, u.gathered)]
            + [format_bytes(u.full_grad), format_bytes(u.sent_per_step)]
            for u in self.units
        ]
        headers = ["unit", *(["placement"] if placed else []), "params", "grads", "optimizer"]
        headers += ["gathered", "full grad", "sent/step"]
        if len(rows) > max_rows:
            gap = ["..."] + [""] * (len(headers) - 1)
            rows = [*rows[: max_rows // 2 - 1], gap, *rows[-(max_rows // 2) :]]
        what = (
            "activations included (a dry run of the step on the meta device)"
            if self.activations
            else "activations not included (give the step to count them: model=, "
            "loss_fn=, args= in Python, --tokens to `funcshard plan`)"
        )
        lines = [
            tabulate(rows, headers=headers, colalign=("left",) * (1 + placed) + ("right",) * 6),
            f"per rank: {format_bytes(self.persistent)} held (params + grads + optimizer "
            f"state), {format_bytes(self.sent_per_step)} sent per step",
            f"peak: {format_bytes(self.peak)} in {self.peak_phase} (forward "
            f"{format_bytes(self.phases.forward)}, backward {format_bytes(self.phases.backward)}"
            f", optimizer {format_bytes(self.phases.optimizer)}); {what}",
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def estimate(
    plan: Plan | None,
    mesh: Mesh | int | tuple[int, int],
    shard: int | None = None,
    param_dtype: torch.dtype | None = None,
    *,
    mp: MixedPrecision | None = None,
    model: nn.Module | None = None,
    loss_fn: Callable[..., Tensor] | None = None,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    optimizer: Optimizer | None = None,
    donate: bool = False,
    reshard_after_forward: bool | int = True,
    prefetch: bool = True,
    loop: bool = True,
    device: str | None = None,
    capability: tuple[int, int] = (9, 0),
    attention: str | None = None,
    replicate: bool = False,
) -> Estimate:
    """Estimate one training step of `plan` on a mesh, per rank (see [Note: what the
    estimate counts]).

    Args:
        plan: from `funcshard.plan`; None with `replicate=True` (see there).
        mesh: a `Mesh`, a world size (sharded over every rank), or `(replicate, shard)`.
            `estimate(plan, replicate, shard, param_dtype)` is the older spelling.
        mp: the `MixedPrecision` the state is sharded with.
        model: with `loss_fn`, `args` and `kwargs`, the step, to count activations:
            `loss_fn(params, *args, **kwargs)` is the function given to
            `funcshard.value_and_grad` (it calls `funcshard.call(model, params, ...)`, which
            takes the dict of meta parameters the dry run passes as it takes a state).
            Without them, activations are not counted. `model` alone tells which units stay
            gathered for the whole call.
        loss_fn: the step's loss function (see `model`).
        args: its positional arguments after `params` (see `model`).
        kwargs: its keyword arguments (see `model`).
        optimizer: a `funcshard.optim` optimizer or your own (default AdamW); its `init`
            and `update` run on a meta state, so what it keeps and makes is counted as it
            does it. `donate=True` if the step uses `optimizer.step` (in place) rather than
            `update` and `apply_updates`.
        reshard_after_forward: as given to `funcshard.shard`.
        prefetch: as given to `funcshard.value_and_grad`.
        loop: the step runs in a loop like README's (`loss, grads = ...` and `updates,
            opt_state = opt.update(...)` rebind their variables only when the next step
            returns), so without `donate` the previous step's gradients and updates are
            alive during forward and backward. `loop=False`: a step function
            `state, opt_state = step(state, opt_state, batch)` whose caller holds nothing
            else.
        device: the device type the step will run on ("cuda" or "cpu"), on any machine:
            no GPU is needed to plan for one. The dry run follows that device's attention
            kernels (see [Note: attention kernels without the device] in
            funcshard/planning/_attention_kernels.py); default cuda where available, else cpu.
            On "cpu" (gloo) owned units' gathers and reduce-scatters send no padding,
            counted as the ranks' mean (see [Note: what the estimate counts]).
        capability: the GPU assumed for device="cuda", as (major, minor): (9, 0) is sm90
            (H100, H200), (8, 0) an A100, (10, 0) a B200. Decides which attention kernels
            can run.
        attention: "flash", "efficient", "cudnn" or "math" to name the attention kernel
            instead of torch's choice (None).
        replicate: the state is `funcshard.replicate(model, mesh)`'s (DDP): every rank
            holds every parameter, in `replicate`'s gradient buckets of `model` (with
            `plan=None`; or pass a plan of buckets, `fs.plan(model, policy=
            fs.policy.buckets(...))`), not resharded after forward. `mesh` is then the
            number of replicas, or a Mesh or (replicate, shard) whose shard axis is 1:
            `estimate(None, 2, replicate=True, model=model, loss_fn=..., args=...)`.
            See [Note: estimating a replicate state] in funcshard/planning/_replicas.py.

    Communicates: nothing; nothing is allocated (the dry run uses the meta device).
    """
    if replicate:
        plan, mesh = _replicas.replicated(plan, mesh, model)
        reshard_after_forward = False
    elif not isinstance(plan, Plan):
        raise TypeError(
            f"funcshard.estimate: plan must be a funcshard.Plan (or None with "
            f"replicate=True, for funcshard.replicate's state), got {type(plan).__name__}."
        )
    replicas, shard = _sizes(mesh, shard)
    if param_dtype is not None:
        if mp is not None:
            raise ValueError("funcshard.estimate: pass mp= or param_dtype, not both.")
        mp = MixedPrecision(param_dtype=param_dtype)
    if loss_fn is not None and model is None:
        raise ValueError(
            "funcshard.estimate: loss_fn needs the model it calls (model=...), whose modules "
            "the dry run watches to gather each unit when it runs."
        )
    target = Target(device or _default_device(), capability, attention)  # checks them
    optimizer = optimizer if optimizer is not None else adamw(1e-3)
    layout = _layout(plan, shard)
    names = _names(plan)
    last = next((n for n in reversed(names) if n), None)  # forward's last unit: not regathered
    uneven = target.device == "cpu"  # gloo: owned units send no padding
    units = tuple(
        _unit(layout, name, replicas, shard, mp, optimizer, name not in ("", last), uneven)
        for name in names
    )
    if loss_fn is not None:
        spec = dryrun.StepSpec(
            loss_fn, tuple(args), dict(kwargs or {}), optimizer, donate, mp,
            reshard_after_forward, prefetch, loop, target,
        )  # fmt: skip
        assert model is not None  # checked above: loss_fn needs the model
        phases = dryrun.run_step(model, layout, replicas, shard, spec)
        checks = _checks(layout, replicas, shard, target.device)
        return Estimate(units, replicas, shard, phases, True, checks)
    whole = bind(model, layout).whole_call if model is not None else None
    names = _names(plan)
    whole_units = {names[i] for i in whole} if whole is not None else {""}
    copies = shard > 1 or any(gather_dtype(mp, f) != f.dtype for f in layout.flats)
    phases = _walk(
        units, whole_units, layout, optimizer, donate, loop,
        reshard=reshard_after_forward is not False and copies, prefetch=prefetch,
        copies=copies, sizes=(replicas, shard),
    )  # fmt: skip
    checks = _checks(layout, replicas, shard, target.device)
    return Estimate(units, replicas, shard, phases, checks=checks)


def _checks(layout: Any, replicate: int, shard: int, device: str) -> int:
    """What the default non-finite verdict sends per rank: its flags (one per buffer and
    replicated parameter, the loss's, the collectives' trail: int64) and the unused
    parameters' words to every other rank (see [Note: non-finite steps skipped by default]
    in funcshard/step/_finite.py, [Note: unused parameters] in funcshard/step/_usage.py);
    twice that on a CPU DDP mesh, whose verdict is an all-reduce of every rank's row (see
    [Note: the verdict's exchange on the host] in funcshard/comm/_host_rows.py)."""
    words = len(usage.words_of(layout, frozenset()))
    flags = len(layout.flats) + len(layout.replicated) + 3 + words
    all_reduce = host_rows.by_all_reduce(device, shard)
    return flags * 8 * (replicate * shard - 1) * (2 if all_reduce else 1)


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _sizes(mesh: Mesh | int | tuple[int, int], shard: int | None) -> tuple[int, int]:
    if isinstance(mesh, Mesh):
        sizes = (mesh.replicate_size, mesh.shard_size)
    elif isinstance(mesh, int) and not isinstance(mesh, bool):
        sizes = (mesh, shard) if shard is not None else (1, mesh)
    elif isinstance(mesh, tuple) and len(mesh) == 2:
        sizes = mesh
    else:
        raise TypeError(
            f"funcshard.estimate: mesh must be a Mesh, a world size or (replicate, shard), "
            f"got {mesh!r}."
        )
    if not all(isinstance(s, int) and s >= 1 for s in sizes):
        raise ValueError(f"funcshard.estimate: mesh sizes must be positive ints, got {sizes}.")
    return sizes


def _names(plan: Plan) -> tuple[str, ...]:
    return tuple(u.name for u in plan.units)


def _layout(plan: Plan, shard: int) -> Layout:
    """The flat buffers of `plan` over `shard` ranks (a Layout without a mesh: nothing here
    communicates)."""
    return layout_of(plan, None, shard)


def _unit(
    layout: Layout,
    name: str,
    replicate: int,
    shard: int,
    mp: MixedPrecision | None,
    optimizer: Optimizer,
    regathered: bool = True,
    uneven: bool = False,
) -> UnitEstimate:
    """One unit's bytes per rank (see [Note: what the estimate counts]); `uneven`: an owned
    buffer's exchanges send no padding (gloo)."""
    flats = [f for f in layout.flats if f.unit == name]
    params = grads = gathered = sent = full_grad = reduced_copy = in_flight = chunk = 0
    for flat in flats:
        cast = gather_dtype(mp, flat) != reduce_dtype(mp, flat)  # a copy before the reduce
        compute, reduced = gather_dtype(mp, flat).itemsize, reduce_dtype(mp, flat).itemsize
        params += flat.shard_numel * flat.dtype.itemsize
        gathered += flat.padded_numel * compute
        gathers = 2 if regathered else 1  # the root and forward's last unit: once
        # the ranks' mean, over the unpadded buffer where the exchange is uneven
        exchanged = flat.numel if uneven and flat.loads else flat.padded_numel
        sent += gathers * (shard - 1) * exchanged * compute // shard
        if flat.frozen:
            continue
        grads += flat.shard_numel * flat.dtype.itemsize
        full_grad += flat.padded_numel * compute
        reduced_copy += flat.padded_numel * reduced if cast else 0
        in_flight += flat.padded_numel * reduced
        chunk += flat.shard_numel * reduced
        sent += (shard - 1) * exchanged * reduced // shard  # reduce-scatter
        sent += 2 * (replicate - 1) * flat.shard_numel * reduced // replicate  # all-reduce
    state = _optimizer_state_bytes(layout, name, (replicate, shard), optimizer)
    placement = "owned" if any(f.placement == "owned" for f in flats) else "even"
    return UnitEstimate(
        name,
        params,
        grads,
        state,
        gathered,
        sent,
        full_grad,
        reduced_copy,
        in_flight,
        chunk,
        placement,
    )


def _optimizer_state_bytes(
    layout: Layout, name: str, sizes: tuple[int, int], optimizer: Optimizer
) -> int:
    """What `optimizer.init` makes for unit `name`'s shards, on a meta state of that unit
    alone (see [Note: the optimizer on a meta state])."""
    flats = tuple(f for f in layout.flats if f.unit == name)
    if all(f.frozen for f in flats):
        return 0
    state = meta_state.plan_state(dataclasses.replace(layout, flats=flats), sizes)
    leaves = optree.tree_leaves(optimizer.init(state))
    return sum(
        t.numel() * t.element_size()
        for t in leaves
        if isinstance(t, Tensor) and t.device.type == "meta"
    )


def _walk(
    units: tuple[UnitEstimate, ...],
    whole: set[str],
    layout: Layout,
    optimizer: Optimizer,
    donate: bool,
    loop: bool,
    reshard: bool,
    prefetch: bool,
    copies: bool,
    sizes: tuple[int, int],
) -> Phases:
    """Each phase's peak by arithmetic, unit by unit, in the order a step runs them (the
    mechanism of [Note: dry run] without the model's own tensors)."""
    shard = sizes[1]
    held = sum(u.params + u.optimizer for u in units)
    if loop and not donate:  # the previous step's gradients and updates (see `carried`)
        held += 2 * sum(u.grads for u in units)
    gathered = {u.name: u.gathered if copies else 0 for u in units}
    w = sum(gathered[n] for n in whole)
    sharded = [u for u in units if u.name not in whole]
    forward = held + w
    for i, u in enumerate(sharded):
        nxt = gathered[sharded[i + 1].name] if prefetch and i + 1 < len(sharded) else 0
        kept = 0 if reshard else sum(gathered[v.name] for v in sharded[:i])
        forward = max(forward, held + w + kept + gathered[u.name] + nxt)
    # backward: the whole-call units' gradients (an output head's) are taken to live from
    # its start; each other unit is regathered, computes its gradient, and is reduced
    pending = sum(u.full_grad for u in units if u.name in whole)
    kept = 0 if reshard else sum(gathered[u.name] for u in sharded)
    done = flight = 0
    backward = held + w + kept + pending
    order = [*reversed(sharded), *(u for u in units if u.name in whole)]
    root = 0 if reshard else w  # read last by the output head: see the Note
    for i, u in enumerate(order):
        earlier = order[i + 1] if i + 1 < len(order) and order[i + 1].name not in whole else None
        pre = gathered[earlier.name] if reshard and prefetch and earlier is not None else 0
        mine = u.name not in whole
        own = gathered[u.name] if reshard and mine else 0
        grads = u.full_grad if mine else 0  # a whole-call unit's are in `pending`
        base = held + root + kept + pending + done + pre + grads
        cat = u.full_grad + u.reduced_copy
        out = u.chunk if shard > 1 else 0
        backward = max(backward, base + flight + own, base + cat + max(flight, out))
        if u.grads:  # the reduce is in flight until the next one is issued
            done += u.chunk if shard > 1 else u.in_flight
            flight = u.in_flight if shard > 1 else 0
        if not mine:
            pending -= u.full_grad
    return Phases(forward, backward, _optimizer_phase(layout, sizes, optimizer, donate, loop))


def _optimizer_phase(
    layout: Layout, sizes: tuple[int, int], optimizer: Optimizer, donate: bool, loop: bool
) -> int:
    """The optimizer phase's peak, run on a meta state (see `dryrun.optimizer_phase`)."""
    with MetaBytes() as live:
        state = meta_state.plan_state(layout, sizes)
        held = dryrun.carried(state, optimizer, donate, loop)
        held["grads"] = meta_state.grads_like(state)
        del state
        live.restart_peak()  # the previous step's gradients were dropped in backward
        return dryrun.optimizer_phase(live, held, optimizer, donate, loop)
