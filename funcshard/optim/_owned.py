"""Optimizer state keyed by parameter FQN and held only by each parameter's owner rank.

[Note: owned state]
`fs.optim.whole_params` runs a one-process transform on whole parameters, each on one owner
rank of the mesh (see [Note: whole parameters on their owners] in funcshard/optim/_owners.py). What
that transform keeps for a parameter lives on the owner only, so its state is
`Owned(states={fqn: state of that parameter})` holding this rank's keys alone: the ranks of
a mesh hold disjoint key sets whose union is every trained parameter (a replicated
parameter, computed on every rank, is every rank's key). A one-process params dict owns
every key.

Nothing about a key's state depends on which rank holds it, so a checkpoint saves each key
from the ranks that hold it (replicas' copies are one copy) and a load hands each key to
whichever rank owns it in `like`, at any world size or mesh (see [Note: checkpoints]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from funcshard.core._state import donatable
from funcshard.core._tree import register_record


@dataclass(frozen=True, eq=False)
class Owned:
    """Per-parameter state, `{fqn: state}`, for the parameters this rank owns (any pytree
    per parameter: tensors, Python numbers, records)."""

    states: dict[str, Any]


register_record(Owned, data_fields=("states",), meta_fields=())
donatable(Owned, ("states",))
