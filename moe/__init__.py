"""moe: one generic Mixture-of-Experts layer, computed through `hal` on any vendor.

`route -> dispatcher.dispatch -> experts -> dispatcher.combine`, or the vendor's fused op
where it declares one for the layer's scheme. Imports only `hal` and torch.
"""

from moe.dispatch import (
    AllToAllDispatcher,
    DispatchFormat,
    DispatchOutput,
    Dispatcher,
    LocalDispatcher,
    LowLatencyDispatcher,
)
from moe.expert_load import ExpertLoad, LoadSnapshot, LoadStats, dump_expert_load
from moe.graphs import GraphConfig, LaunchPlans
from moe.placement import ExpertPlacement, balanced_placement, greedy_placement
from moe.layer import MoELayer
from moe.shared import SharedExperts
from moe.sharding import TensorShard
from moe.stages import StartedForward
from moe.routing import GroupedSigmoidTopK, GroupedTopK, Router, Routing, SigmoidTopK, SoftmaxTopK
from moe.runners import ExpertRunner, RunnerKey, RunnerRegistry, run_grouped_experts
from moe.schemes import (
    ExpertWeights,
    NvFp4,
    QuantScheme,
    Unquantized,
    W4A4Int4,
    W4A16MxFp4,
    W4A16NvFp4,
    W8A8Fp8,
    W8A8Fp8Block,
    W8A8Int8,
    make_scheme,
    nvfp4_global_scale,
)
from moe.checkpoint import CheckpointFormat, ExpertCheckpointLoader, load_safetensors, parse_expert_name

__all__ = [
    "AllToAllDispatcher",
    "DispatchFormat",
    "DispatchOutput",
    "Dispatcher",
    "LocalDispatcher",
    "LowLatencyDispatcher",
    "MoELayer",
    "GraphConfig",
    "LaunchPlans",
    "ExpertLoad",
    "LoadSnapshot",
    "LoadStats",
    "dump_expert_load",
    "ExpertPlacement",
    "balanced_placement",
    "greedy_placement",
    "GroupedSigmoidTopK",
    "GroupedTopK",
    "Router",
    "Routing",
    "SigmoidTopK",
    "SoftmaxTopK",
    "ExpertRunner",
    "RunnerKey",
    "RunnerRegistry",
    "run_grouped_experts",
    "ExpertWeights",
    "NvFp4",
    "QuantScheme",
    "Unquantized",
    "W4A4Int4",
    "W4A16MxFp4",
    "W4A16NvFp4",
    "W8A8Fp8Block",
    "W8A8Int8",
    "make_scheme",
    "nvfp4_global_scale",
    "SharedExperts",
    "StartedForward",
    "TensorShard",
    "W8A8Fp8",
    "CheckpointFormat",
    "ExpertCheckpointLoader",
    "load_safetensors",
    "parse_expert_name",
]
