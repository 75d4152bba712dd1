"""Which parameters a step used: torch.optim's "no gradient", agreed by every rank.

[Note: unused parameters]
torch.optim steps only the parameters whose `.grad` is not None: one the loss did not reach
(a branch not taken, a module called alone as `model[0](x)`, an output thrown away) keeps its
value, its moments and its step count. funcshard's gradients are values, as in JAX: a
parameter the loss did not reach gets zeros, which Adam would still move on its old
moments. So the gradients stay zeros, and the gradient record also says which parameters no
rank used (`ShardedGrads.unused`); funcshard's optimizers leave those alone, as torch.optim
does (`value_and_grad(..., unused="zeros")` keeps the zeros behaviour).

Found where it costs nothing: the differentiable gather returns one output per parameter,
and autograd hands its backward None for each output the loss did not reach. The backward
notes them into the `Recorder` of the `value_and_grad` running (a list the step pushes and
pops; backward runs inside it). A unit not gathered at all gets no gradient from autograd,
hence every parameter of it unused; a replicated (ignored) parameter is unused when autograd
returns None for it. A buffer whose gradient came by another path (no note, a gradient
nonetheless) counts as used whole: "unused" is said only when known.

Agreed across ranks, because a parameter one rank used has a real gradient in the mean: a
parameter is unused only if no rank used it. Each rank packs its unused set into a few int64
words (62 parameters a word, in the layout's order) that ride the non-finite verdict's
collective (see [Note: non-finite steps skipped by default] in funcshard/step/_finite.py):
no collective of their own. With `check_finite="off"` the words go alone in one all-gather.
Reading is lazy: an optimizer asks, and the words are ANDed across ranks then; a step that
used everything has all-zero words and decodes nothing. `accumulate` keeps a parameter
unused only if unused in both halves; `reduce=False` keeps the rank's own set on `LocalGrads`
until `funcshard.reduce` agrees it.

Not tracked where the gather's backward is traced (`fs.compile`, `fs.trace`): there autograd's
None becomes a graph's zero before any Python sees it, so a traced step counts every
parameter as used (the zeros behaviour).
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.core._layout import FlatLayout, Layout

BITS = 62  # parameters per int64 word (below the sign bit, so words stay non-negative)
POLICIES = ("skip", "zeros")


def policy(unused: str, where: str) -> str:
    """The `unused=` argument checked: "skip" (torch.optim's rule) or "zeros"."""
    if unused not in POLICIES:
        raise ValueError(
            f"funcshard.{where}: unused must be 'skip' (the default: parameters no rank used "
            f"this step keep their values and optimizer state, as torch.optim skips a "
            f"parameter whose .grad is None) or 'zeros' (they get zero gradients and move "
            f"like any other), got {unused!r}."
        )
    return unused


class Recorder:
    """What one `value_and_grad` saw of its gathers' backwards: per flat buffer, whether
    each parameter got a gradient (see [Note: unused parameters])."""

    def __init__(self) -> None:
        self.whole: set[int] = set()  # ids of flats every parameter of which got one
        self.partly: dict[int, list[bool]] = {}  # id of flat -> got one, per parameter

    def note(self, flat: FlatLayout, grads: tuple[Tensor | None, ...]) -> None:
        key = id(flat)
        if key in self.whole:
            return
        if all(g is not None for g in grads):
            self.whole.add(key)
            self.partly.pop(key, None)
            return
        got = self.partly.setdefault(key, [False] * len(grads))
        for j, g in enumerate(grads):
            if g is not None:
                got[j] = True

    def unused(
        self, layout: Layout, flat_grads: list[Tensor | None], replicated: dict[str, Any]
    ) -> frozenset[str]:
        """This rank's unused trainable parameters, from what backward noted and what
        autograd returned (`flat_grads` per flat, None where nothing reached the buffer;
        `replicated` per replicated trainable FQN)."""
        out: list[str] = []
        for flat, grad in zip(layout.flats, flat_grads, strict=True):
            if flat.frozen:
                continue
            if grad is None:
                out.extend(f for f in flat.fqns if f not in flat.frozen_fqns)
                continue
            got = self.partly.get(id(flat))
            if got is not None and id(flat) not in self.whole:
                out.extend(
                    f
                    for f, g in zip(flat.fqns, got, strict=True)
                    if not g and f not in flat.frozen_fqns
                )
        out.extend(f for f, g in replicated.items() if g is None)
        return frozenset(out)


_RECORDING: list[Recorder] = []


@contextlib.contextmanager
def recording(recorder: Recorder | None) -> Iterator[None]:
    """Note the gathers' backwards run inside into `recorder` (None: note nothing)."""
    if recorder is None:
        yield
        return
    _RECORDING.append(recorder)
    try:
        yield
    finally:
        _RECORDING.remove(recorder)


def note(flat: FlatLayout, grads: tuple[Tensor | None, ...]) -> None:
    """Called by the gather's backward: which of `flat`'s parameters got a gradient."""
    if _RECORDING and not torch.compiler.is_dynamo_compiling():
        _RECORDING[-1].note(flat, grads)


def tracked(layout: Layout) -> tuple[str, ...]:
    """The parameters usage is said of, in word order: each trainable flat's trainable
    members, then the trainable replicated parameters. Made once per layout object (by
    identity: hashing a layout walks all its names)."""
    hit = _TRACKED.get(id(layout))
    if hit is not None and hit[0] is layout:
        return hit[1]
    flats = [
        f
        for flat in layout.flats
        if not flat.frozen
        for f in flat.fqns
        if f not in flat.frozen_fqns
    ]
    names = (*flats, *layout.replicated_trainable)
    if len(_TRACKED) >= 64:
        _TRACKED.pop(next(iter(_TRACKED)))  # the oldest: a finished run's
    _TRACKED[id(layout)] = (layout, names)  # (holding it keeps the id from being reused)
    return names


_TRACKED: dict[int, tuple[Layout, tuple[str, ...]]] = {}


def words_of(layout: Layout, unused: frozenset[str]) -> list[int]:
    """`unused` as int64 words, bit k of word k // BITS for the k-th tracked parameter."""
    names = tracked(layout)
    words = [0] * -(-len(names) // BITS)
    if unused:
        for k, name in enumerate(names):
            if name in unused:
                words[k // BITS] |= 1 << (k % BITS)
    return words


def agreed(layout: Layout, values: list[int], width: int, offset: int, n: int) -> frozenset[str]:
    """The tracked parameters whose bit is set in every rank's `n` words (at `offset` of each
    rank's row of `width` in `values`, every rank's rows one after another, as read from
    the verdict's collective)."""
    if not any(values[offset : offset + n]):  # (the usual step: rank 0's words are all
        return frozenset()  # zero, so no bit survives the AND)
    rows = [values[i + offset : i + offset + n] for i in range(0, len(values), width)]
    words = [functools.reduce(operator.and_, column) for column in zip(*rows, strict=True)]
    if not any(words):  # (the usual step: nothing to decode)
        return frozenset()
    names = tracked(layout)
    return frozenset(name for k, name in enumerate(names) if words[k // BITS] >> (k % BITS) & 1)


class Usage:
    """Which parameters no rank used in the step that made a gradient record: this rank's
    own set, and once the words crossed the mesh, every rank's (read lazily)."""

    def __init__(self, layout: Layout, local: frozenset[str]) -> None:
        self.layout, self.local = layout, local
        # reads every rank's rows (the verdict's, or an all-gather's), the words at [offset, +n)
        self._read: Callable[[], list[int]] | None = None
        self._width = self._offset = 0
        self._parts: tuple[Usage, Usage] | None = None
        self._agreed: frozenset[str] | None = None
        self._words: tuple[int, ...] | None = None

    def words(self) -> tuple[int, ...]:
        if self._words is None:  # (asked when the verdict is issued and when it is read)
            self._words = tuple(words_of(self.layout, self.local))
        return self._words

    def agree_by(self, read: Callable[[], list[int]], width: int, offset: int) -> None:
        """Read the agreed set from what `read` returns (all ranks' rows of `width`, this
        usage's words at `offset`) when it is first asked for: the verdict reads its
        collective's result once for both."""
        self._read, self._width, self._offset = read, width, offset

    def unused(self) -> frozenset[str]:
        """The parameters no rank used (this rank's own set before agreement)."""
        if self._agreed is not None:
            return self._agreed
        if self._parts is not None:
            a, b = self._parts
            self._agreed = a.unused() & b.unused()
        elif self._read is None:
            return self.local
        else:
            n = len(self.words())
            self._agreed = agreed(self.layout, self._read(), self._width, self._offset, n)
        return self._agreed

    def merged(self, other: Usage | None) -> Usage:
        """The usage of two gradients' sum: unused where unused in both."""
        if other is None:
            return self
        merged = Usage(self.layout, self.local & other.local)
        merged._parts = (self, other)
        return merged


def agreed_alone(usage: Usage, group: Any) -> None:
    """Agree `usage` over `group` by an all-gather of its words alone (`check_finite="off"`,
    where no verdict carries them)."""
    words = usage.words()
    if not words:
        return
    mine = torch.tensor(words, dtype=torch.int64, device=usage.layout.mesh.device)
    every = collectives.all_gather(mine, group, what="<unused parameters>").wait()
    usage.agree_by(every.tolist, len(words), 0)
