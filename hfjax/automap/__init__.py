"""Choosing and checking layouts (HybridFlow §6's auto-mapping and what checks it): the search over placements and
layouts priced by the cost model (`hfjax.predict`), its calibration from measured sweeps, compile-for-target
(`hfjax.automap.compiled`: the compiler's figures), the measured sweep and the measured layout-pair comparison.
The cost model's names are re-exported here for the auto-mapper's users."""

from hfjax.automap.report import print_breakdown, print_candidates
from hfjax.automap.search import Candidate, MappingSearch, SearchResult, automap, set_partitions
from hfjax.predict import (
    BUILTIN,
    DATAFLOWS,
    PAPER_MODELS,
    ClusterSpec,
    CostModel,
    CostOptions,
    Dataflow,
    DeviceMapping,
    DeviceProfile,
    InfeasibleError,
    ModelShape,
    Prediction,
    RoleCost,
    Sizes,
    Workload,
    calibrate_cpu,
    dataflow,
    local_cpu,
    role_shapes,
)

__all__ = [
    "BUILTIN",
    "DATAFLOWS",
    "PAPER_MODELS",
    "Candidate",
    "ClusterSpec",
    "CostModel",
    "CostOptions",
    "Dataflow",
    "DeviceMapping",
    "DeviceProfile",
    "InfeasibleError",
    "MappingSearch",
    "ModelShape",
    "Prediction",
    "RoleCost",
    "SearchResult",
    "Sizes",
    "Workload",
    "automap",
    "calibrate_cpu",
    "dataflow",
    "local_cpu",
    "print_breakdown",
    "print_candidates",
    "role_shapes",
    "set_partitions",
]
