"""On NCCL, torch's flight recorder reports a hang: funcshard switches it on for its meshes.

[Note: a timeout on NCCL]
On gloo a collective that times out raises on the waiting rank, and funcshard's error says
which rank is behind and where (see [Note: naming the rank that is behind] in comm/_progress.py).
On NCCL the wait happens on the GPU's stream: the CPU moves on, and when the collective's
timeout passes torch's watchdog thread aborts the process, with no Python exception, so
none of funcshard's code runs to report. There funcshard relies on torch's own flight
recorder and switches it on unless the user set it: every rank keeps a ring of its last
2000 collectives (`TORCH_NCCL_TRACE_BUFFER_SIZE`, `TORCH_FR_BUFFER_SIZE` in newer torch),
and the watchdog writes it before the abort (`TORCH_NCCL_DUMP_ON_TIMEOUT=1`) to
`TORCH_FR_DUMP_TEMP_FILE` + the rank (torch's default: /tmp/nccl_trace_rank_<r>);
`torchfrtrace <directory>` (torch.distributed.flight_recorder) then says which rank never
joined which collective. The ranks' progress records in the store (comm/_progress.py) stay
readable as well. The variables are read when a process group is created, so they are set
before funcshard creates one (`Mesh.from_env` and every group a mesh builds); a default
group created before any funcshard call keeps the settings it was created with.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

BUFFER = "2000"  # collectives kept per rank: a few steps of a large model's units
_SIZES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
_DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def switch_on(backend: str, environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """For an NCCL `backend`, set the flight recorder's variables the user left unset;
    return what was set (nothing for gloo, or when the user configured it)."""
    if "nccl" not in backend.lower():
        return {}
    chosen: dict[str, str] = {}
    if not any(environ.get(name) for name in _SIZES):
        chosen.update(dict.fromkeys(_SIZES, BUFFER))
    if _DUMP not in environ:
        chosen[_DUMP] = "1"
    environ.update(chosen)
    return chosen
