"""Non-finite losses and gradients, decided by every rank together.

[Note: one decision for all ranks]
After a reduce-scatter a NaN that one rank's batch produced sits only in the shard of the
rank that owns its position, so ranks looking at their own shards disagree about whether a
step went wrong; a rank that skipped its update while the others applied theirs would leave
the replicas of a parameter different forever. So each rank computes one flag per leaf and
the flags cross the mesh in one collective: every rank then sees the same verdict and acts
alike (raise everywhere, or skip everywhere).

[Note: non-finite steps skipped by default]
A NaN in one rank's batch reaches every rank through the reduction, and one optimizer step
then writes it into every parameter on every rank. Nothing the user must remember to turn
on protects against that, so `value_and_grad` (and `reduce`) check by default
(`check_finite="skip"`): each rank flags its loss and each of its reduced gradient leaves
(after the reduction, so a sum that overflowed in a low-precision reduce dtype counts too),
and one all-gather of those few integers (on a CPU DDP mesh an all-reduce of every rank's
row: see [Note: the verdict's exchange on the host] in funcshard/comm/_host_rows.py),
issued as soon as the gradients exist (the host reads its result only when an optimizer
first asks), gives every rank every rank's flags: a `Verdict`, carried by the
`ShardedGrads` record. Every funcshard `Optimizer` reads it before it computes anything: a
non-finite step returns no updates and the optimizer state as it was, on every rank, with a
`NonFiniteWarning` naming the ranks and the first non-finite leaf; after
`MAX_CONSECUTIVE_SKIPS` skips in a row it raises `NonFiniteError` instead (a run that only
makes NaNs is broken, not unlucky). A loss that is not finite on a rank whose gradients are
all finite is how an empty batch looks (a mean over no elements is NaN, its gradient zero):
the warning says so, and the step is skipped too, since the mean over ranks would be wrong.

Why an all-gather of its own rather than a trailer on the step's last reduction: the
reductions are issued by autograd's backward, one unit at a time, so the last one is known
only after it has been issued, and a trailer element would change every gradient buffer's
layout (a copy of each full gradient, or padding in every shard). The all-gather moves
(leaves + 3) int64 per rank (the loss's flag and the collectives' trail besides; the CPU
DDP all-reduce twice that), after the step's last reduction; its cost is in
benchmarks/RESULTS.md. The flags cost one pass over the local gradient shards, and over a
gradient all-reduced alike on k ranks (DDP's buckets, HSDP's shards across replicas,
replicated parameters) each of them passes over its 1/k (see [Note: each copy checked once]
in funcshard/step/_check_parts.py): on the overhead matrix's DDP cell (8 ranks) that took
the check from 0.77 to 0.41 ms a step (2.7% to 1.6%). On the CPU one call asks whether any
element of the leaves is NaN or inf, and only then is each leaf looked at (see [Note: one
op asks whether anything is non-finite] in funcshard/step/_host_flags.py), and the rows are
built and exchanged on the host by the kind of collective the step's reductions use (an
all-reduce on DDP: see [Note: the verdict's exchange on the host] in
funcshard/comm/_host_rows.py); on a GPU (and when traced) every element is looked at on the
device, which spares a host sync.

[Note: a compiled step's skip is a masked update]
A step `fs.compile` traces cannot decide on the host without breaking its graph (and
`fullgraph=True` forbids the break). So, traced, the flags are computed on the device and
gathered by the same all-gather, now a node of the graph, and the verdict holds that node:
the first optimizer to read it computes the step as usual (without donating its state) and
then keeps, leaf by leaf, the new optimizer state where every flag is clear and the old one
where not (`torch.where` on a boolean tensor: no host read), and adds updates masked to
zero, so a skipped step leaves parameters and state as they were on every rank. It also
stores the gathered flags on its `Skips` (an attribute store dynamo replays after the
graph runs, the flags one more output of it); `fs.compile`'s wrapper reads them when the
call returns (`read_compiled_verdicts`) and warns, counts and raises as an eager step would
(off the CPU: it starts a copy to the host and reads it at the next call, so no step waits
on the device for its own flags). The cost over an unchecked compiled step: the flags, the
all-gather, and one select per state leaf, which the compiler fuses into the update.
Under plain torch.compile nothing would read the stored flags, so the optimizer reads them
where it is, eagerly, as "raise" does (one graph break). Steps traced by `fs.trace`
(make_fx) carry no verdict: their graph is run by the user, and no wrapper reads it.
Plain params dicts (single process) are checked only with "raise".
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as torch_pytree

from funcshard.comm import _collectives as collectives
from funcshard.comm import _exchange as exchange
from funcshard.comm import _host_rows as host_rows
from funcshard.comm import _process_groups as process_groups
from funcshard.comm import _trail as trail
from funcshard.core._groups import GroupView
from funcshard.core._state import LocalGrads, ShardedGrads
from funcshard.step import _check_parts as check_parts
from funcshard.step import _host_flags as host_flags
from funcshard.step import _usage as usage
from funcshard.step._verdict import Verdict as Verdict

POLICIES = ("skip", "raise", "off")
_WHAT = "<non-finite check>"  # the verdict's collective, as errors name it
MAX_CONSECUTIVE_SKIPS = 10  # then NonFiniteError: see [Note: non-finite steps skipped by default]


class NonFiniteError(FloatingPointError):
    """A loss or gradient held NaN or inf on some rank; raised on every rank alike."""

    on_every_rank = True  # the ranks stay in step (see [Note: a rank out of step])


class NonFiniteWarning(RuntimeWarning):
    """A step was skipped on every rank because a loss or gradient held NaN or inf."""


def policy(check_finite: bool | str, where: str) -> str:
    """The policy a `check_finite` argument names: "skip", "raise" or "off" (True is
    "raise" and False "off", as before there were policies)."""
    if check_finite is True or check_finite is False:
        return "raise" if check_finite else "off"
    if check_finite not in POLICIES:
        raise ValueError(
            f"funcshard.{where}: check_finite must be 'skip' (the default: a non-finite step "
            f"is skipped on every rank, with a warning), 'raise' (NonFiniteError on every "
            f"rank) or 'off', got {check_finite!r}."
        )
    return str(check_finite)


def issue(
    loss: Tensor | None,
    grads: ShardedGrads,
    across_replicas: bool = True,
    extra: Sequence[int] = (),
    alike: bool = True,
) -> Verdict | None:
    """Decide whether `loss` and `grads` are finite on every rank that reduced them
    together: the whole mesh, or the shard axis alone when the replicas were not reduced
    (`all_reduce=False`: HSDP accumulation, DiLoCo's inner steps, which must not talk
    across replicas). Traced by dynamo, a verdict to mask with (see [Note: a compiled
    step's skip is a masked update]); None under make_fx. Eagerly each rank checks its part
    of the gradients reduced alike on several ranks (`alike`: by funcshard's all-reduce;
    see [Note: each copy checked once] in funcshard/step/_check_parts.py)."""
    leaves = grads.leaves()
    mesh = grads.layout.mesh
    # one tensor tells: under make_fx or fake tensors all are fake, under dynamo it compiles
    first = loss if loss is not None else next((t for t in leaves if t is not None), None)
    if collectives.tracing(() if first is None else (first,)):
        if not torch.compiler.is_dynamo_compiling():
            return None  # make_fx (fs.trace): nothing would read the flags on the host
        flags = local_flags([None if loss is None else loss.detach(), *leaves], mesh.device)
        return _gathered(flags, grads, across_replicas, traced=True)
    cut = check_parts.parts(grads.layout, across_replicas, alike)
    checked = [loss, *cut.of(leaves)]  # (the loss is only read: no detach needed)
    # the collectives this rank issued since the last verdict: see [Note: the collectives'
    # trail] in funcshard/comm/_trail.py
    taken = trail.take(cut.trail_groups)
    # then the unused parameters' words (see [Note: unused parameters])
    words = grads.usage.words() if grads.usage is not None else []
    at = len(checked) + len(words)  # then the first step's stuck-at-zero words (see [Note:
    words = [*words, *extra]  # parameters stuck at zero] in funcshard/step/_zero_start.py)
    if mesh.device_type in (None, "cpu"):  # (eager: traced steps returned above) on the host
        values = [*host_flags.flags_on_host(checked), *words, *taken]
        verdict = _gathered(
            None, grads, across_replicas, trails=True, words=len(words), cut=cut, values=values
        )
    else:
        flags = local_flags([None if loss is None else loss.detach(), *checked[1:]], mesh.device)
        rest = torch.tensor([*words, *taken], dtype=torch.int64, device=mesh.device)
        flags = torch.cat([flags, rest])
        verdict = _gathered(flags, grads, across_replicas, trails=True, words=len(words), cut=cut)
    if grads.usage is not None:
        grads.usage.agree_by(verdict.values, verdict.width(), len(checked))
    verdict.extra = (at, len(extra))
    return verdict


def _gathered(
    flags: Tensor | None,
    grads: Any,
    across_replicas: bool,
    trails: bool = False,
    traced: bool = False,
    words: int = 0,
    cut: check_parts.Parts | None = None,
    values: list[int] | None = None,
) -> Verdict:
    """The verdict on every rank's `flags`, gathered over the ranks that reduced `grads`
    together (the shard axis alone without `across_replicas`). The collective is waited
    for here: a collective left in flight when the gradients are dropped unread would leave
    the ranks' exchanges out of step (on CUDA this waits on a stream, not the host; the
    host reads the flags only when they are asked for). Traced, it is one collective in
    the graph (see [Note: bookkeeping outside compiled graphs] in comm/_collectives.py).
    `cut`: the parts each rank checked (see [Note: each copy checked once]), whose names
    and ranks were worked out once. `values`: the eager CPU step's flags, words and trail
    as ints (instead of `flags`), exchanged on the host (see [Note: the verdict's exchange
    on the host] in funcshard/comm/_host_rows.py)."""
    mesh = grads.layout.mesh
    group = mesh.group if across_replicas else mesh.shard_group
    ranks = list(cut.ranks) if cut is not None else process_groups.group_ranks(group)
    if values is not None:
        all_reduce = host_rows.by_all_reduce(mesh.device_type, mesh.shard)
        every = host_rows.every_rank(values, group, by_all_reduce=all_reduce, what=_WHAT)
    else:
        assert flags is not None
        if mesh.device_type not in (None, "cpu"):
            flags = flags.to(mesh.device)
        every = collectives.all_gather(flags, group, what=_WHAT).wait()
        if exchange.backend_of(group) == "fake":  # (benchmarks: its collectives move no
            every = flags.expand(len(ranks), -1).reshape(-1)  # data: every rank is this one)
    scope = "every rank" if across_replicas else _SHARD_AXIS
    names = list(cut.names) if cut is not None else _names(grads)
    copies = cut.copies if cut is not None else ()
    return Verdict(
        every, names, ranks, trails=trails, scope=scope, traced=traced, words=words, copies=copies
    )


def judged(
    loss: Tensor | None,
    grads: Any,
    policy: str,
    across_replicas: bool,
    where: str,
    extra: Sequence[int] = (),
    alike: bool = True,
) -> Any:
    """`grads` after the check `policy` asks for (see `policy`): "raise" raises here when
    some rank's loss or gradients are not finite; "skip" gives sharded gradients their
    verdict (see `issue`: a graph node when dynamo traces, none under make_fx); "off"
    leaves them alone. Sharded gradients that track unused parameters have them agreed by
    the verdict's collective, or (with "off") by one of their own (see [Note: unused
    parameters] in funcshard/step/_usage.py). `extra` words ride the verdict (the first
    step's stuck-at-zero check, given only where a verdict is issued). `alike`: whether
    funcshard's own all-reduce reduced the buffers across replicas (`check_parts.alike`)."""
    sharded = isinstance(grads, ShardedGrads)
    tracked = sharded and grads.usage is not None
    if policy == "raise" and tracked:  # (eager: a traced step tracks nothing)
        verdict = issue(loss, grads, across_replicas, extra, alike)
        if verdict is not None:
            verdict.acted = True  # decided here: optimizers only follow
            if not verdict.finite():
                raise _nonfinite_error(verdict, where)
            return dataclasses.replace(grads, verdict=verdict)
    elif policy == "raise":
        check(loss, grads, where, across_replicas)
    elif policy == "skip" and sharded:
        verdict = issue(loss, grads, across_replicas, extra, alike)
        if verdict is not None:
            return dataclasses.replace(grads, verdict=verdict)
    elif tracked:
        mesh = grads.layout.mesh
        usage.agreed_alone(grads.usage, mesh.group if across_replicas else mesh.shard_group)
    return grads


_SHARD_AXIS = (
    "every rank of this replica's shard axis (each replica decides for itself: its "
    "gradients were not reduced across replicas)"
)


class Skips:
    """One optimizer's non-finite steps skipped in a row (reset by a finite one), and the
    flags its compiled steps left for the host to read (see [Note: a compiled step's skip
    is a masked update])."""

    def __init__(self) -> None:
        self.in_a_row = 0
        self.pending: Tensor | None = None  # set by a compiled step (dynamo replays the store)
        self.about: tuple = ()  # (names, ranks, scope) of the pending flags
        self._unread: list[tuple[Tensor, Any, tuple]] = []  # copied to the host, in order
        _EVERY_SKIPS.add(self)


_EVERY_SKIPS: weakref.WeakSet[Skips] = weakref.WeakSet()
_READ_AFTER_COMPILED_CALL = [False]  # inside `fs.compile`, which reads the flags after the call


@contextlib.contextmanager
def read_after_the_call() -> Iterator[None]:
    """The compiled call `fs.compile` runs inside this: its steps mask their skips and
    leave the flags for `read_compiled_verdicts`; under plain torch.compile, nothing would
    read them, so the optimizer reads them there, breaking the graph."""
    _READ_AFTER_COMPILED_CALL[0] = True
    try:
        yield
    finally:
        _READ_AFTER_COMPILED_CALL[0] = False


def claim(grads: Any) -> None:
    """Mark the gradients' verdict as decided on by a `skip_nonfinite` inside the optimizer
    being called (alone, or in a chain): the optimizers around it follow without a word."""
    verdict = getattr(grads, "verdict", None)
    if verdict is not None:
        verdict.acted = True


def skip_this_step(grads: Any, skips: Skips) -> bool | Tensor:
    """Whether an optimizer handed `grads` must leave the step out: the gradients' verdict
    says some rank's loss or gradients were not finite. The first optimizer to read a
    verdict acts on it: warns (every rank alike) and counts the skip in `skips`, raising
    NonFiniteError once too many steps in a row were; the ones it calls only follow.

    In a compiled step the answer is a boolean tensor, True where the step may go on: the
    first optimizer masks its results with it and the host reads the flags after the
    compiled call (`read_compiled_verdicts`); the ones it calls go on unmasked."""
    verdict = getattr(grads, "verdict", None)
    if verdict is None:
        return False
    if verdict.traced and _READ_AFTER_COMPILED_CALL[0]:
        if verdict.acted:
            return False
        verdict.acted = True
        skips.pending, skips.about = verdict._every, (verdict.names, verdict.ranks, verdict.scope)
        return verdict.ok()
    if verdict.acted:
        return not verdict.finite()
    verdict.acted = True
    return _skipped(verdict, skips, stacklevel=4)


def _skipped(verdict: Verdict, skips: Skips, stacklevel: int) -> bool:
    """Count a verdict in `skips`: False for a finite step; True, with a warning, for a
    non-finite one; NonFiniteError for one too many in a row."""
    if verdict.finite():
        skips.in_a_row = 0
        return False
    skips.in_a_row += 1
    if skips.in_a_row > MAX_CONSECUTIVE_SKIPS:
        skips.in_a_row = 0
        raise NonFiniteError(
            f"funcshard: {MAX_CONSECUTIVE_SKIPS + 1} steps in a row had NaN or inf, the last "
            f"in {verdict.problems()}. Raised on {verdict.scope}. Look at the data and the "
            f"learning rate; torch.autograd.set_detect_anomaly(True) finds the op that made "
            f"them; funcshard.optim.skip_nonfinite(...) skips without limit."
        )
    warnings.warn(
        f"funcshard: skipped this step on {verdict.scope} (parameters and optimizer state "
        f"unchanged; {skips.in_a_row} in a row, NonFiniteError after "
        f"{MAX_CONSECUTIVE_SKIPS}): NaN or inf in {verdict.problems()}. "
        f"value_and_grad(check_finite='raise') raises instead.",
        NonFiniteWarning,
        stacklevel=stacklevel,
    )
    return True


def masked(ok: Tensor, new: Any, old: Any) -> Any:
    """`new` where `ok`, else `old`: each tensor of two pytrees of one structure (a state,
    an optimizer state), chosen on the device without reading `ok`."""

    def choose(n: Any, o: Any) -> Any:
        if n is o:  # handed on unchanged (Adam's counts of skipped steps): nothing to pick
            return n
        if isinstance(n, Tensor) and isinstance(o, Tensor) and n.shape == o.shape:
            return torch.where(ok, n, o)
        return n

    return torch_pytree.tree_map(choose, new, old)


def masked_updates(ok: Tensor, updates: Any) -> Any:
    """`updates` where `ok`, else zero: a skipped step's updates move nothing."""
    return torch_pytree.tree_map(
        lambda u: torch.where(ok, u, torch.zeros_like(u)) if isinstance(u, Tensor) else u,
        updates,
    )


def read_compiled_verdicts(stacklevel: int = 3) -> None:
    """Act on the flags compiled steps left since the last call: warn, count, raise as an
    eager step would (see [Note: a compiled step's skip is a masked update]). Off the CPU
    the flags are copied without waiting and read once the copy is done (by a later
    call, at the latest the next)."""
    for skips in list(_EVERY_SKIPS):
        if skips.pending is not None:
            every = skips.pending
            if every.device.type == "cpu":
                skips._unread.append((every, None, skips.about))
            else:
                event = torch.cuda.Event() if every.device.type == "cuda" else None
                every = every.to("cpu", non_blocking=event is not None)
                if event is not None:
                    event.record()
                skips._unread.append((every, event, skips.about))
            skips.pending = None
        while skips._unread:
            every, event, (names, ranks, scope) = skips._unread[0]
            if event is not None and not event.query() and len(skips._unread) == 1:
                break  # read at the next call
            if event is not None:
                event.synchronize()
            skips._unread.pop(0)
            _skipped(Verdict(every, names, ranks, scope=scope), skips, stacklevel)


def local_flags(tensors: list[Tensor | None], device: torch.device | None = None) -> Tensor:
    """One int64 per tensor: 1 where it holds a NaN or inf (None counts as finite).

    On the CPU, one call asks whether anything is NaN or inf and only then is each tensor
    looked at (see [Note: one op asks whether anything is non-finite]); large finite values
    never count. Off the CPU and traced, every element is looked at, on the device (no
    host decision, no sync).
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    device = device or next((t.device for t in tensors if t is not None), torch.device("cpu"))
    exact = device.type != "cpu"  # no host decision off the CPU (a sync) nor when traced
    if exact or collectives.tracing([t for t in tensors if t is not None]):
        return torch.stack(
            [
                torch.zeros((), dtype=torch.bool, device=device)
                if t is None
                else t.detach().isfinite().all().logical_not().to(device)
                for t in tensors
            ]
        ).to(torch.int64)
    return torch.tensor(host_flags.flags_on_host(tensors), dtype=torch.int64, device=device)


def any_nonfinite(grads: Any) -> bool:
    """Whether any rank's gradients hold a NaN or inf: the same answer on every rank.

    Reads the gradients' verdict when they carry one; else communicates one all-reduce of
    a single integer over the whole mesh (none for a dict).
    """
    verdict = getattr(grads, "verdict", None)
    if verdict is not None:  # read, and acted on: the optimizers it wraps only follow
        verdict.acted = True
        return not verdict.finite()
    leaves = _leaves(grads)
    bad = local_flags(leaves).sum().reshape(1)
    if isinstance(grads, ShardedGrads | LocalGrads | GroupView):
        mesh = grads.layout.mesh
        bad = collectives.all_reduce(bad.to(mesh.device), mesh.group, "sum", what=_WHAT).wait()
    return bool(bad.item() > 0)


def check(
    loss: Tensor | None, grads: Any, where: str = "value_and_grad", across_replicas: bool = True
) -> None:
    """Raise NonFiniteError on every rank if any rank's loss or gradients are not finite.

    The message names the ranks whose loss was not finite and, per unit, the ranks whose
    gradient shards were not. Communicates: one all-gather of one flag per buffer.
    """
    flags = local_flags([None if loss is None else loss.detach(), *_leaves(grads)])
    if isinstance(grads, ShardedGrads | LocalGrads):
        # read once: under torch.compile, one collective in the graph and one break after it
        verdict = _gathered(flags, grads, across_replicas)
    else:
        verdict = Verdict(flags, _names(grads), [0])
    if verdict.finite():
        return
    raise _nonfinite_error(verdict, where)


def _nonfinite_error(verdict: Verdict, where: str) -> NonFiniteError:
    return NonFiniteError(
        f"funcshard.{where}(check_finite='raise'): NaN or inf in {verdict.problems()}. "
        f"Raised on {verdict.scope}. To skip such steps instead, leave check_finite at its "
        f"default ('skip'); to find the op that made them, run with "
        f"torch.autograd.set_detect_anomaly(True)."
    )


def _names(grads: Any) -> list[str]:
    if isinstance(grads, ShardedGrads):
        return [f"unit {f.unit or '<root>'!r}" for f in grads.layout.flats] + [
            repr(f) for f in grads.layout.replicated
        ]
    if isinstance(grads, LocalGrads):  # the local ones, then those reduced already
        shards = [f"unit {f.unit or '<root>'!r}" for f in grads.layout.flats if grads.shards]
        return [*grads.grads, *shards, *map(repr, grads.replicated)]
    return list(grads)


def _leaves(grads: Any) -> list[Tensor | None]:
    if isinstance(grads, ShardedGrads | GroupView):
        return grads.leaves()
    if isinstance(grads, LocalGrads):
        return [*grads.grads.values(), *grads.shards, *grads.replicated.values()]
    return list(grads.values())
