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
from moe.layer import MoELayer
from moe.routing import GroupedSigmoidTopK, Router, Routing, SoftmaxTopK
from moe.runners import ExpertRunner, RunnerKey, RunnerRegistry, run_grouped_experts
from moe.schemes import (
    ExpertWeights,
    NvFp4,
    QuantScheme,
    Unquantized,
    W4A4Int4,
    W8A8Fp8Block,
    W8A8Int8,
    make_scheme,
    nvfp4_global_scale,
)

__all__ = [
    "AllToAllDispatcher", "DispatchFormat", "DispatchOutput", "Dispatcher", "LocalDispatcher",
    "LowLatencyDispatcher", "MoELayer", "GroupedSigmoidTopK", "Router", "Routing", "SoftmaxTopK",
    "ExpertRunner", "RunnerKey", "RunnerRegistry", "run_grouped_experts",
    "ExpertWeights", "NvFp4", "QuantScheme", "Unquantized", "W4A4Int4", "W8A8Fp8Block", "W8A8Int8",
    "make_scheme", "nvfp4_global_scale",
]
