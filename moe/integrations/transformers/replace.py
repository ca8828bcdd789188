"""Swap a transformers model's MoE blocks for `MoEBlock`s (and back)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hal import DispatchConfig, InvalidInput, Vendor, invalid, refuse_non_finite
from moe import MoELayer, QuantScheme, SharedExperts, Unquantized, make_scheme
from moe.arguments import choose_vendor
from moe.integrations.transformers.architectures import ARCHITECTURES, Architecture
from moe.integrations.transformers.block import MoEBlock

SchemeChoice = QuantScheme | str | Callable[[str], QuantScheme] | None
#: MoELayer arguments an Architecture entry derives from the block
_FROM_THE_BLOCK = frozenset({"router", "activation", "bias", "shared_experts"})


def architecture_of(
    model: torch.nn.Module, architectures: Mapping[str, Architecture] | None = None
) -> tuple[str, Architecture]:
    """The model type and `Architecture` entry of a transformers model.

    Looks up `model.config.model_type`, then its text config's (multimodal wrappers); the
    entries of `architectures` extend or override the built-in `ARCHITECTURES`. Raises
    `InvalidInput` naming the model type and the known ones when there is no entry.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise invalid("model", "a transformers model (with a config.model_type)", type(model).__name__)
    table = {**ARCHITECTURES, **(architectures or {})}
    for model_type in _model_types(config):
        if model_type in table:
            return model_type, table[model_type]
    raise InvalidInput(
        f"model: expected a model type with an MoE adapter ({', '.join(sorted(table))}), "
        f"got {config.model_type!r}; add one with architectures={{{config.model_type!r}: Architecture(...)}}"
    )


def _model_types(config: Any) -> list[str]:
    types = [config.model_type]
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else None
    if text is not None and getattr(text, "model_type", None) not in (None, config.model_type):
        types.append(text.model_type)
    return types


def _text_config(config: Any) -> Any:
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def replace_moe_blocks(
    model: torch.nn.Module,
    *,
    vendor: Vendor | str | None = None,
    scheme: SchemeChoice = None,
    dispatch: DispatchConfig | None = None,
    architectures: Mapping[str, Architecture] | None = None,
    keep_original: bool = True,
    record_router_logits: bool = False,
    **layer_options: Any,
) -> list[str]:
    """Replace every MoE block of a loaded transformers `model` by a `MoEBlock` computing it
    through a `moe.MoELayer` built from that block's own weights; returns the replaced
    module names (`"model.layers.1.mlp"`, ...). Dense layers stay as they are.

    - `vendor`: a `hal.Vendor`, its name, or None for `hal.get_vendor()`; resolved once.
    - `scheme`: None or `"unquantized"` keeps the model's weight dtype
      (`moe.Unquantized(dtype)`, dispatched in that dtype where the vendor declares it); a
      name or `moe.QuantScheme` quantizes every block alike; a callable `scheme(module_name)`
      gives each block its own (NVFP4 global scales).
    - `dispatch`: the layers' `hal.DispatchConfig`.
    - `architectures`: extra or overriding `Architecture` entries by model type.
    - `keep_original`: keep the HF blocks for `restore_moe_blocks` (False frees their expert
      weights once nothing else holds them, and makes the swap one-way).
    - `record_router_logits`: call the HF router module for the logits instead of a plain
      linear, so that transformers' `output_router_logits=True` records them (and its
      auxiliary loss works); costs the HF router's own top-k per block. Without it, a
      forward with `output_router_logits=True` finds no router logits.
    - `layer_options`: other `MoELayer` keyword arguments (`fused`, `runners`, `environ`,
      `process_group`, `tp_group`, ...); the router, activation, bias and shared experts
      come from the block.

    The model is meant for inference: the layer's weights are inference buffers. Raises
    `InvalidInput` for a model type without an entry, a model without any MoE block, or a block's
    tensor holding inf or NaN or no data (meta; named by its key); a refused call replaces no block.
    """
    for name, flag in (("keep_original", keep_original), ("record_router_logits", record_router_logits)):
        if not isinstance(flag, bool):
            raise invalid(name, "True or False", flag)
    taken = sorted(set(layer_options) & _FROM_THE_BLOCK)
    if taken:
        raise invalid(", ".join(taken), "nothing: the architecture entry sets it from the block", "a value")
    model_type, architecture = architecture_of(model, architectures)
    config = _text_config(model.config)
    chosen_vendor = choose_vendor(vendor, layer_options.get("environ"))
    found = [(name, module) for name, module in model.named_modules() if architecture.matches(module)]
    if not found:
        already = any(isinstance(module, MoEBlock) for module in model.modules())
        raise InvalidInput(
            f"model: expected MoE blocks of class {' or '.join(architecture.block_classes)} in this "
            f"{model_type!r} model, got none" + ("; its blocks are already replaced" if already else "")
        )
    wrappers = []
    with torch.no_grad():  # every block checked and built before the first is swapped: all or nothing
        for name, block in found:
            refuse_non_finite_tensors(name, block)
            layer = build_layer(
                architecture,
                block,
                config,
                vendor=chosen_vendor,
                dispatch=dispatch,
                scheme=_scheme_for(scheme, name, architecture, block),
                **layer_options,
            )
            wrapper = MoEBlock(
                layer,
                architecture.router_module(block),
                architecture,
                model_type,
                block if keep_original else None,
                record_router_logits,
            )
            wrappers.append((name, wrapper))
    for name, wrapper in wrappers:
        model.set_submodule(name, wrapper)
    return [name for name, _ in found]


