"""Resharding after forward: autograd keeps handles instead of gathered parameters, and
backward regathers each unit when it first needs it.

[Note: resharding after forward]
While a sharded call runs, `saved_tensors_hooks` replaces every tensor autograd saves from a
gathered buffer with a small `_Handle` (unit, buffer, view geometry), so the buffer itself
can be dropped when its unit's module returns. In backward the first unpack of a unit
regathers it, from the whole shard group or, with `reshard_after_forward=k`, from the 1/k
slice each rank kept over groups of k ranks, and issues the regather of the unit that ran
before it in forward (a prefetch); the unit that ran last in forward keeps its buffers
(`forward_done`), since backward needs it first. The regathered buffers are dropped when
the backward of the unit's gather nodes starts (each gather calls the callback `on_backward`
gave it, cheaper than a node pre-hook): by then the unit's backward is done, and the
gather's backward reads no parameter. Frozen buffers are resharded too (autograd saves a
frozen weight to compute its input's gradient, and LoRA's frozen base is most of a model):
beside trainable ones they go with their unit; a unit with no trainable buffer has no
gather node to say when its backward is done, so its regathered buffers are dropped when
backward asks for another unit. torch.func refuses saved-tensor hooks, so under its
transforms nothing is resharded (see `funcshard.step._unit_schedule`).

[Note: whole-call units in backward]
A whole-call unit (the root: a tied embedding and head, the final norm) stays gathered
through forward, and backward reads it first (the head's weight), then often never again:
a language model's last backward node is the embedding's, which reads only the indices. So
after the call nothing but autograd holds such a unit's buffers: `pack` saves a view of
one as a `SavedView` of a detached alias of the buffer, and the buffer is freed with the last
saved view backward consumes. Held to the end of backward instead (as FSDP2 holds its root
until the root's post-backward), the gathered root sat beside the embedding's gradient,
the head's and their sum at the step's peak: 12 of 88 MiB per rank of a 10M GPT on 4
ranks. A module of the unit recomputed in backward (activation checkpointing) takes the
aliases while saved views still hold every one (the run keeps weak references); after that
it regathers the unit, once, and holds it to the end of backward, as before this change
(its first gather node, whose backward would drop it, usually never runs: `Run.relink`
took its outputs). So checkpointing the final norm costs one all-gather of the root per
step, and the root's bytes from the head's backward on, as holding it did; a step's peak is
usually earlier, at the start of backward, or at its end, where the root is no longer held
unless recomputed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from funcshard.comm import _chaos as chaos
from funcshard.comm import _collectives as collectives

if TYPE_CHECKING:
    from funcshard.step._unit_gathers import UnitGathers


class Geometry:
    """A saved view's size, stride and offset in its buffer, from which `view_of` makes it
    again at unpack: what every placeholder autograd keeps instead of a view shares."""

    __slots__ = ("offset", "size", "stride")

    def __init__(self, tensor: Tensor) -> None:
        self.size, self.stride, self.offset = (
            tensor.size(),
            tensor.stride(),
            tensor.storage_offset(),
        )

    def view_of(self, buffer: Tensor) -> Tensor:
        return buffer.as_strided(self.size, self.stride, self.offset)


class _Handle(Geometry):
    """What autograd keeps instead of a view into a resharded unit's gathered buffer: the
    unit, the buffer's position among the unit's, and the view's geometry."""

    __slots__ = ("position", "unit")

    def __init__(self, unit: int, position: int, tensor: Tensor) -> None:
        super().__init__(tensor)
        self.unit, self.position = unit, position


class SavedView(Geometry):
    """What autograd keeps instead of a view into a whole-call unit's gathered buffer: a
    detached alias of the buffer (its only holders after the call, see [Note: whole-call
    units in backward]) and the view's geometry."""

    __slots__ = ("alias",)

    def __init__(self, alias: Tensor, tensor: Tensor) -> None:
        super().__init__(tensor)
        self.alias = alias


def still_held(refs: Iterable[weakref.ref[Tensor] | None]) -> tuple[Tensor, ...] | None:
    """A whole-call unit's buffers, if autograd's saved views still hold every one (not to
    be kept by the caller beyond its use: see [Note: whole-call units in backward])."""
    held = [None if ref is None else ref() for ref in refs]
    if not held or any(t is None for t in held):
        return None
    return tuple(t for t in held if t is not None)


