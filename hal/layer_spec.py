"""`LayerSpec`: a MoE layer's settings and every reason a vendor cannot build it.

One owner for "can this layer be built, and why not": `moe.MoELayer` (at construction),
`moe.pipeline.choose_pipeline` and `hal explain` all ask `LayerSpec.problems`. The checks read
only the capability table and the scheme's traits, so they run without the hardware (on a
declared device model too). A setting left None (`hal explain` knows only some) is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from hal.activations import Activation, ActivationKind
from hal.capabilities import Capabilities
from hal.errors import InvalidInput, UnsupportedCapability, invalid, names, positive_int
from hal.scheme_fallbacks import SchemeChoice, choose_scheme
from hal.schemes import SchemeTraits, parse_scheme


@dataclass(frozen=True)
class LayerProblem:
    """One reason a layer cannot be built: the setting it concerns and a sentence saying why.

    `unsupported` is True where the vendor lacks a capability (`UnsupportedCapability`) and False
    where the settings contradict each other on any vendor (`InvalidInput`)."""

    setting: str
    message: str
    unsupported: bool

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class LayerSpec:
    """What a MoE layer is, independent of its weights: sizes, scheme, experts' form and parallelism.

    - `fused`: None takes the vendor's `fused_deep_moe` where declared for the scheme (SiLU-GLU
      experts without biases), False never, True requires it.
    - `ep_ranks` / `tp_ranks`: expert- and tensor-parallel group sizes; `expert_parallel` says a
      process group is given (it may have one rank); `ep_dispatcher` names a vendor's own
      expert-parallel dispatcher.
    - `graphs`: the layer captures its forward and replays it (`moe.GraphConfig`).
    - `redundant_experts`: R physical expert slots beyond the E logical experts, replicating busy
      ones (`moe.placement`); the E + R slots are split over the expert-parallel ranks, R at most
      E * ep_ranks.
    """

    hidden_size: int
    intermediate_size: int | None = None
    num_experts: int | None = None
    top_k: int | None = None
    scheme: SchemeTraits | str = "unquantized"
    activation: Activation | ActivationKind | str = ActivationKind.SILU_GLU
    bias: bool = False
    fused: bool | None = None
    ep_ranks: int = 1
    tp_ranks: int = 1
    expert_parallel: bool = False
    ep_dispatcher: str | None = None
    graphs: bool = False
    redundant_experts: int = 0

    def __post_init__(self) -> None:
        positive_int("hidden_size", self.hidden_size)
        for name in ("intermediate_size", "num_experts", "top_k"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        positive_int("ep_ranks", self.ep_ranks)
        positive_int("tp_ranks", self.tp_ranks)
        if isinstance(self.redundant_experts, bool) or not isinstance(self.redundant_experts, int):
            raise invalid("redundant_experts", "an int >= 0", self.redundant_experts)
        if self.redundant_experts < 0:
            raise invalid("redundant_experts", "an int >= 0", self.redundant_experts)
        for name, optional in (("bias", False), ("fused", True), ("expert_parallel", False), ("graphs", False)):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (optional and value is None):
                raise invalid(name, "True or False" + (" or None" if optional else ""), value)
        if self.ep_dispatcher is not None and not isinstance(self.ep_dispatcher, str):
            raise invalid("ep_dispatcher", "a dispatcher name or None", self.ep_dispatcher)
        object.__setattr__(self, "scheme", parse_scheme(self.scheme))
        object.__setattr__(self, "activation", Activation.parse(self.activation))

    @property
    def traits(self) -> SchemeTraits:
        """The scheme's traits (parsed)."""
        return self.scheme  # type: ignore[return-value]

    @property
    def parsed_activation(self) -> Activation:
        """The experts' activation (parsed)."""
        return self.activation  # type: ignore[return-value]

    @property
    def plain_experts(self) -> bool:
        """SiLU-GLU experts without biases: what a vendor's `fused_deep_moe` computes."""
        return self.parsed_activation.kind is ActivationKind.SILU_GLU and not self.bias

    def scheme_choice(self, capabilities: Capabilities) -> SchemeChoice:
        """The scheme the experts run as: this spec's, or the vendor's declared fallback for it."""
        return choose_scheme(capabilities, self.traits)

    def takes_fused(self, capabilities: Capabilities) -> bool:
        """Whether a layer of this spec runs the vendor's fused op (given that it has no problems)."""
        declared = self._fused_declared(capabilities) and self.plain_experts
        return declared if self.fused is None else self.fused

    def _fused_declared(self, capabilities: Capabilities) -> bool:
        runs = self.scheme_choice(capabilities).effective.name
        return bool({self.traits.name, runs} & capabilities.fused_deep_moe)

    def problems(self, capabilities: Capabilities) -> list[LayerProblem]:
        """Every reason a vendor with `capabilities` cannot build this layer (empty: it can)."""
        return [*self._shape_problems(), *self._expert_problems(capabilities), *self._path_problems(capabilities)]

    def check(self, capabilities: Capabilities, vendor: str) -> None:
        """Raise for the problems of `problems`, naming every reason: `UnsupportedCapability` if the
        vendor lacks something the layer needs, else (the settings contradict each other) `InvalidInput`."""
        problems = self.problems(capabilities)
        if not problems:
            return
        if not any(p.unsupported for p in problems):
            raise InvalidInput("; ".join(p.message for p in problems))
        raise UnsupportedCapability(
            f"vendor {vendor!r} ({capabilities.device_name}) cannot build this layer: "
            + "; ".join(p.message for p in problems)
        )

    def _shape_problems(self) -> list[LayerProblem]:
        found = []
        if self.top_k is not None and self.num_experts is not None and self.top_k > self.num_experts:
            found.append(
                LayerProblem(
                    "top_k", f"top_k: expected at most num_experts ({self.num_experts}), got {self.top_k}", False
                )
            )
        slots = None if self.num_experts is None else self.num_experts + self.redundant_experts
        if slots is not None and slots % self.ep_ranks:
            what = (
                f"num_experts: expected a multiple of the expert-parallel ranks ({self.ep_ranks}), "
                f"got {self.num_experts}"
                if not self.redundant_experts
                else f"num_experts + redundant_experts: expected a multiple of the expert-parallel ranks "
                f"({self.ep_ranks}), got {self.num_experts} + {self.redundant_experts}"
            )
            found.append(LayerProblem("num_experts", what, False))
        if slots is not None and self.redundant_experts > self.num_experts * self.ep_ranks:
            found.append(
                LayerProblem(
                    "redundant_experts",
                    f"redundant_experts: expected at most num_experts * ep_ranks ({self.num_experts} * "
                    f"{self.ep_ranks}: every expert on every rank once more), got {self.redundant_experts}",
                    False,
                )
            )
        if self.redundant_experts and not self.traits.movable_experts:
            found.append(
                LayerProblem(
                    "redundant_experts",
                    f"redundant_experts: scheme {self.traits.name!r} does not declare movable_experts (its "
                    "per-expert tensors may not be laid out expert-first), so its experts cannot be replicated "
                    "or moved",
                    False,
                )
            )
        if self.intermediate_size is not None and self.intermediate_size % self.tp_ranks:
            found.append(
                LayerProblem(
                    "intermediate_size",
                    f"intermediate_size: expected a multiple of the tensor-parallel ranks ({self.tp_ranks}), "
                    f"got {self.intermediate_size}",
                    False,
                )
            )
        if self.ep_dispatcher is not None and not self.expert_parallel:
            found.append(
                LayerProblem(
                    "ep_dispatcher",
                    f"dispatch.ep_dispatcher {self.ep_dispatcher!r}: expected a process_group "
                    "(it is an expert-parallel dispatcher)",
                    False,
                )
            )
        return found

    def _expert_problems(self, caps: Capabilities) -> list[LayerProblem]:
        found = []
        activation = self.parsed_activation
        if not caps.supports_activation(activation):
            found.append(
                LayerProblem(
                    "activation",
                    f"the activation {activation.kind} is not declared (declared: {names(caps.activations)})",
                    True,
                )
            )
        if self.bias and not caps.expert_bias:
            found.append(LayerProblem("bias", "bias: expert biases need expert_bias, which is not declared", True))
        limit = caps.limits.max_inner_dim
        if limit is not None and self.hidden_size > limit:
            found.append(
                LayerProblem(
                    "hidden_size",
                    f"hidden size {self.hidden_size} exceeds the grouped matmul's max_inner_dim {limit}",
                    True,
                )
            )
        if self.graphs and not caps.graph_capture:
            found.append(
                LayerProblem(
                    "graphs", "graphs: replaying a captured forward needs graph_capture, which is not declared", True
                )
            )
        wanted = self.ep_dispatcher
        if wanted is not None and wanted not in caps.ep_dispatchers:
            why = caps.ep_dispatchers_absent.get(wanted)
            found.append(
                LayerProblem(
                    "ep_dispatcher",
                    f"dispatch.ep_dispatcher: expert-parallel dispatcher {wanted!r} is not declared "
                    f"(declared: {names(caps.ep_dispatchers)})" + (f"; {wanted}: {why}" if why else ""),
                    True,
                )
            )
        return found

    def _path_problems(self, caps: Capabilities) -> list[LayerProblem]:
        """The fused op where it is asked for, else the grouped matmul the scheme needs."""
        scheme = self.traits
        if self.fused:
            found = []
            if not self._fused_declared(caps):
                found.append(
                    LayerProblem(
                        "fused",
                        f"fused: fused_deep_moe for scheme {scheme.name!r} is not declared "
                        f"(declared for: {names(caps.fused_deep_moe) if caps.fused_deep_moe else 'no scheme'})",
                        True,
                    )
                )
            if not self.plain_experts:
                found.append(
                    LayerProblem(
                        "fused",
                        f"fused: the fused_deep_moe op computes SiLU-GLU experts without biases; this layer has "
                        f"activation {self.parsed_activation} and {'biases' if self.bias else 'no biases'}",
                        True,
                    )
                )
            return found
        if self.takes_fused(caps):
            return []
        choice = self.scheme_choice(caps)
        kind = choice.effective.compute_kind
        if kind is None:
            return []
        found = [] if choice.problem is None else [LayerProblem("scheme", choice.problem, True)]
        multiple = kind.spec.k_multiple
        if self.hidden_size % multiple:
            found.append(
                LayerProblem(
                    "hidden_size",
                    f"hidden size {self.hidden_size} is not a multiple of {multiple}, which the {kind} grouped "
                    "matmul packs or scales together",
                    True,
                )
            )
        local = None if self.intermediate_size is None else self.intermediate_size // self.tp_ranks
        if local is not None and local % multiple:  # the K of the second projection
            per_rank = (
                "" if self.tp_ranks == 1 else f" per tensor-parallel rank ({self.intermediate_size} / {self.tp_ranks})"
            )
            found.append(
                LayerProblem(
                    "intermediate_size",
                    f"intermediate size {local}{per_rank} is not a multiple of {multiple}, which the {kind} "
                    "grouped matmul packs or scales together along the second projection's K",
                    True,
                )
            )
        return found


__all__ = ["LayerProblem", "LayerSpec"]
