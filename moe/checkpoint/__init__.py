"""Loading pre-quantized MoE checkpoints as they are stored: expert tensors in, `moe.ExpertWeights` out.

`ExpertCheckpointLoader` takes a layer's expert tensors one at a time (per expert or fused,
HF or Mixtral names, with their scales), keeps this rank's experts and intermediate shard,
and builds the weights in hal's formats with nothing dequantized; `scheme()` gives the
matching quant scheme. `load_safetensors` feeds it from safetensors files;
`parse_expert_name` is the name mapping on its own. See docs/checkpoints.md.
"""

from moe.checkpoint.files import load_safetensors
from moe.checkpoint.formats import FORMATS, CheckpointFormat, FormatSpec, FusedLayout
from moe.checkpoint.loader import ExpertCheckpointLoader
from moe.checkpoint.names import (
    ExpertTensorName,
    NameStyle,
    Projection,
    TensorKind,
    expert_tensor_name,
    parse_expert_name,
)

__all__ = [
    "CheckpointFormat",
    "ExpertCheckpointLoader",
    "ExpertTensorName",
    "FORMATS",
    "FormatSpec",
    "FusedLayout",
    "NameStyle",
    "Projection",
    "TensorKind",
    "expert_tensor_name",
    "load_safetensors",
    "parse_expert_name",
]
