"""How a `MoELayer` takes its weights: float weights it quantizes, or weights already in hal's formats.

Both paths keep this rank's experts (expert parallelism) and its share of the intermediate
dimension (tensor parallelism, `moe.sharding`), hand the weights to the vendor to prepare
once (`hal.Vendor.prepare_weight`) and copy them into the layer's buffers; the caller's
tensors are never aliased. Checkpoint loaders (`moe.checkpoint`) build the `ExpertWeights`
that `load_expert_weights` takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from hal import HalError, InvalidInput, QuantizedWeight, invalid, refuse_non_finite
from moe.arguments import with_data
from moe.load_checks import (
    dtype_name,
    e8m0_tensors,
    float_tensor,
    non_finite_problems,
    refuse_non_finite_weights,
    state_problems,
    store_tensors,
)
from moe.load_transaction import Snapshot
from moe.scheme_conversion import convert_float, convert_quantized, holds_format
from moe.schemes import ExpertWeights, check_float_weights
from moe.weight_store import STORE_FIELDS

if TYPE_CHECKING:
    from moe.layer import MoELayer


class ExpertLoading:
    """The weight-loading methods of `MoELayer`.

    Every load is checked before anything is stored (shapes, dtypes, finite values, each named by its
    key) and is all or nothing: a refused load leaves the forward and `state_dict()` as they were.
    """

    def load_weights(
        self: MoELayer,
        w13: torch.Tensor,
        w2: torch.Tensor,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> MoELayer:
        """Float weights of all experts and the full intermediate size, quantized through the scheme:
        `w13` `[E, H, 2I]` (`[gate | up]`; `[E, H, I]` for a plain activation), `w2` `[E, I, H]`, biases
        `[E, 2I]` / `[E, H]` (required when the layer has `bias=True`, refused otherwise)."""
        gated = self.activation.gated
        check_float_weights(w13, w2, gated=gated)
        i, h, e = self.intermediate_size, self.hidden_size, self.num_experts
        width = self.activation.input_width(i)
        if (tuple(w13.shape), tuple(w2.shape)) != ((e, h, width), (e, i, h)):
            raise invalid(
                "w13, w2", f"shapes {(e, h, width)} and {(e, i, h)}", f"{tuple(w13.shape)} and {tuple(w2.shape)}"
            )
        b13, b2 = _check_biases(self.bias, w13_bias, w2_bias, (e, width), (e, h))
        refuse_non_finite("w13", w13)
        refuse_non_finite("w2", w2)
        logical = self.local_logical_experts
        contiguous = logical == tuple(range(logical[0], logical[0] + len(logical)))
        mine: slice | list[int] = slice(logical[0], logical[0] + len(logical)) if contiguous else list(logical)
        shard, device = self.tensor_shard, self.vendor.device
        w13_local = shard.first_projection(w13[mine], i, gated).to(device)
        w2_local = shard.second_projection(w2[mine], i).to(device)
        weights = self._quantized(w13_local, w2_local)
        if b13 is not None:
            b13 = shard.first_projection(b13[mine], i, gated)
            b2 = shard.down_bias(b2[mine])  # type: ignore[index]
        weights = dataclasses.replace(weights, w13_bias=_fp32(b13, device), w2_bias=_fp32(b2, device))
        _refuse_overflow(weights)
        with self._all_or_nothing():
            self.experts.store(weights)
        return self

    def load_expert_weights(self: MoELayer, weights: ExpertWeights) -> MoELayer:
        """Weights already in hal's formats (`hal.QuantizedWeight`, e.g. from `moe.checkpoint`) for this
        rank's experts and intermediate shard only; the vendor prepares them once, the layer copies them."""
        if not isinstance(weights, ExpertWeights):
            raise invalid("weights", "a moe.ExpertWeights", type(weights).__name__)
        weights = self._checked_weights(
            weights, "expert weights", self.dispatcher.num_local_experts, self.local_intermediate_size, routed=True
        )
        with self._all_or_nothing():
            self.experts.store(weights)
        return self

    def load_shared_experts(
        self: MoELayer, w13: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor | None = None
    ) -> MoELayer:
        """The shared experts' float weights, full size: `w13` `[H, 2Is]` (`[gate | up]`; `[H, Is]` plain),
        `w2` `[Is, H]`, and the `[H]` gate weight when they are gated; quantized through the scheme."""
        block = self._shared_block()
        with_data("gate", gate)
        size = block.config.intermediate_size
        h, gated = self.hidden_size, self.activation.gated
        want = ((h, self.activation.input_width(size)), (size, h))
        got = tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (w13, w2))
        if got != want:
            raise invalid("shared expert w13, w2", f"shapes {want[0]} and {want[1]}", f"{got[0]} and {got[1]}")
        check_float_weights(w13[None], w2[None], gated=gated)
        refuse_non_finite("shared expert w13", w13)
        refuse_non_finite("shared expert w2", w2)
        shard, device = self.tensor_shard, self.vendor.device
        w13_local = shard.first_projection(w13, size, gated)[None].to(device)
        w2_local = shard.second_projection(w2, size)[None].to(device)
        weights = self._quantized(w13_local, w2_local)
        _refuse_overflow(weights, "shared expert ")
        with self._all_or_nothing():
            block.load(weights, gate, h)
        return self

    def load_shared_expert_weights(
        self: MoELayer, weights: ExpertWeights, gate: torch.Tensor | None = None
    ) -> MoELayer:
        """The shared experts in hal's formats (one expert, this rank's intermediate shard) and their gate."""
        block = self._shared_block()
        if not isinstance(weights, ExpertWeights):
            raise invalid("weights", "a moe.ExpertWeights", type(weights).__name__)
        with_data("gate", gate)
        size = self.tensor_shard.local_size(block.config.intermediate_size, "shared_experts.intermediate_size")
        checked = self._checked_weights(weights, "shared expert weights", 1, size, routed=False)
        with self._all_or_nothing():
            block.load(checked, gate, self.hidden_size)
        return self

    def _quantized(self: MoELayer, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Float weights in the running scheme's format; where the vendor runs a fallback scheme, first as the
        scheme asked for stores them (`moe.scheme_conversion`)."""

        def quantize(a: torch.Tensor, b: torch.Tensor) -> ExpertWeights:
            return self.scheme.quantize_weights(self.vendor, a, b, activation=self.activation)

        if self.source_scheme is None:
            return quantize(w13, w2)
        return convert_float(self.source_scheme, quantize, w13, w2, self.vendor.device)

    def _running_form(self: MoELayer, weights: ExpertWeights, what: str) -> ExpertWeights:
        """Weights in the format of the scheme asked for, converted to the running scheme's (see `_quantized`);
        weights already in the running scheme's format as they are."""
        source = self.source_scheme
        if source is None or holds_format(self.scheme, weights.w13):
            return weights
        for name in ("w13", "w2"):
            if not holds_format(source, getattr(weights, name)):
                w = getattr(weights, name)
                raise invalid(
                    f"{what}.{name}",
                    f"{source.name} or {self.scheme.name} weights (this layer converts {source.name} at load)",
                    f"{w.layout} {w.data.dtype}",
                )
        return convert_quantized(
            lambda a, b: self.scheme.quantize_weights(self.vendor, a, b, activation=weights.activation),
            weights,
            self.vendor.device,
        )

    def _shared_block(self: MoELayer) -> Any:
        if self.shared_experts is None:
            raise InvalidInput(
                "shared experts: expected a layer built with shared_experts=moe.SharedExperts(...), got one without"
            )
        return self.shared_experts

    def _checked_weights(
        self: MoELayer, weights: ExpertWeights, what: str, experts: int, intermediate: int, *, routed: bool
    ) -> ExpertWeights:
        for name in ("w13", "w2"):
            for part in ("data", "scale", "global_scale"):
                with_data(f"weights.{name}.{part}", getattr(getattr(weights, name), part))
        for name in ("w13_bias", "w2_bias", "input_global_scale", "intermediate_global_scale"):
            value = getattr(weights, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise invalid(f"weights.{name}", "a torch.Tensor or None", type(value).__name__)
            with_data(f"weights.{name}", value)
        refuse_non_finite_weights(what, weights)
        weights = self._running_form(weights, what)
        spec = self.scheme.gemm_kind().spec
        for name in ("w13", "w2"):
            w: QuantizedWeight = getattr(weights, name)
            if not spec.pairs_with(w):  # the layout and the storage dtype (int8 vs fp8 per-channel)
                raise invalid(
                    f"{what}.{name}",
                    f"{spec.weight_layout} weights stored as {dtype_name(spec.weight_storage)} (scheme {self.scheme.name})",
                    f"{w.layout} weights stored as {dtype_name(w.data.dtype)}",
                )
        width = self.activation.input_width(intermediate)
        shape = (weights.num_experts, weights.hidden_size, weights.w13.out_features, weights.intermediate_size)
        if shape != (experts, self.hidden_size, width, intermediate):
            raise invalid(
                what,
                f"[E, H, W, I] = {[experts, self.hidden_size, width, intermediate]} "
                "(this rank's experts and intermediate shard)",
                list(shape),
            )
        if routed and weights.has_bias and not self.bias:
            raise InvalidInput(f"{what}: expected no biases (the layer was built with bias=False), got biases")
        if routed and self.bias and (weights.w13_bias is None or weights.w2_bias is None):
            raise InvalidInput(
                f"{what}: expected w13_bias and w2_bias (the layer was built with bias=True), "
                "got " + ("none" if not weights.has_bias else "only one")
            )
        device, vendor = self.vendor.device, self.vendor
        moved = dataclasses.replace(
            weights,
            w13=vendor.prepare_weight(_to(weights.w13, device)),
            w2=vendor.prepare_weight(_to(weights.w2, device)),
            w13_bias=_fp32(weights.w13_bias, device),
            w2_bias=_fp32(weights.w2_bias, device),
            input_global_scale=_on(weights.input_global_scale, device),
            intermediate_global_scale=_on(weights.intermediate_global_scale, device),
            activation=self.activation,
        )
        return moved


def _refuse_overflow(weights: ExpertWeights, what: str = "") -> None:
    """Finite inputs can still overflow where the layer stores a narrower dtype (fp32 1e5 as fp16, a
    float64 bias of 1e300 as fp32): refused before anything is stored, naming the tensor."""
    parts = {f"{name}.{part}": t for name in ("w13", "w2") for part, t in getattr(weights, name).tensors().items()}
    parts.update({name: getattr(weights, name) for name in ("w13_bias", "w2_bias")})
    for name, t in parts.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1:
            overflow = int((~torch.isfinite(t)).sum())
            if overflow:
                raise InvalidInput(
                    f"{what}{name.removesuffix('.data')}: expected values within {dtype_name(t.dtype)}'s range "
                    f"(the layer stores them as {dtype_name(t.dtype)}), got {overflow} that overflow it"
                )


class TransactionalState:
    """`load_state_dict` of `MoELayer`: the state checked against the layer's format first, all or nothing."""

    def load_state_dict(
        self: MoELayer, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """`torch.nn.Module.load_state_dict`, refused with `hal.InvalidInput` naming every offending key
        (a tensor of another shape, dtype or format, inf or NaN, and with `strict` a missing or unexpected
        key); a refused state changes nothing."""
        if not isinstance(state_dict, Mapping):
            raise invalid("state_dict", "a mapping of str keys to tensors", type(state_dict).__name__)
        for key in state_dict:
            if not isinstance(key, str):
                raise invalid("state_dict", "a mapping of str keys to tensors", f"the key {key!r}")
        snapshot = Snapshot(self)
        try:
            return torch.nn.Module.load_state_dict(self, state_dict, strict, assign)  # type: ignore[arg-type]
        except HalError:
            self._restore(snapshot)
            raise
        except RuntimeError as exc:  # torch's report of the errors of every module
            self._restore(snapshot)
            found = str(exc).split("\n", 1)[-1].strip()
            raise InvalidInput(
                f"state_dict: expected this layer's tensors (nothing was loaded), got:\n\t{found}"
            ) from None

    def _load_from_state_dict(
        self: MoELayer,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Runs before the submodules load (torch loads a module, then its children, then its post hooks):
        # a state that does not fit is taken away from them, and one refused by a submodule is rolled back.
        torch.nn.Module._load_from_state_dict(
            self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        problems = self._state_problems(state_dict, prefix)
        if problems:
            error_msgs.extend(problems)
            for key in [k for k in state_dict if k.startswith(prefix)]:
                del state_dict[key]  # torch's own copy, made for loaders to change
        if not self.__dict__.get("_after_load_registered"):  # a plain function: copies and pickles carry it
            self.register_load_state_dict_post_hook(_after_load)
            self._after_load_registered = True
        self._pending_load = _PendingLoad(Snapshot(self), error_msgs, len(error_msgs), prefix, bool(problems))

    def _state_problems(self: MoELayer, state: Mapping[str, Any], prefix: str) -> list[str]:
        """Every way the tensors of `state` under `prefix` differ from this layer's format (`moe.load_checks`)."""
        kind, known, h = self.scheme.gemm_kind().spec, frozenset(STORE_FIELDS), self.hidden_size
        local = self.local_intermediate_size
        problems = state_problems(
            state,
            prefix + "experts.",
            store_tensors(
                kind, self.dispatcher.num_local_experts, h, self.activation.input_width(local), local, bias=self.bias
            ),
            known,
        )
        block = self.shared_experts
        if block is not None:
            size = self.tensor_shard.local_size(block.config.intermediate_size, "shared_experts.intermediate_size")
            shared = store_tensors(kind, 1, h, self.activation.input_width(size), size, bias=False)
            problems += state_problems(state, prefix + "shared_experts.store.", shared, known)
            gate = prefix + "shared_experts.gate"
            if block.config.gated and gate in state and (problem := float_tensor(gate, state[gate], [(h,)])):
                problems.append(problem)
        return problems + non_finite_problems(state, prefix, e8m0_tensors(kind))

    @contextmanager
    def _all_or_nothing(self: MoELayer) -> Iterator[None]:
        """Storing weights either completes or leaves the layer as it was."""
        snapshot = Snapshot(self)
        try:
            yield
        except BaseException:
            self._restore(snapshot)
            raise

    def _restore(self: MoELayer, snapshot: Snapshot) -> None:
        self.__dict__.pop("_pending_load", None)
        snapshot.restore()
        self._rebuild()


@dataclasses.dataclass
class _PendingLoad:
    """A state-dict load of a layer between its own step and its submodules' (`_after_load`)."""

    snapshot: Snapshot
    error_msgs: list[str]
    errors_before: int  #: errors reported when the submodules started (ours included)
    prefix: str
    refused: bool  #: the layer refused the state itself: its submodules were given none of it


def _after_load(layer: Any, incompatible: Any) -> None:
    """After the layer's submodules loaded: undo them if one refused its part; a state the layer refused was
    not loaded at all, so its keys are not reported missing either."""
    pending: _PendingLoad | None = layer.__dict__.pop("_pending_load", None)
    if pending is None:
        return
    if pending.refused:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(pending.prefix)]
    elif len(pending.error_msgs) > pending.errors_before:
        layer._restore(pending.snapshot)


def _check_biases(
    expected: bool, b13: object, b2: object, shape13: tuple[int, ...], shape2: tuple[int, ...]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    given = (b13 is not None, b2 is not None)
    if not expected:
        if any(given):
            raise InvalidInput("w13_bias, w2_bias: expected none (the layer was built with bias=False), got biases")
        return None, None
    if not all(given):
        raise InvalidInput(
            "w13_bias, w2_bias: expected both (the layer was built with bias=True), got "
            + ("neither" if not any(given) else "only one")
        )
    for name, t, shape in (("w13_bias", b13, shape13), ("w2_bias", b2, shape2)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not torch.is_floating_point(t):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise invalid(name, f"a float tensor of shape {shape}", got)
        with_data(name, t)
        refuse_non_finite(name, t)
    return b13, b2  # type: ignore[return-value]


def _fp32(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.detach().to(device=device, dtype=torch.float32)


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _to(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    return QuantizedWeight(w.data.to(device), w.layout, _on(w.scale, device), _on(w.global_scale, device))
