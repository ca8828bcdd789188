"""`WeightStore`: a layer's expert weights as registered buffers, so `nn.Module` machinery covers them.

`state_dict()` / `load_state_dict()` round-trip them (a fresh layer accepts a saved state
and builds its weights from it), `.to(device)` moves them. The stored formats are exact
(fp8 codes, packed nvfp4, scales): a dtype conversion (`.to(torch.float16)`, `.half()`)
leaves every stored tensor in its dtype and only moves it, since casting a quantized layout
or its scales would change the weights. Every tensor is copied in: the store never aliases
a caller's tensor.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from hal import Activation, InvalidInput, QuantizedWeight, ScaleLayout
from moe.schemes import ExpertWeights, QuantScheme

#: buffer name -> (ExpertWeights field, QuantizedWeight field or None for a plain tensor field)
_FIELDS: dict[str, tuple[str, str | None]] = {
    "w13_weight": ("w13", "data"),
    "w13_scale": ("w13", "scale"),
    "w13_global_scale": ("w13", "global_scale"),
    "w2_weight": ("w2", "data"),
    "w2_scale": ("w2", "scale"),
    "w2_global_scale": ("w2", "global_scale"),
    "w13_bias": ("w13_bias", None),
    "w2_bias": ("w2_bias", None),
    "input_global_scale": ("input_global_scale", None),
    "intermediate_global_scale": ("intermediate_global_scale", None),
}


#: The names of a weight store's buffers.
STORE_FIELDS = tuple(_FIELDS)


class WeightStore(torch.nn.Module):
    """Holds one `ExpertWeights` as buffers (`w13_weight`, `w13_scale`, ..., `w2_bias`).

    `layouts` are the weight layouts of `w13` and `w2` (from the layer's scheme), needed to
    rebuild the weights from a state dict; `activation` is the experts' activation.
    """

    def __init__(
        self, layouts: tuple[ScaleLayout, ScaleLayout], activation: Activation, device: torch.device | None = None
    ) -> None:
        super().__init__()
        self._device = device  #: where a state dict's tensors go when nothing is stored yet
        self._layouts = layouts
        self._activation = activation
        self._weights: ExpertWeights | None = None
        #: called after the weights change (load, state dict, device move); set by the owner (a bound method
        #: of it is held weakly: `OwnerCallback`)
        self.on_change: Callable[[], None] | None = None
        #: the vendor's `prepare_weight`, applied to weights that arrive through a state dict
        self.prepare: Callable[[QuantizedWeight], QuantizedWeight] | None = None
        #: which scheme's format the weights are in (`weight_form`), recorded in the state dict's metadata
        self.form: dict[str, str] | None = None

    @property
    def weights(self) -> ExpertWeights | None:
        """The stored weights (None before any load)."""
        return self._weights

    def store(self, weights: ExpertWeights) -> ExpertWeights:
        """Copy `weights` into buffers (replacing what was there) and return the stored view."""
        for name in _FIELDS:
            self._buffers.pop(name, None)
        for name, tensor in _tensors_of(weights).items():
            self.register_buffer(name, tensor.detach().clone())  # strides kept: a vendor's layout (K-major...)
        self._layouts = (weights.w13.layout, weights.w2.layout)
        self._activation = weights.activation
        return self._rebuild()

    def changed(self) -> ExpertWeights:
        """The buffers were written in place (experts moved): rebuild the weights' view and tell the owner."""
        return self._rebuild()

    def _rebuild(self, notify: bool = True) -> ExpertWeights:
        buffers = {name: t for name, t in self._buffers.items() if name in _FIELDS and t is not None}
        parts: dict[str, Any] = {}
        for proj, layout in zip(("w13", "w2"), self._layouts):
            if f"{proj}_weight" not in buffers:
                raise InvalidInput(f"expert weights: expected the tensor {self._prefix()}{proj}_weight, got none")
            parts[proj] = QuantizedWeight(
                buffers[f"{proj}_weight"], layout, buffers.get(f"{proj}_scale"), buffers.get(f"{proj}_global_scale")
            )
        for name in ("w13_bias", "w2_bias", "input_global_scale", "intermediate_global_scale"):
            parts[name] = buffers.get(name)
        self._weights = ExpertWeights(activation=self._activation, **parts)
        if notify and self.on_change is not None:
            self.on_change()
        return self._weights

    def _prefix(self) -> str:
        return getattr(self, "_state_prefix", "")

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> WeightStore:
        for name, tensor in list(self._buffers.items()):
            if tensor is None:
                continue
            moved = fn(tensor)
            if moved.dtype != tensor.dtype:  # a dtype conversion: move only, keep the exact format
                moved = tensor.to(device=moved.device)
            self._buffers[name] = moved
        if self._weights is not None:
            self._rebuild()
        return self

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", None)
        if self.form is not None and metadata is not None:
            metadata.setdefault(prefix[:-1], {})[FORM_KEY] = dict(self.form)

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # The buffers' shapes and dtypes follow the saved format, so they are taken as they are
        # (copied, on this store's device) instead of copied into tensors of a fixed shape.
        self._state_prefix = prefix
        saved = (local_metadata or {}).get(FORM_KEY)
        if self.form is not None and isinstance(saved, dict) and saved.get("scheme") != self.form["scheme"]:
            error_msgs.append(
                f"{prefix}: the state dict holds {describe_form(saved)} weights; this layer stores "
                f"{describe_form(self.form)}"
            )
            return
        found = {name: state_dict[prefix + name] for name in _FIELDS if prefix + name in state_dict}
        if strict:
            unexpected_keys.extend(
                key for key in state_dict if key.startswith(prefix) and key[len(prefix) :] not in _FIELDS
            )
        if not found:
            if strict and self._weights is not None:
                missing_keys.extend(prefix + name for name in self._buffers if name in _FIELDS)
            return
        device = next((t.device for t in self._buffers.values() if t is not None), self._device)
        for name, tensor in found.items():  # checked before anything stored is dropped
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                got = "a meta tensor (no data)" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                error_msgs.append(f"{prefix}{name}: expected a tensor with data, got {got}")
                return
        for name in _FIELDS:
            self._buffers.pop(name, None)
        for name, tensor in found.items():
            self.register_buffer(name, tensor.detach().to(device=device or tensor.device).clone())
        try:
            weights = self._rebuild(notify=self.prepare is None)
            if self.prepare is not None:  # a saved state may come from another vendor's layout
                self.store(dataclasses.replace(weights, w13=self.prepare(weights.w13), w2=self.prepare(weights.w2)))
        except InvalidInput as exc:
            error_msgs.append(f"{prefix}: {exc}")


#: The key of a weight store's entry in a state dict's metadata (`state_dict._metadata[prefix]`).
FORM_KEY = "weight_format"


def weight_form(scheme: QuantScheme, converted_from: QuantScheme | None = None) -> dict[str, str]:
    """The form a layer's weights are stored in: the scheme's name and, where they were converted at load
    from another scheme's format (a vendor's scheme fallback), that scheme's name."""
    form = {"scheme": scheme.name}
    if converted_from is not None:
        form["converted_from"] = converted_from.name
    return form


def describe_form(form: dict[str, Any]) -> str:
    """A form in words: `w8a8-int8 (converted at load from w8a8-fp8-block)`."""
    source = form.get("converted_from")
    return f"{form.get('scheme')}" + (f" (converted at load from {source})" if source else "")


def _tensors_of(weights: ExpertWeights) -> dict[str, torch.Tensor]:
    found = {}
    for name, (field, part) in _FIELDS.items():
        value = getattr(weights, field)
        if part is not None:
            value = getattr(value, part)
        if value is not None:
            found[name] = value
    return found


def with_activation(weights: ExpertWeights, activation: Activation) -> ExpertWeights:
    """`weights` computed with `activation`."""
    return dataclasses.replace(weights, activation=activation)


class OwnerCallback:
    """A bound method of the object that owns a store, held weakly: the owner (a layer) holds the store, so a
    strong reference back would make a cycle, and the layer, with its process group, would live until the
    garbage collector runs (at exit, after `destroy_process_group`, gloo can abort). A deep copy of the
    owner gets a callback to the copy."""

    def __init__(self, method: Callable[[], None]) -> None:
        self._method = weakref.WeakMethod(method)  # type: ignore[arg-type]
        self._name = method.__name__

    def __call__(self) -> None:
        method = self._method()
        if method is not None:
            method()

    def __deepcopy__(self, memo: dict[int, Any]) -> OwnerCallback:
        method = self._method()
        owner = None if method is None else memo.get(id(method.__self__))
        return self if owner is None else OwnerCallback(getattr(owner, self._name))

    def __reduce__(self) -> tuple[Any, ...]:
        method = self._method()
        if method is None:
            raise TypeError("a callback whose owner is gone cannot be pickled")
        return (OwnerCallback, (method,))