class Regather:
    """The backward side of one resharding call: which buffers are gathered parameters, what
    backward has regathered, and the k-rank slices kept between forward and backward."""

    def __init__(self, run: UnitGathers) -> None:
        self.run = run
        mesh = run.layout.mesh
        k = run.state.reshard_after_forward
        self.k = k if not isinstance(k, bool) and k < mesh.shard_size else None
        self.owner_of: dict[int, tuple[int, int, torch.dtype]] = {}  # id of a resharded
        # unit's gathered buffer -> (unit, its position among the unit's buffers, the gather
        # dtype): how `pack` recognizes the parameters' views
        self.aliases: dict[int, Tensor] = {}  # id of a whole-call unit's gathered buffer ->
        # its detached alias, while the call runs: what `pack` saves views of
        self.whole: dict[int, list[weakref.ref[Tensor] | None]] = {}  # whole-call unit ->
        # weak references to its aliases, by position: see [Note: whole-call units in backward]
        self.slices: dict[int, tuple[Tensor, ...]] = {}  # unit -> this rank's 1/k slices
        self.full: dict[int, tuple[Tensor, ...]] = {}  # unit -> its regathered buffers
        self.finished: set[int] = set()  # units whose gather nodes ran
        self.unfinished: dict[int, int] = {}  # unit -> its gather nodes still to run
        self.latest: tuple[int, tuple[Tensor, ...]] | None = None  # the unit that returned
        # last and its gathered buffers, until another unit starts: see `forward_done`
        self.started: set[int] = set()  # units backward has asked for
        self.needed: set[int] = set()  # units backward will ask for: see `_next`
        self.pack_hook = 0  # the id of the pack hook `hooks` installed (no reference: the
        # bookkeeping must not hold itself in a cycle, see `weak`)
        self.weak = weakref.ref(self)  # what the graph holds: it must not keep the run's
        # buffers alive

    def on_backward(self, unit: int) -> Callable[[], None]:
        """What the backward of a gather node of `unit` calls first (see `gather_node_ran`);
        it holds the bookkeeping weakly, so the graph keeps no buffer of the run alive."""
        return functools.partial(_gather_node_ran, self.weak, unit)

    def track(
        self, unit: int, flat_index: int, full: Tensor | None, gather_node: bool = True
    ) -> None:
        """Count a gather node of `unit` just made (with `on_backward`; a frozen buffer has
        none), and recognize its gathered buffer `full` in `pack` unless the unit stays
        gathered for the whole call."""
        if gather_node:
            self.unfinished[unit] = self.unfinished.get(unit, 0) + 1
        run = self.run
        if full is None:
            return
        position = run.binding.unit_flats[unit].index(flat_index)
        if unit in run.binding.whole_call:  # (made again under another grad mode: one alias)
            alias = self.aliases.get(id(full))
            if alias is None:
                alias = self.aliases[id(full)] = full.detach()
            refs = self.whole.setdefault(unit, [None] * len(run.binding.unit_flats[unit]))
            refs[position] = weakref.ref(alias)
        else:
            self.owner_of[id(full)] = (unit, position, run.specs[flat_index].gather_dtype)

    def gather_node_ran(self, unit: int) -> None:
        """A gather node of `unit` starts its backward: once all of the unit's have, the
        unit's backward is done, and its regathered buffers are dropped."""
        self.unfinished[unit] -= 1
        if self.unfinished[unit] == 0:
            self.finished.add(unit)
            self.full.pop(unit, None)

    def release(self, unit: int, fulls: tuple[Tensor | None, ...]) -> None:
        """A unit's module returned: keep this rank's 1/k slices (resharding to k), and stop
        recognizing its buffers, whose ids may be reused."""
        if self.k is not None:
            index = self.run.layout.mesh.shard_rank % self.k
            self.slices[unit] = tuple(
                f.detach().chunk(self.k)[index].clone() for f in fulls if f is not None
            )
        else:
            self.latest = (unit, tuple(f for f in fulls if f is not None))
        for tensor in fulls:
            self.owner_of.pop(id(tensor), None)

    def entered(self, unit: int) -> None:
        """A unit's module is about to run: the one that returned before it is released. Run
        under another saved-tensor hook (activation checkpointing's), the unit's saves are
        not seen by `pack`: it counts as needed in backward."""
        self.latest = None
        if torch.compiler.is_compiling():  # traced: every unit counts as needed, as before
            self.needed.add(unit)
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or id(top[0]) != self.pack_hook:
            self.needed.add(unit)

    def forward_done(self) -> None:
        """The call returned: the unit that ran last keeps its gathered buffers for backward,
        which needs that unit first (regathering it would gather what is still here). The
        peak is no higher: backward's first unpack would regather it at once, with every
        activation still alive."""
        self.aliases = {}  # from now on autograd's saved views alone hold them
        if self.latest is not None:
            unit, fulls = self.latest
            self.latest = None
            if len(fulls) == len(self.run.binding.unit_flats[unit]):
                self.full[unit] = fulls

    def pack(self, tensor: Tensor) -> Any:
        base = tensor._base
        key = id(tensor) if base is None else id(base)
        owner = self.owner_of.get(key)
        if owner is None or tensor.dtype != owner[2]:  # not a resharded unit's parameter
            alias = self.aliases.get(key)
            if alias is not None and alias.dtype == tensor.dtype:  # a whole-call unit's
                return SavedView(alias, tensor)
            # detached: a saved output that held its own grad_fn would close a cycle through
            # C++ (node -> saved tensor -> node) that keeps a graph never backpropagated alive
            return tensor if tensor.is_leaf else tensor.detach()
        self.needed.add(owner[0])
        return _Handle(owner[0], owner[1], tensor)

    def unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, SavedView):
            return packed.view_of(packed.alias)
        if not isinstance(packed, _Handle):
            return packed
        flat = self.gathered(packed.unit)[packed.position]
        return packed.view_of(flat)

    def gathered(self, unit: int) -> tuple[Tensor, ...]:
        """A unit's buffers in backward, regathered (and the next unit's regather issued).
        A unit without gather nodes (all frozen) tells no one when its backward is done, so
        its buffers are dropped when backward asks for another unit (and regathered if it
        comes back to it)."""
        held = still_held(self.whole.get(unit, ()))
        if held is not None:
            return held
        for frozen in [u for u in self.full if u != unit and u not in self.unfinished]:
            del self.full[frozen]
        run = self.run
        if unit not in self.full:
            self.issue(unit)
            self.full[unit] = tuple(p.wait() for p in run.pending.pop(unit))
        if unit not in self.started:  # backward reached this unit: regather the next one
            self.started.add(unit)
            nxt = self._next(unit) if run.prefetch else None
            if nxt is not None:
                self.issue(nxt)
        return self.full[unit]

    def issue(self, unit: int) -> None:
        """Start regathering a unit: from its k-rank slices, or from the full shard group."""
        run = self.run
        if unit in self.full or unit in run.pending:
            return
        slices = self.slices.pop(unit, None)
        if slices is None:
            run.full[unit] = None
            run.issue(unit)
            return
        assert self.k is not None  # slices are kept only when resharding to k ranks
        group = run.layout.mesh.post_forward_group(self.k)
        name = run.binding.unit_names[unit]
        run.pending[unit] = tuple(collectives.all_gather(s, group, what=name) for s in slices)

    def _next(self, unit: int) -> int | None:
        """The unit to regather next: the explicit order's, or the one that ran just before
        `unit` in forward, if backward still needs it. Units autograd saved none of the
        parameters of are passed over (a first layer whose input needs no gradient: its
        weight's gradient reads only its input), else their regather would never be
        waited for."""
        run = self.run
        earlier, seen = self._before(unit), {unit}
        while earlier is not None and earlier not in self.needed and earlier not in seen:
            seen.add(earlier)
            earlier = self._before(earlier)
        if earlier is None or earlier not in self.needed or earlier in run.binding.whole_call:
            return None  # whole-call units stay gathered through backward
        if earlier in self.finished or earlier in self.full or earlier in self.started:
            return None  # done, here, or asked for before (a frozen unit dropped since)
        return earlier

    def _before(self, unit: int) -> int | None:
        """The unit backward reaches after `unit`: the explicit order's, or the one that ran
        just before it in forward."""
        run = self.run
        if run.backward_next is not None:
            return run.backward_next.get(unit)
        if unit in run.order and run.order.index(unit) > 0:
            return run.order[run.order.index(unit) - 1]
        return None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor hooks of the call: chaos points in them only under chaos (they
        run for every tensor autograd saves, two dozen per GPT block)."""
        pack = chaos.at_point(self.pack) if chaos.active() else self.pack
        unpack = chaos.at_point(self.unpack) if chaos.active() else self.unpack
        if not torch.compiler.is_compiling():  # (an object's id is no graph's business)
            self.pack_hook = id(pack)
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _gather_node_ran(regather: weakref.ref[Regather], unit: int) -> None:
    """`Regather.gather_node_ran`, if the call's bookkeeping is still alive."""
    alive = regather()
    if alive is not None:
        alive.gather_node_ran(unit)
