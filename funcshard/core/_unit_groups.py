"""Units of several modules: explicit groups of sibling modules that gather as one.

[Note: units of several modules]
FSDP2's `fully_shard([layers[1], layers[2]])` makes one unit of several modules: one
all-gather before the first of them runs, one reshard after the last, one reduce-scatter.
`fs.plan(..., groups=[...])` takes such groups beside the policy: each group is sibling
modules (objects or FQNs; one module alone is a unit of its own, as if the policy chose
it). The plan visits modules in post-order as ever; a member's leftover (its parameters no
unit below it took) goes to its group instead of its parent, the policy and `keep_fp32` are
not asked about members, and the group becomes a unit when its last member has been
visited, so units stay in post-order and a unit inside a member stays that member's. A
group's unit is named `<a+b>` from its members' FQNs (angle brackets, like the buckets'
`<bucket N>`: no module FQN contains them) and records its members in `Unit.modules`.

Siblings only: members of one parent run in one forward, which the sharded call can watch
(see [Note: per-unit gathering]); modules from different subtrees would make a unit
gathered across unrelated code. A module in two groups, a member that is not a module of
the model, the root, or a module that is ignored is refused by name, before anything
communicates. A group inside another group's member is a unit below it, as a policy's
unit is.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

Group = tuple[str, ...]  # member FQNs, in registration order


def resolved(
    model: nn.Module,
    groups: Iterable[Iterable[nn.Module | str] | nn.Module | str] | None,
    ignored_modules: set[int],
) -> tuple[Group, ...]:
    """Each group as its members' FQNs in registration order, checked (see the Note)."""
    if not groups:
        return ()
    if isinstance(groups, str | nn.Module):
        raise TypeError(
            "funcshard.plan: groups is a list of groups, each a list of sibling modules "
            f"(objects or FQNs), e.g. [['layers.1', 'layers.2']]; got one {type(groups).__name__}."
        )
    fqns = {id(m): fqn for fqn, m in model.named_modules()}  # (each module once: its first)
    order = {fqn: i for i, fqn in enumerate(fqns.values())}
    taken: dict[str, Group] = {}
    out = []
    for given in groups:
        members = [given] if isinstance(given, str | nn.Module) else list(given)
        names = [_member(model, m, fqns, ignored_modules) for m in members]
        if not names:
            raise ValueError("funcshard.plan: groups holds an empty group; drop it.")
        group = tuple(sorted(dict.fromkeys(names), key=order.__getitem__))
        if len(group) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"funcshard.plan: a group lists {twice!r} twice.")
        parents = {_parent(n) for n in group}
        if len(parents) > 1:
            raise ValueError(
                f"funcshard.plan: the group {list(group)} mixes modules of different parents "
                f"({sorted(repr(p or '<root>') for p in parents)}); a group is made of "
                f"siblings (children of one module)."
            )
        for name in group:
            if name in taken:
                raise ValueError(
                    f"funcshard.plan: {name!r} is in two groups, {list(taken[name])} and "
                    f"{list(group)}; a module belongs to one unit."
                )
            taken[name] = group
        out.append(group)
    return tuple(out)


def unit_name(group: Group) -> str:
    """A group's unit name: `<a+b>`, or a module's FQN for a group of one."""
    return group[0] if len(group) == 1 else "<" + "+".join(group) + ">"


def _member(model: nn.Module, member: object, fqns: dict[int, str], ignored: set[int]) -> str:
    if isinstance(member, nn.Module):
        fqn = fqns.get(id(member))
        if fqn is None:
            raise ValueError(
                f"funcshard.plan: groups names a {type(member).__name__} module, which is not "
                f"a module of this {type(model).__name__}."
            )
    elif isinstance(member, str):
        fqn = member
    else:
        raise TypeError(
            f"funcshard.plan: a group's members are modules or their FQNs, got "
            f"{type(member).__name__}."
        )
    try:
        module = model.get_submodule(fqn)
    except AttributeError:
        raise ValueError(
            f"funcshard.plan: groups names {fqn!r}, which is not a module of this "
            f"{type(model).__name__} (see model.named_modules())."
        ) from None
    fqn = fqns[id(module)]  # a module reached under a second name: its first
    if fqn == "":
        raise ValueError(
            "funcshard.plan: groups names the root module, which is always a unit of its own; "
            "group its children instead."
        )
    if id(module) in ignored or any(id(model.get_submodule(p)) in ignored for p in _ancestors(fqn)):
        raise ValueError(
            f"funcshard.plan: groups names {fqn!r}, which is ignored (plan(ignored=...)); "
            f"drop it from the group or from ignored."
        )
    return fqn


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]
