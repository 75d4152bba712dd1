"""Which rank of a mesh owns each whole parameter, and the two exchanges that move
parameters to their owners and updates back.

[Note: whole parameters on their owners]
A flat shard mixes pieces of several parameters, and one parameter may be spread over
several ranks, so math on a whole parameter (Muon's orthogonalization, a trust ratio) must
first make it whole somewhere. Gathering every parameter on every rank repeats each
parameter's math on every rank. Here each trained parameter gets one owner among the
mesh's ranks, chosen once per layout by largest-first greedy balancing of numel (the
ranks' work stays within one matrix of even). A step is then two uneven all-to-alls over
the mesh per dtype: the ranks of the owner's replica send it their pieces of the
parameter (gradient and value together; shards hold consecutive ranges, so the pieces in
shard order are the flattened parameter), the owner runs the math, and sends every rank
of every replica the piece of the update its shard holds. Traffic per step is about one
gradient and one parameter out and one update back per replica, and no rank holds more
than its owned parameters whole (and those chunk by chunk: `chunks`).

Replicas (HSDP's replica groups, DDP's ranks) split the work too: measured on a 10M GPT's
Muon + AdamW step on 2 gloo ranks, DDP computing every matrix on every rank took 187 ms
where FSDP's owners, each computing half of them and exchanging, took 126 ms; an update
sent to the other replica costs less than the math it saves, and each parameter's state
then lives on one rank of the whole mesh. Leaves that are whole tensors (a dict's values,
replicated parameters) are computed where they are, on every rank that holds them.

On an owned unit (see [Note: owned placement] in funcshard/core/_placement.py) the layout
has already put each parameter whole in one shard. Without replicas (FSDP) its owner is
that shard's rank, it is read and written in place, and nothing is exchanged for it; a
group whose members are all such issues no collective at all. With replicas (HSDP) it is
balanced and exchanged over the whole mesh as an even unit's member is: an owner's pieces
are then one whole piece on one rank and none elsewhere, which the exchange handles as any
split. The other choice, each replica repeating its owners' math in place, does twice the
math per rank (half the matrices against a quarter on HSDP 2x2). Measured with
`python -m benchmarks.muon_hsdp` (Muon + AdamW's optimizer step, the 10M GPT of
`benchmarks.muon`, HSDP 2x2): rank 0's own CPU time on the fake group of 4 (collectives
free) was 216-248 ms in place against 102-109 ms through the exchange, two runs each; on
4 gloo ranks sharing 2 busy cores the wall times were within noise (in place 490-569 ms,
owned through the exchange 473-547, even units 329-686). The exchange moves about 3 M
(N - 1) / N^2 elements per rank for M elements of matrices (15 MiB here), less than the
math it saves, as for DDP above; so replicas exchange. Members of even units in the same
group are balanced and exchanged as above.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from funcshard.comm import _collectives as collectives
from funcshard.core import _placement as placement
from funcshard.core._layout import FlatLayout, overlap, shard_pieces


@dataclass(frozen=True)
class Member:
    """A trained parameter inside a flat leaf: its place in the unsharded buffer and its
    owner (a rank of the shard group)."""

    fqn: str
    shape: tuple[int, ...]
    leaf: int
    offset: int
    numel: int
    owner: int
    local: int = 0  # where this rank's piece starts in this rank's leaf
    read: int = 0  # where `to_owners` reads it: `local`, or its place in the unpacked shard
    placed: bool = False  # an owned unit's: whole in its owner's shard, never exchanged

    def piece(self, rank: int, shard_numel: int) -> tuple[int, int]:
        """`[lo, hi)` of the flattened parameter that rank `rank`'s shard holds."""
        return overlap(self.offset, self.numel, rank * shard_numel, (rank + 1) * shard_numel)


@dataclass(frozen=True)
class Whole:
    """A leaf that holds one parameter whole (a dict's value, a replicated parameter):
    computed on every rank that has it, nothing exchanged."""

    fqn: str
    leaf: int


