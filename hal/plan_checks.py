"""Whether a MoE layer of a scheme can be built on a vendor's table: the checks `hal explain` makes.

`hal explain` resolves a dispatch dtype; a plan it approves must also build. The layer
(`moe.MoELayer`) refuses a scheme whose grouped-matmul kind the vendor does not declare
(unless the vendor's fused op serves the scheme), an activation the vendor does not
declare, and hidden sizes its operands cannot hold; these checks read only the table and
the scheme's traits, so they run without the hardware (on a declared device model too).
"""

from __future__ import annotations

from hal.activations import Activation, ActivationKind
from hal.capabilities import Capabilities
from hal.schemes import SchemeTraits


def layer_problems(
    capabilities: Capabilities,
    scheme: SchemeTraits,
    hidden_size: int,
    *,
    activation: Activation | ActivationKind | str = ActivationKind.SILU_GLU,
) -> list[str]:
    """Why a layer of `scheme` with `hidden_size` channels and `activation` experts cannot be built on
    a vendor with `capabilities` (empty: it can). Reasons are sentences naming what is missing."""
    parsed = Activation.parse(activation)
    problems = []
    if not capabilities.supports_activation(parsed):
        declared = ", ".join(sorted(a.value for a in capabilities.activations)) or "none"
        problems.append(f"the activation {parsed.kind} is not declared (declared: {declared})")
    fused = scheme.name in capabilities.fused_deep_moe and parsed.kind is ActivationKind.SILU_GLU
    kind = scheme.compute_kind
    if kind is not None and not fused:
        if not capabilities.supports_gemm(kind):
            declared = ", ".join(sorted(k.value for k in capabilities.grouped_matmul)) or "none"
            problems.append(
                f"the {kind} grouped matmul that scheme {scheme.name!r} needs is not declared (declared: {declared})"
            )
        multiple = kind.spec.k_multiple
        if hidden_size % multiple:
            problems.append(
                f"hidden size {hidden_size} is not a multiple of {multiple}, which the {kind} grouped "
                "matmul packs or scales together"
            )
    limit = capabilities.limits.max_inner_dim
    if limit is not None and hidden_size > limit:
        problems.append(f"hidden size {hidden_size} exceeds the grouped matmul's max_inner_dim {limit}")
    return problems
