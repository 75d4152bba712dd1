"""How `Mesh.from_env` starts torch.distributed: from a launcher's environment, or alone.

[Note: from_env without a launcher]
`Mesh.from_env()` in a process that no launcher started (none of RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID set) makes a world of one
process, so one training script runs as `python train.py` and under torchrun. The one
process needs no rendezvous: its default group is made over an in-memory `HashStore`, so
no port is opened and none can clash. Some of those variables set and others missing is a
broken launch, not a plain `python` run: it still raises, naming the missing ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from funcshard.comm import _flight_recorder as flight_recorder

LAUNCH_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARIABLES = (*LAUNCH_REQUIRED, "LOCAL_RANK", "TORCHELASTIC_RUN_ID")


def launched_alone(environ: Mapping[str, str]) -> bool:
    """True when no launcher variable is in `environ` (a plain `python train.py`), False
    when a launcher set every variable a rendezvous needs; a RuntimeError naming the
    missing ones for anything in between (see [Note: from_env without a launcher])."""
    if not any(v in environ for v in LAUNCHER_VARIABLES):
        return True
    missing = [v for v in LAUNCH_REQUIRED if v not in environ]
    if missing:
        found = [v for v in LAUNCHER_VARIABLES if v in environ]
        raise RuntimeError(
            f"Mesh.from_env: {', '.join(missing)} not set, though {', '.join(found)} "
            f"{'is' if len(found) == 1 else 'are'}. Launch with "
            f"`torchrun --nproc-per-node N script.py`, run plain `python script.py` with none "
            f"of {', '.join(LAUNCHER_VARIABLES)} set (one process), or build Mesh(shard=N) "
            f"after torch.distributed.init_process_group(...)."
        )
    return False


def init_alone(backend: str, timeout: timedelta) -> None:
    """init_process_group for a world of this one process, over an in-memory store: no
    rendezvous, no port."""
    flight_recorder.switch_on(backend)  # see [Note: a timeout on NCCL]
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def init_from_env(backend: str, timeout: timedelta) -> None:
    """init_process_group from torchrun's environment, its keys under this restart's prefix.

    After an elastic restart the agent's store may still hold the previous round's addresses
    under the same keys; a new rank that reads one before its peer rewrites it connects to a
    dead rank (gloo: "connection refused", or a hang on a reused port). A prefix per
    TORCHELASTIC_RESTART_COUNT keeps each round's rendezvous apart.
    """
    flight_recorder.switch_on(backend)  # see [Note: a timeout on NCCL]
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"funcshard/attempt-{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
