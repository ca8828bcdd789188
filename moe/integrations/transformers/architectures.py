"""How to read each transformers MoE block: one `Architecture` entry per model family.

An entry names the block's class, where its router and experts live, how the experts'
tensors are laid out, the activation, the router (a `moe.Router` built from the HF
router's own settings), the shared experts and what the block returns. Everything is
read from the loaded block itself (weights, `top_k`, `norm_topk_prob`, correction bias);
the model config gives only the activation name and its parameters.

Adding a family is one entry: `Architecture(block_classes=("FooSparseMoeBlock",), ...)`
passed to `replace_moe_blocks(..., architectures={"foo": entry})`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from hal import Activation, InvalidInput, invalid
from moe import GroupedSigmoidTopK, Router, SigmoidTopK, SoftmaxTopK


class ExpertLayout(str, enum.Enum):
    """How a block stores its routed experts' tensors."""

    #: fused `gate_up_proj` `[E, 2I, H]` (`[gate | up]` rows, as `nn.Linear` stores them) and
    #: `down_proj` `[E, H, I]` (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3 in transformers 5)
    FUSED_OUT_IN = "fused-out-in"
    #: fused `gate_up_proj` `[E, H, 2I]` (`[gate | up]` columns) and `down_proj` `[E, I, H]` (Llama-4)
    FUSED_IN_OUT = "fused-in-out"
    #: fused `gate_up_proj` `[E, H, 2I]` with gate and up columns interleaved (gate at even
    #: columns), `down_proj` `[E, I, H]`, biases `gate_up_proj_bias` / `down_proj_bias` (gpt-oss)
    FUSED_IN_OUT_INTERLEAVED = "fused-in-out-interleaved"
    #: an `nn.ModuleList` of MLPs with `gate_proj`/`up_proj`/`down_proj` (or `w1`/`w3`/`w2`)
    #: `nn.Linear`s (transformers 4 and remote-code models)
    PER_EXPERT = "per-expert"


class Returns(str, enum.Enum):
    """What a block's `forward` returns, besides the hidden states of the input's shape."""

    HIDDEN = "hidden"  #: the output tensor only
    HIDDEN_AND_SCORES = "hidden+scores"  #: `(output, routing weights [T, k])` (gpt-oss)
    FLAT_AND_LOGITS = "flat+logits"  #: `(output [T, H], router logits [T, E])` (Llama-4)


@dataclass(frozen=True)
class ExpertTensors:
    """A block's routed experts in `MoELayer.load_weights` form (views of the block's tensors)."""

    w13: torch.Tensor  #: `[E, H, 2I]`, `[gate | up]`
    w2: torch.Tensor  #: `[E, I, H]`
    w13_bias: torch.Tensor | None = None  #: `[E, 2I]`
    w2_bias: torch.Tensor | None = None  #: `[E, H]`


@dataclass(frozen=True)
class SharedTensors:
    """A block's shared expert in `MoELayer.load_shared_experts` form."""

    w13: torch.Tensor  #: `[H, 2Is]`, `[gate | up]`
    w2: torch.Tensor  #: `[Is, H]`
    gate: torch.Tensor | None = None  #: `[H]`, scales the output by `sigmoid(x @ gate)`

    @property
    def intermediate_size(self) -> int:
        """Is, the shared MLP's intermediate size."""
        return self.w2.shape[0]


# --- activations -----------------------------------------------------------------------

#: HF `hidden_act` names -> the gated activation of an MLP `act(gate) * up`
_GLU_OF_ACT = {
    "silu": "silu-glu",
    "swish": "silu-glu",
    "gelu": "gelu-glu",
    "gelu_pytorch_tanh": "gelu-tanh-glu",
    "gelu_new": "gelu-tanh-glu",
    "gelu_fast": "gelu-tanh-glu",
}


def glu_of(config: Any) -> Activation:
    """The gated activation `act(gate) * up` of the config's `hidden_act`."""
    act = getattr(config, "hidden_act", None)
    kind = _GLU_OF_ACT.get(act) if isinstance(act, str) else None
    if kind is None:
        raise invalid("config.hidden_act", f"one of {', '.join(sorted(_GLU_OF_ACT))}", act)
    return Activation.parse(kind)


