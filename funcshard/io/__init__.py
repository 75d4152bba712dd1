"""Checkpoints: torch.distributed.checkpoint saves and loads at any world size, their
checksums, reading one in a single process (`read_meta`, `export_state_dict`), and Hugging
Face safetensors in and out of shards; and `refreeze`, which moves a
live state's values and optimizer state by key as a load does, onto another frozen set.

May import: compiling, optim, step, init, core, comm.
"""

# The wing's public names are funcshard.checkpoint's (io/_checkpoint.py's __all__).
from funcshard.io._checkpoint import *  # noqa: F403
from funcshard.io._checkpoint import __all__ as __all__
from funcshard.io._refreeze import refreeze as refreeze
