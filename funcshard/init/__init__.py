"""Parameters made on the meta device and initialized straight into their shards.

May import: core, comm.
"""

from funcshard.init._deferred import deferred_init as deferred_init
from funcshard.init._materialize import skip as skip
from funcshard.init._materialize import whole_model as whole_model

__all__ = [
    "deferred_init",
    "skip",
    "whole_model",
]