@dataclass(frozen=True)
class Plan:
    """The owners of one set of trained parameters on one rank of a mesh. Ranks are
    numbered in the mesh's group, `replica * shard + shard rank`."""

    members: tuple[Member, ...]  # flat leaves' trained parameters, in leaf then offset order
    wholes: tuple[Whole, ...]
    shard_numels: tuple[int, ...]  # per leaf (0 for a whole leaf)
    size: int  # of the mesh
    rank: int  # this rank, in the mesh's group
    shard: int = 1  # the shard axis' size: rank r holds shard r % shard of replica r // shard

    @functools.cached_property
    def mine(self) -> tuple[Member, ...]:
        """The members this rank owns."""
        return tuple(m for m in self.members if m.owner == self.rank)

    @property
    def owned_fqns(self) -> tuple[str, ...]:
        """Every parameter this rank computes: its members, then its whole leaves."""
        return tuple(m.fqn for m in self.mine) + tuple(w.fqn for w in self.wholes)

    def piece(self, member: Member, rank: int) -> tuple[int, int]:
        """`[lo, hi)` of `member` that rank `rank`'s shard holds."""
        return member.piece(rank % self.shard, self.shard_numels[member.leaf])

    def sends_to_owner(self, rank: int, owner: int) -> bool:
        """Whether `rank` sends its pieces to `owner`: only ranks of the owner's replica do
        (the others hold the same pieces)."""
        return rank // self.shard == owner // self.shard