def refuse_non_finite_tensors(name: str, block: torch.nn.Module) -> None:
    """`InvalidInput` naming the first parameter or buffer of `block` (the module `name`) that holds inf or NaN,
    or no data (on the meta device: a router's logits would be whatever memory held): routed and shared experts,
    their biases, the shared-expert gate, the router."""
    for key, t in (*block.named_parameters(), *block.named_buffers()):
        where = f"{name}.{key}" if name else key
        if t.is_meta:
            raise invalid(
                where, "a tensor with data (the model's weights loaded, not on the meta device)", "a meta tensor"
            )
        refuse_non_finite(where, t.detach())


def restore_moe_blocks(model: torch.nn.Module) -> list[str]:
    """Put back the HF blocks that `replace_moe_blocks` replaced; returns their module names.

    Raises `InvalidInput` (and changes nothing) if a block was replaced with
    `keep_original=False`.
    """
    wrappers = [(name, module) for name, module in model.named_modules() if isinstance(module, MoEBlock)]
    lost = [name for name, wrapper in wrappers if wrapper.original is None]
    if lost:
        raise InvalidInput(
            f"model: expected the original blocks of {', '.join(lost)}, got none "
            "(they were replaced with keep_original=False)"
        )
    for name, wrapper in wrappers:
        model.set_submodule(name, wrapper.original)
    return [name for name, _ in wrappers]


def _scheme_for(scheme: SchemeChoice, name: str, architecture: Architecture, block: torch.nn.Module) -> QuantScheme:
    if callable(scheme) and not isinstance(scheme, (QuantScheme, str)):
        return _scheme_for(scheme(name), name, architecture, block)
    if scheme is None or (isinstance(scheme, str) and scheme.strip().lower() == "unquantized"):
        dtype = architecture.read_experts(block).w13.dtype
        return Unquantized(dtype)
    return make_scheme(scheme)


def build_layer(architecture: Architecture, block: torch.nn.Module, config: Any, **layer_kwargs: Any) -> MoELayer:
    """A `MoELayer` computing `block` (routed experts, biases, shared experts) with its weights.

    `layer_kwargs` go to the `MoELayer` constructor (scheme, vendor, dispatch, ...); the
    router, activation, bias and shared experts come from the block and `config`.
    """
    experts = architecture.read_experts(block)
    hf_router = architecture.router_module(block)
    num_experts, hidden = hf_router.weight.shape
    top_k = int(getattr(hf_router, "top_k", getattr(config, "num_experts_per_tok", 0)))
    if tuple(experts.w13.shape[:2]) != (num_experts, hidden):
        raise invalid(
            f"{type(block).__name__} experts",
            f"{num_experts} experts of hidden size {hidden} (the router's weight shape)",
            tuple(experts.w13.shape),
        )
    shared = architecture.read_shared(block)
    shared_experts = None if shared is None else SharedExperts(shared.intermediate_size, gated=shared.gate is not None)
    kwargs: dict[str, Any] = dict(
        layer_kwargs,
        router=architecture.make_router(hf_router, num_experts, top_k),
        activation=architecture.activation(config),
        bias=experts.w13_bias is not None or experts.w2_bias is not None,
        shared_experts=shared_experts,
    )
    layer = MoELayer(hidden, experts.w2.shape[1], num_experts, top_k, **kwargs)
    layer.load_weights(experts.w13, experts.w2, w13_bias=experts.w13_bias, w2_bias=experts.w2_bias)
    if shared is not None:
        layer.load_shared_experts(shared.w13, shared.w2, gate=shared.gate)
    return layer
