"""Auto-mapping (HybridFlow §6): choose the placement of every model role, its devices and its layouts from a cost
model of the cluster, the algorithm's dataflow and the workload."""

from hfjax.automap.cluster import BUILTIN, ClusterSpec, DeviceProfile, calibrate_cpu, local_cpu
from hfjax.automap.cost import CostModel, CostOptions, DeviceMapping, InfeasibleError, Prediction, RoleCost
from hfjax.automap.dataflow import DATAFLOWS, PAPER_MODELS, Dataflow, ModelShape, Workload, dataflow, role_shapes
from hfjax.automap.report import print_breakdown, print_candidates
from hfjax.automap.search import Candidate, MappingSearch, SearchResult, automap, set_partitions
from hfjax.automap.sizes import Sizes

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
