"""The public torch reference implementation of every hal op, device-agnostic, with no vendor identity.

- `ReferenceOps`: the op implementations a vendor builds on (subclass it, override what
  your runtime accelerates); the CPU vendor uses it as it is.
- The functions behind it, usable on their own: `quantize` / `dequantize` (activations,
  every dispatch dtype of `hal.DTYPES`), `quantize_weight` / `dequantize_weight`,
  `quantize_int4` / `dequantize_int4` / `pack_int4` / `unpack_int4`, `grouped_matmul`,
  `add_expert_bias`, `swiglu`, `activate` (every `hal.ActivationKind`), `softmax_topk`, `sort_by_expert`,
  `weighted_combine`.
- `sort_received` / `reduce_received`: the experts' side of token-wise expert parallelism (the
  rows of received tokens sorted by local expert, and each token's partial sum sent back).
- `activation_value` / `weight_value`: the float64 value of any operand, straight from the
  formats' definitions (what references and the conformance suite compare against).

Importing this package is allowed from every layer (it is named in the import contracts).
"""

from hal.reference.activation import activate, swiglu
from hal.reference.bias import add_expert_bias
from hal.reference.grouped_matmul import grouped_matmul
from hal.reference.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from hal.reference.ops import ReferenceOps
from hal.reference.permute import sort_by_expert, weighted_combine
from hal.reference.quantize import dequantize, quantize
from hal.reference.received import ReceivedTokens, reduce_received, sort_received
from hal.reference.routing import softmax_topk
from hal.reference.values import activation_value, decode_e2m1, decode_int4, weight_value
from hal.reference.weights import dequantize_weight, quantize_weight

__all__ = [
    "ReferenceOps",
    "quantize",
    "dequantize",
    "quantize_weight",
    "dequantize_weight",
    "quantize_int4",
    "dequantize_int4",
    "pack_int4",
    "unpack_int4",
    "grouped_matmul",
    "add_expert_bias",
    "swiglu",
    "activate",
    "softmax_topk",
    "sort_by_expert",
    "weighted_combine",
    "activation_value",
    "weight_value",
    "decode_e2m1",
    "decode_int4",
    "ReceivedTokens",
    "sort_received",
    "reduce_received",
]