def gpt_oss_activation(config: Any) -> Activation:
    """gpt-oss's clamped SwiGLU with the config's `swiglu_alpha` and `swiglu_limit`."""
    return Activation(
        "swiglu-oai", alpha=getattr(config, "swiglu_alpha", 1.702), limit=getattr(config, "swiglu_limit", 7.0)
    )


RouterFactory = Callable[[torch.nn.Module, int, int], Router]
ActivationRule = Callable[[Any], Activation]


@dataclass(frozen=True)
class Architecture:
    """How to turn one model family's MoE block into a `moe.MoELayer`.

    - `block_classes`: class names of the block to replace (matched on the loaded model).
    - `router`, `experts`: attribute names of the HF router (weight `[E, H]`, optional
      `bias` `[E]`, `top_k`) and experts inside the block; `layout` how the experts are stored.
    - `make_router(hf_router, num_experts, top_k)`: the `moe.Router` that routes as HF does.
    - `activation(config)`: the experts' activation from the (text) model config.
    - `logits_dtype`: the dtype HF computes router logits in (None: the hidden states' dtype);
      `logits_index`: where the logits are in the HF router's output tuple.
    - `shared`, `shared_gate`: attribute names of the shared-expert MLP and its gate `Linear(H, 1)`.
    - `returns`: the structure the block's `forward` returns.
    """

    block_classes: tuple[str, ...]
    make_router: RouterFactory
    router: str = "gate"
    experts: str = "experts"
    layout: ExpertLayout = ExpertLayout.FUSED_OUT_IN
    activation: ActivationRule = glu_of
    logits_dtype: torch.dtype | None = None
    logits_index: int = 0
    shared: str | None = None
    shared_gate: str | None = None
    returns: Returns = Returns.HIDDEN

    def matches(self, module: torch.nn.Module) -> bool:
        """True when `module` is one of this family's MoE blocks."""
        return type(module).__name__ in self.block_classes

    def read_experts(self, block: torch.nn.Module) -> ExpertTensors:
        """The block's routed experts as `[E, H, 2I]` / `[E, I, H]` tensors (and biases)."""
        return read_experts(_attr(block, self.experts), self.layout)

    def read_shared(self, block: torch.nn.Module) -> SharedTensors | None:
        """The block's shared expert (None when the family has none)."""
        if self.shared is None:
            return None
        w13, w2 = _mlp_tensors(_attr(block, self.shared), f"{type(block).__name__}.{self.shared}")
        gate = None
        if self.shared_gate is not None:
            gate = _attr(block, self.shared_gate).weight.detach().reshape(-1)
        return SharedTensors(w13, w2, gate)

    def router_module(self, block: torch.nn.Module) -> torch.nn.Module:
        """The HF router module of `block` (holds `weight` `[E, H]`)."""
        return _attr(block, self.router)


# --- readers and routers ---------------------------------------------------------------


def _attr(module: torch.nn.Module, name: str) -> Any:
    found = getattr(module, name, None)
    if found is None:
        raise invalid(
            f"{type(module).__name__}.{name}",
            "a submodule or tensor named by the Architecture entry",
            "no such attribute",
        )
    return found


