"""The records a training step passes around and the pure functions that build them:
pytrees, modules as dicts, the plan, the layout of flat buffers, the sharded state.

May import: comm.
"""

from funcshard.core._layout import FlatLayout as FlatLayout
from funcshard.core._layout import Layout as Layout
from funcshard.core._module import extract as extract
from funcshard.core._plan import Plan as Plan
from funcshard.core._plan import Unit as Unit
from funcshard.core._plan import plan as plan
from funcshard.core._precision import MixedPrecision as MixedPrecision
from funcshard.core._rng import fold_in as fold_in
from funcshard.core._rng import manual_seed as manual_seed
from funcshard.core._rng import rank_generator as rank_generator
from funcshard.core._rng import rank_seed as rank_seed
from funcshard.core._state import DonatedError as DonatedError
from funcshard.core._state import LocalGrads as LocalGrads
from funcshard.core._state import ShardedGrads as ShardedGrads
from funcshard.core._state import ShardedState as ShardedState
from funcshard.core._ungathered import UngatheredParameterError as UngatheredParameterError
from funcshard.core._unit_options import UnitOptions as UnitOptions

__all__ = [
    "DonatedError",
    "FlatLayout",
    "Layout",
    "LocalGrads",
    "MixedPrecision",
    "Plan",
    "ShardedGrads",
    "ShardedState",
    "UngatheredParameterError",
    "Unit",
    "UnitOptions",
    "extract",
    "fold_in",
    "manual_seed",
    "plan",
    "rank_generator",
    "rank_seed",
]