def plan(
    flats: Sequence[tuple[int, FlatLayout, tuple[str, ...], tuple[str, ...] | None]],
    wholes: Sequence[tuple[int, str]],
    size: int,
    rank: int,
    shard: int = 1,
    read_unpacked: bool = False,
) -> Plan:
    """Owners among the `size` ranks of a mesh (shard axis `shard`) for the trained
    parameters `flats` lists (leaf index, buffer, trained FQNs of it, and for a packed leaf
    the FQNs it holds pieces of: see funcshard/core/_groups.py), balanced by numel, and the whole
    leaves `wholes` lists ((leaf index, fqn)). `read_unpacked`: `to_owners` will be given
    the unpacked shards of packed leaves (a GroupView's source), `from_owners` still
    writes packed leaves."""
    found = []
    for leaf, flat, trained, packed in flats:
        pieces = shard_pieces(flat, rank % shard, packed)
        # where this rank's piece is, in the leaf written and in the leaf read
        local = {flat.fqns[p.index]: (p.local, p.at if read_unpacked else p.local) for p in pieces}
        chosen = set(trained)
        replica = (rank // shard) * shard  # an owned unit's owners: its shards' ranks here
        for i, fqn in enumerate(flat.fqns):
            if fqn in chosen:
                where = local.get(fqn, (0, 0))
                # on replicas (HSDP) exchanged as an even unit's: see the Note above
                placed = replica + flat.owners[i] if flat.owners and size == shard else None
                found.append(
                    (fqn, flat.shapes[i], leaf, flat.offsets[i], flat.numels[i], where, placed)
                )
    balanced = iter(placement.owners(tuple(f[4] for f in found if f[6] is None), size))
    members = tuple(
        Member(fqn, shape, leaf, offset, numel, next(balanced) if placed is None else placed,
               *where, placed=placed is not None)
        for fqn, shape, leaf, offset, numel, where, placed in found
    )  # fmt: skip
    numels = [0] * (1 + max([f[0] for f in flats] + [leaf for leaf, _ in wholes] + [-1]))
    for leaf, flat, *_ in flats:
        numels[leaf] = flat.shard_numel
    wholes_ = tuple(Whole(f, leaf) for leaf, f in wholes)
    return Plan(members, wholes_, tuple(numels), size, rank, shard)


@functools.lru_cache(maxsize=64)
def chunks(plan: Plan, numel: int) -> tuple[Plan, ...]:
    """`plan` cut into consecutive plans of at most `numel` members' elements each (a larger
    parameter alone), whole leaves in the first: exchanged and computed one after another,
    so a rank holds one chunk's whole parameters at a time. The same cut on every rank."""
    cut: list[list[Member]] = [[]]
    size = 0
    for m in plan.members:
        if cut[-1] and size + m.numel > numel:
            cut.append([])
            size = 0
        cut[-1].append(m)
        size += m.numel
    return tuple(
        dataclasses.replace(plan, members=tuple(part), wholes=plan.wholes if i == 0 else ())
        for i, part in enumerate(cut)
    )


def to_owners(plan: Plan, kinds: Sequence[Sequence[Tensor | None]], group) -> list[dict]:
    """For each kind of leaves (gradients, parameters: lists lined up with the leaves), the
    whole tensors of the parameters this rank owns, `{fqn: tensor of its shape}`.
    Communicates: one uneven all-to-all per dtype over the shard group."""
    out: list[dict[str, Tensor]] = [{} for _ in kinds]
    for k, leaves in enumerate(kinds):
        for whole in plan.wholes:
            leaf = leaves[whole.leaf]
            assert leaf is not None  # a planned whole is trained: its leaves are present
            out[k][whole.fqn] = leaf
        for m in plan.mine:
            if m.placed and (held := leaves[m.leaf]) is not None:  # whole in this rank's
                # own leaf: a view of it, nothing exchanged
                out[k][m.fqn] = held[m.read : m.read + m.numel].view(m.shape)
    entries = [(k, m) for k in range(len(kinds)) for m in plan.members if not m.placed]
    for dtype, chosen in _by_dtype(entries, lambda e: kinds[e[0]][e[1].leaf].dtype):
        pieces = _exchange_out(plan, chosen, kinds, dtype, group)
        # a parameter in one piece could be a view of the received buffer, but a view keeps
        # all of it alive: once any parameter is concatenated from pieces (a copy), the one-
        # piece ones are copied too, so that the buffer is freed and no element is held twice
        copied = any(len(parts) > 1 for parts in pieces.values())
        for (k, m), parts in pieces.items():
            one = parts[0].clone() if copied else parts[0]
            out[k][m.fqn] = (torch.cat(parts) if len(parts) > 1 else one).view(m.shape)
        del pieces
    return out


def from_owners(
    plan: Plan,
    updates: dict[str, Tensor],
    like: Sequence[Tensor | Like | None],
    group,
    out: list[Tensor | None] | None = None,
) -> list[Tensor | None]:
    """Leaves lined up with `like` (this rank's gradient leaves) holding the owners'
    `updates` (this rank's owned parameters' whole updates) at this rank's pieces; zero
    where no trained parameter lies, None where `like` is None. Written into `out` when
    given (the leaves an earlier chunk's call returned).
    Communicates: one uneven all-to-all per dtype over the shard group."""
    out = [None] * len(like) if out is None else out
    for whole in plan.wholes:
        if (leaf := like[whole.leaf]) is not None:
            out[whole.leaf] = updates[whole.fqn].to(leaf.dtype)
    for m in plan.mine:
        if m.placed:  # written in place, nothing exchanged
            target, shape = out[m.leaf], like[m.leaf]
            assert shape is not None  # a planned member is trained: its leaf is present
            target = out[m.leaf] = _zeros(shape) if target is None else target
            target[m.local : m.local + m.numel] = updates[m.fqn].reshape(-1)
    exchanged = [m for m in plan.members if not m.placed]
    for dtype, chosen in _by_dtype(exchanged, lambda m: like[m.leaf].dtype):
        me = plan.rank
        mine = [m for m in chosen if m.owner == me]
        # this rank's own pieces of what it owns are written below, not exchanged
        sends = [
            [updates[m.fqn].reshape(-1)[slice(*plan.piece(m, r))].to(dtype) for m in mine]
            if r != me
            else []
            for r in range(plan.size)
        ]
        receives = [_held(plan, chosen, r) if r != me else 0 for r in range(plan.size)]
        total = sum(m.numel for m in chosen) * (plan.size // plan.shard)  # to every replica
        received = _exchange(sends, receives, dtype, group, total, "<whole-parameter updates>")
        del sends
        # the leaves are made after the exchange, once its send buffer is freed: the two
        # never coexist (each is this rank's share of the group's elements)
        for m in chosen:
            if out[m.leaf] is None:
                out[m.leaf] = _zeros(like[m.leaf])
        for owner, buffer in enumerate(received):
            at = 0
            for m in chosen:
                if m.owner != owner:
                    continue
                lo, hi = plan.piece(m, me)
                if hi > lo and owner == me:
                    out[m.leaf][m.local : m.local + hi - lo] = updates[m.fqn].reshape(-1)[lo:hi]
                elif hi > lo:
                    out[m.leaf][m.local : m.local + hi - lo] = buffer[at : at + hi - lo]
                    at += hi - lo
    for i, g in enumerate(like):
        if out[i] is None and g is not None:
            out[i] = _zeros(g)
    return out


class Like(NamedTuple):
    """What `from_owners` needs of a leaf it makes: a tensor, or this when the leaf itself
    was never made (a GroupView's packed leaf that `to_owners` read unpacked)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _zeros(like: Tensor | Like) -> Tensor:
    return torch.zeros(like.shape, dtype=like.dtype, device=like.device)


def _held(plan: Plan, chosen: Sequence[Member], owner: int) -> int:
    """How many elements this rank receives back from `owner`: its pieces of what `owner`
    owns."""
    return sum(hi - lo for m in chosen if m.owner == owner for lo, hi in [plan.piece(m, plan.rank)])


def _exchange_out(plan: Plan, chosen, kinds, dtype, group) -> dict:
    """Send each (kind, member) piece this rank holds to the member's owner; return, per
    (kind, member) this rank owns, its pieces in rank order. The pieces this rank holds of
    what it owns are not exchanged: they are views of its own leaves."""
    me = plan.rank
    sends = []
    for r in range(plan.size):
        parts = []
        for k, m in chosen:
            lo, hi = plan.piece(m, me)
            if m.owner == r != me and hi > lo and plan.sends_to_owner(me, r):
                parts.append(kinds[k][m.leaf][m.read : m.read + hi - lo])
        sends.append(parts)
    receives = [
        sum(hi - lo for k, m in chosen if m.owner == me for lo, hi in [plan.piece(m, r)])
        if plan.sends_to_owner(r, me) and r != me
        else 0
        for r in range(plan.size)
    ]
    total = sum(m.numel for _, m in chosen)
    received = _exchange(sends, receives, dtype, group, total, "<whole parameters to owners>")
    pieces: dict = {}
    for r, buffer in enumerate(received):
        at = 0
        for k, m in chosen:
            if m.owner != me or not plan.sends_to_owner(r, me):
                continue
            lo, hi = plan.piece(m, r)
            if hi > lo and r == me:
                pieces.setdefault((k, m), []).append(kinds[k][m.leaf][m.read : m.read + hi - lo])
            elif hi > lo:
                pieces.setdefault((k, m), []).append(buffer[at : at + hi - lo])
                at += hi - lo
    return pieces


def _exchange(
    sends: list[list[Tensor]], receives: list[int], dtype, group, total: int, what: str
) -> list[Tensor]:
    """One uneven all-to-all: `sends[r]` (tensors, concatenated) to rank r; the buffers
    received, per source rank. `total`: what the whole group exchanges (see
    `collectives.all_to_all_v`)."""
    send_sizes = [sum(t.numel() for t in parts) for parts in sends]
    flat = [t.reshape(-1) for parts in sends for t in parts]
    device = flat[0].device if flat else torch.device("cpu")
    buffer = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
    result = collectives.all_to_all_v(buffer, send_sizes, receives, group, total, what).wait()
    if buffer.device.type == "cpu" and not _same_storage(buffer, result):  # (one rank: itself)
        # freed now: gloo's worker thread may hold its input a moment after the wait returns,
        # which kept the buffer alive beside the next one, more often the busier the machine
        buffer.untyped_storage().resize_(0)
    return list(result.split(receives))


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _by_dtype(items, dtype_of) -> list[tuple[torch.dtype, list]]:
    """`items` grouped by dtype, groups in a fixed order (the same on every rank)."""
    groups: dict[torch.dtype, list] = {}
    for item in items:
        groups.setdefault(dtype_of(item), []).append(item)
    return sorted(groups.items(), key=lambda kv: str(kv[0]))
