"""A step's verdict: every rank's non-finite flags (and the unused parameters' words, and the
collectives' trail) as one collective delivered them (an all-gather, or on a CPU DDP mesh an
all-reduce of every rank's row), read on the host only when asked
(see [Note: one decision for all ranks] in funcshard/step/_finite.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from funcshard.comm import _trail as trail


class Verdict:
    """Whether a step's loss and gradients were finite on every rank: every rank's flags,
    gathered by a collective issued when the gradients were ready and waited for on first
    reading. Every rank reads the same flags, so every rank decides alike."""

    def __init__(
        self,
        every: Tensor,
        names: list[str],
        ranks: list[int],
        trails: bool = False,
        scope: str = "every rank",
        traced: bool = False,
        words: int = 0,
        copies: tuple[tuple[int, ...] | None, ...] = (),
    ) -> None:
        # every rank's flags, then `words` int64 of unused parameters (see [Note: unused
        # parameters] in funcshard/step/_usage.py), then its trail (with `trails`), by rank
        self._every = every
        self.names, self.ranks, self._trails = names, ranks, trails
        self._words = words
        self.scope = scope  # who decides alike, in words
        self.traced = traced  # `_every` is a node of a graph being compiled: never read here
        self._parts: tuple[Verdict, Verdict] | None = None  # of a merged verdict
        self._rows: list[list[int]] | None = None
        self._values: list[int] | None = None  # `_every` read on the host
        self.acted = False  # an optimizer has decided on it (warned, or counted it finite)
        # where other words sit in each rank's row, and how many: see [Note: parameters
        # stuck at zero] in funcshard/step/_zero_start.py
        self.extra = (0, 0)
        # per leaf, the copy each rank holds (None: its own): a flag on one rank's piece of
        # a copy marks every holder (see [Note: each copy checked once] in
        # funcshard/step/_check_parts.py); () for none
        self.copies = copies

    def rows(self) -> list[list[int]]:
        """Per rank: [loss not finite, then one flag per leaf]."""
        if self._rows is None and self._parts is not None:
            a, b = (part.rows() for part in self._parts)
            self._rows = [
                [max(x, y) for x, y in zip(p, q, strict=True)] for p, q in zip(a, b, strict=True)
            ]
        if self._rows is None:
            every = self.values()
            width = len(every) // len(self.ranks)
            starts = range(0, len(every), width)
            if self._trails:
                trail.check(self.ranks, [every[i + width - 2 : i + width] for i in starts])
            flags = self._flags_in(width)
            self._rows = _shared([every[i : i + flags] for i in starts], self.copies)
        return self._rows

    def values(self) -> list[int]:
        """Every rank's row, one after another, read on the host once (one flat list: cheaper
        than nested ones); the unused parameters' words are read from it too."""
        if self._values is None:
            self._values = self._every.tolist()
        return self._values

    def finite(self) -> bool:
        if self._rows is None and self._parts is None and self._alike_and_clear():
            return True
        return not any(any(row) for row in self.rows())

    def _alike_and_clear(self) -> bool:
        """Whether every rank sent the same row (the same trail, the same words) and it
        flags nothing: a finite step's verdict, told from one read of the flags without
        building the rows (this runs every step)."""
        every = self.values()
        width = len(every) // len(self.ranks)
        return not any(every[: self._flags_in(width)]) and every == every[:width] * len(self.ranks)

    def _flags_in(self, width: int) -> int:
        """How many of a rank's `width` ints are flags (the loss's, then one a leaf): the
        words and the trail follow them."""
        return width - self._words - (2 if self._trails else 0)

    def width(self) -> int:
        """Ints each rank sent."""
        return self._every.numel() // len(self.ranks)

    def ok(self) -> Tensor:
        """Whether every rank's flags are clear, as a boolean tensor: what a traced step
        decides on without reading anything on the host (see [Note: a compiled step's
        skip is a masked update])."""
        return self._every.eq(0).all()

    def problems(self) -> str:
        """Where the NaN or inf were, the same words on every rank."""
        rows = self.rows()
        problems = []
        bad_loss = [r for r, row in zip(self.ranks, rows, strict=True) if row[0]]
        bad_grads = any(any(row[1:]) for row in rows)
        if bad_loss and not bad_grads:
            problems.append(
                f"the loss on ranks {bad_loss}, whose gradients are all finite: an empty "
                f"batch on those ranks? (a mean over no elements is NaN, its gradient zero)"
            )
        elif bad_loss:
            problems.append(f"the loss on ranks {bad_loss}")
        bad = [
            (name, [r for r, row in zip(self.ranks, rows, strict=True) if row[i]])
            for i, name in enumerate(self.names, start=1)
        ]
        bad = [(name, holders) for name, holders in bad if holders]
        if bad:
            name, holders = bad[0]
            more = f", and {len(bad) - 1} more gradient leaves" if len(bad) > 1 else ""
            problems.append(f"gradients of {name} (on ranks {holders}) first{more}")
        return "; ".join(problems)

    def merged(self, other: Verdict | None) -> Verdict:
        """The verdict on the sum of two gradients (`accumulate`): not finite where either
        was not."""
        if other is None:
            return self
        if self.traced:  # (both are: one step is traced as a whole)
            every = torch.maximum(self._every, other._every)
            return Verdict(every, self.names, self.ranks, scope=self.scope, traced=True)
        merged = Verdict(self._every, self.names, self.ranks, scope=self.scope)
        merged._parts = (self, other)  # read when the merged verdict first is (lazily: a
        return merged  # micro-batch waits for no flags)


def _shared(rows: list[list[int]], copies: tuple[tuple[int, ...] | None, ...]) -> list[list[int]]:
    """`rows` with each leaf's flag set on every rank that holds a copy some rank flagged
    (each rank checked only its piece of it: see [Note: each copy checked once])."""
    if not copies or not any(any(row[1:]) for row in rows):
        return rows
    for leaf, keys in enumerate(copies, start=1):
        if keys is None:
            continue
        bad = {key for key, row in zip(keys, rows, strict=True) if row[leaf]}
        for key, row in zip(keys, rows, strict=True):
            if key in bad:
                row[leaf] = 1
    return rows
