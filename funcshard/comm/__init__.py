"""Talking to the other ranks: the mesh, every collective funcshard issues, and what
happens when one fails. The bottom wing: it imports nothing else of funcshard.

May import: torch only.
"""

from funcshard.comm._collectives import Record as Record
from funcshard.comm._collectives import bytes_sent as bytes_sent
from funcshard.comm._collectives import record as record
from funcshard.comm._comm import Comm as Comm
from funcshard.comm._comm import MeshAxis as MeshAxis
from funcshard.comm._failfast import fail_fast as fail_fast
from funcshard.comm._failures import CollectiveError as CollectiveError
from funcshard.comm._mesh import Mesh as Mesh
from funcshard.comm._mesh import shutdown as shutdown

__all__ = [
    "CollectiveError",
    "Comm",
    "Mesh",
    "MeshAxis",
    "Record",
    "bytes_sent",
    "fail_fast",
    "record",
    "shutdown",
]
