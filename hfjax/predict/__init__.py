"""Predicted figures of a run: the cost model (HybridFlow §6's simulators) of a cluster, an algorithm's dataflow
and a workload — seconds per role and stage, memory per device — and its reading of a run config. The preflight's
memory check, `hfjax train --dry-run` and the auto-mapper (`hfjax.automap`) read it; nothing here compiles or runs
a program."""

from hfjax.predict.cluster import BUILTIN, ClusterSpec, DeviceProfile, calibrate_cpu, local_cpu
from hfjax.predict.cost import CostModel, DeviceMapping, InfeasibleError, Prediction, RoleCost
from hfjax.predict.dataflow import DATAFLOWS, PAPER_MODELS, Dataflow, ModelShape, Workload, dataflow, role_shapes
from hfjax.predict.memory_terms import CostOptions
from hfjax.predict.sizes import Sizes

__all__ = [
    "BUILTIN",
    "DATAFLOWS",
    "PAPER_MODELS",
    "ClusterSpec",
    "CostModel",
    "CostOptions",
    "Dataflow",
    "DeviceMapping",
    "DeviceProfile",
    "InfeasibleError",
    "ModelShape",
    "Prediction",
    "RoleCost",
    "Sizes",
    "Workload",
    "calibrate_cpu",
    "dataflow",
    "local_cpu",
    "role_shapes",
]