def read_experts(experts: Any, layout: ExpertLayout) -> ExpertTensors:
    """Read routed experts stored as `layout` into `load_weights` form (no copies where none are needed)."""
    if layout is ExpertLayout.PER_EXPERT:
        pairs = [_mlp_tensors(mlp, f"experts[{e}]") for e, mlp in enumerate(experts)]
        return ExpertTensors(torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    gate_up = experts.gate_up_proj.detach()
    down = experts.down_proj.detach()
    up_bias = getattr(experts, "gate_up_proj_bias", None)
    down_bias = getattr(experts, "down_proj_bias", None)
    up_bias = up_bias.detach() if up_bias is not None else None
    down_bias = down_bias.detach() if down_bias is not None else None
    if layout is ExpertLayout.FUSED_OUT_IN:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    elif layout is ExpertLayout.FUSED_IN_OUT_INTERLEAVED:
        gate_up = torch.cat((gate_up[..., 0::2], gate_up[..., 1::2]), dim=-1)
        if up_bias is not None:
            up_bias = torch.cat((up_bias[..., 0::2], up_bias[..., 1::2]), dim=-1)
    if (
        gate_up.dim() != 3
        or down.dim() != 3
        or gate_up.shape[0] != down.shape[0]
        or gate_up.shape[2] != 2 * down.shape[1]
        or gate_up.shape[1] != down.shape[2]
    ):
        raise invalid(
            "experts.gate_up_proj, experts.down_proj",
            f"tensors of the {layout.value} layout ([E, H, 2I] and [E, I, H] once read)",
            f"{tuple(experts.gate_up_proj.shape)} and {tuple(experts.down_proj.shape)}",
        )
    return ExpertTensors(gate_up, down, up_bias, down_bias)


def _mlp_tensors(mlp: Any, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(w13 [H, 2I], w2 [I, H])` of a gated MLP with `gate_proj/up_proj/down_proj` or `w1/w3/w2`."""
    for gate_name, up_name, down_name in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        gate, up, down = (getattr(mlp, n, None) for n in (gate_name, up_name, down_name))
        if gate is not None and up is not None and down is not None:
            for name, linear in ((gate_name, gate), (up_name, up), (down_name, down)):
                if getattr(linear, "bias", None) is not None:
                    raise InvalidInput(f"{where}.{name}: expected a Linear without bias, got one with a bias")
            w13 = torch.cat((gate.weight.detach().t(), up.weight.detach().t()), dim=1)
            return w13, down.weight.detach().t()
    raise invalid(where, "a gated MLP with gate_proj/up_proj/down_proj (or w1/w3/w2)", type(mlp).__name__)


def softmax_topk(renormalize: bool | None = None) -> RouterFactory:
    """Softmax over all experts, top-k; renormalized when `renormalize` is True, or, when it
    is None, as the HF router's `norm_topk_prob` says."""

    def make(hf_router: torch.nn.Module, num_experts: int, top_k: int) -> Router:
        norm = renormalize if renormalize is not None else bool(getattr(hf_router, "norm_topk_prob", False))
        return SoftmaxTopK(num_experts, top_k, renormalize=norm)

    return make


def deepseek_v3_router(hf_router: torch.nn.Module, num_experts: int, top_k: int) -> Router:
    """Grouped sigmoid top-k with the router's correction bias, groups, scaling and renormalization."""
    bias = getattr(hf_router, "e_score_correction_bias", None)
    return GroupedSigmoidTopK(
        num_experts,
        top_k,
        num_groups=int(hf_router.num_group),
        topk_groups=int(hf_router.topk_group),
        correction_bias=bias.detach().to(torch.float32).clone() if bias is not None else None,
        renormalize=bool(hf_router.norm_topk_prob),
        routed_scaling_factor=float(hf_router.routed_scaling_factor),
    )


def llama4_router(hf_router: torch.nn.Module, num_experts: int, top_k: int) -> Router:
    """Top-k of the logits weighted by their sigmoid, the weight scaling the expert's input (Llama-4)."""
    return SigmoidTopK(num_experts, top_k, weights_on_input=True)


_SOFTMAX_NORM = softmax_topk()

#: model_type -> how its MoE blocks are read (`config.get_text_config().model_type`)
ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        "qwen3_moe": Architecture(("Qwen3MoeSparseMoeBlock",), _SOFTMAX_NORM),
        "olmoe": Architecture(("OlmoeSparseMoeBlock",), _SOFTMAX_NORM),
        "mixtral": Architecture(("MixtralSparseMoeBlock",), softmax_topk(renormalize=True)),
        "qwen2_moe": Architecture(
            ("Qwen2MoeSparseMoeBlock",), _SOFTMAX_NORM, shared="shared_expert", shared_gate="shared_expert_gate"
        ),
        "deepseek_v3": Architecture(
            ("DeepseekV3MoE",), deepseek_v3_router, logits_dtype=torch.float32, shared="shared_experts"
        ),
        "gpt_oss": Architecture(
            ("GptOssMLP",),
            softmax_topk(renormalize=True),
            router="router",
            layout=ExpertLayout.FUSED_IN_OUT_INTERLEAVED,
            activation=gpt_oss_activation,
            returns=Returns.HIDDEN_AND_SCORES,
        ),
        "llama4_text": Architecture(
            ("Llama4TextMoe",),
            llama4_router,
            router="router",
            logits_index=1,
            layout=ExpertLayout.FUSED_IN_OUT,
            shared="shared_expert",
            returns=Returns.FLAT_AND_LOGITS,
        ),
    }
)
