"""`ExpertCheckpointLoader`: feed a checkpoint's expert tensors one at a time, get `moe.ExpertWeights`.

Tensors are taken as stored (no dequantize / requantize): the loader checks each one as it
arrives (an `InvalidInput` naming the tensor), keeps only this rank's experts (expert
parallelism) and its shard of the intermediate dimension (tensor parallelism), and
`build()` transposes and concatenates them into hal's formats (`moe.checkpoint.assemble`).
Static activation scales (`input_scale`) are read for every expert, not only the local
ones: the layer quantizes its input with the largest of them, which every rank must agree on.
"""

from __future__ import annotations

import torch

from hal import FP8_GROUP_SIZE, Activation, InvalidInput, invalid, positive_int, refuse_non_finite
from moe.arguments import as_device, flag, with_data
from moe.checkpoint.assemble import assemble
from moe.checkpoint.checks import Staged, check_tensor, refuse_unknown
from moe.checkpoint.formats import CheckpointFormat, FusedLayout, expected_tensor
from moe.checkpoint.names import (
    ExpertTensorName,
    NameStyle,
    Projection,
    TensorKind,
    expert_tensor_name,
    malformed_expert_id,
    normalize_prefix,
    parse_expert_name,
    unknown_expert_tensor,
)
from moe.checkpoint.shard import shard, split_gate_up
from moe.load_checks import refuse_negative_scales
from moe.schemes import ExpertWeights, NvFp4, QuantScheme, Unquantized, W4A16MxFp4, W8A8Fp8, W8A8Fp8Block, W8A8Int8

_FLOAT_SCHEMES = {
    CheckpointFormat.BF16: torch.bfloat16,
    CheckpointFormat.FP16: torch.float16,
    CheckpointFormat.FP32: torch.float32,
}
_SCALAR_VALUED = (TensorKind.WEIGHT_SCALE_2, TensorKind.INPUT_SCALE)


class ExpertCheckpointLoader:
    """Collects one MoE layer's expert tensors and builds this rank's `ExpertWeights`.

    `format`: a `CheckpointFormat` (or its name); `local_experts`: the contiguous expert ids
    this rank holds (default: all); `tp_rank` / `tp_size`: this rank's shard of the
    intermediate dimension (`I / tp_size` channels from `tp_rank * I / tp_size`);
    `activation` (a `hal.Activation` or its name, carried by the weights built) or
    `activation_gated`: gate and up projections, or (False) a plain activation with up and
    down only; `bias`: the projections have biases (the down bias is rank 0's under
    tensor parallelism, zeros elsewhere); `prefix`: the MoE block's module path (names
    elsewhere are ignored; without one, the first name fixes it); `fused_layout`: how fused
    all-experts weights are oriented; `gate_up_interleaved`: gate and up rows alternate in
    `gate_up` tensors (gpt-oss); `static_input_scale`: use the checkpoint's `input_scale`
    (fp8 only; None: where the checkpoint has them, False: ignore them; nvfp4 always does).
    """

    def __init__(
        self,
        format: CheckpointFormat | str,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        local_experts: range | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        activation_gated: bool | None = None,
        activation: Activation | str | None = None,
        bias: bool = False,
        prefix: str | None = None,
        fused_layout: FusedLayout | str = FusedLayout.OUT_IN,
        gate_up_interleaved: bool = False,
        static_input_scale: bool | None = None,
    ) -> None:
        self.format = CheckpointFormat.parse(format)
        self.spec = self.format.spec
        self.num_experts = positive_int("num_experts", num_experts)
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.intermediate_size = positive_int("intermediate_size", intermediate_size)
        self.local_experts = range(num_experts) if local_experts is None else local_experts
        if (
            not isinstance(self.local_experts, range)
            or self.local_experts.step != 1
            or not self.local_experts
            or self.local_experts.start < 0
            or self.local_experts.stop > num_experts
        ):
            raise invalid("local_experts", f"a non-empty range(start, stop) within range({num_experts})", local_experts)
        positive_int("tp_size", tp_size)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise invalid("tp_rank", f"an int in [0, {tp_size})", tp_rank)
        if intermediate_size % tp_size:
            raise invalid("tp_size", f"a divisor of intermediate_size={intermediate_size}", tp_size)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        flag("activation_gated", activation_gated, optional=True)
        self.activation = self._activation(activation, activation_gated)
        self.gated, self.bias = self.activation.gated, flag("bias", bias)
        try:
            self.fused_layout = FusedLayout(fused_layout)
        except ValueError:
            raise invalid(
                "fused_layout", f"one of {', '.join(repr(f.value) for f in FusedLayout)}", fused_layout
            ) from None
        self.interleaved = flag("gate_up_interleaved", gate_up_interleaved)
        flag("static_input_scale", static_input_scale, optional=True)
        if static_input_scale is not None and self.format is not CheckpointFormat.FP8:
            raise invalid(
                "static_input_scale", f"None for a {self.format} checkpoint (only fp8 has a choice)", static_input_scale
            )
        self.static_input_scale = True if self.format is CheckpointFormat.NVFP4 else static_input_scale
        if self.spec.block:
            block = self.spec.block
            for name, size in (("hidden_size", hidden_size), ("intermediate_size / tp_size", self.local_intermediate)):
                if size % block:
                    raise invalid(
                        name, f"a multiple of {block} for {self.format} (its block scales cover {block} channels)", size
                    )
        self.prefix = None if prefix is None else normalize_prefix(prefix)
        self._style: NameStyle | None = None
        self._prefix = ""
        self._parts: dict[tuple[int, Projection, TensorKind], torch.Tensor] = {}
        self._sources: dict[tuple[int, Projection, TensorKind], str] = {}
        self._input_scales: dict[tuple[int, Projection], float] = {}

    @staticmethod
    def _activation(activation: Activation | str | None, gated: bool | None) -> Activation:
        """The experts' activation: as given, else SiLU-GLU (gated) or SiLU (`activation_gated=False`)."""
        if activation is None:
            return Activation.parse("silu-glu" if gated is None or gated else "silu")
        parsed = Activation.parse(activation)
        if gated is not None and bool(gated) != parsed.gated:
            raise invalid("activation_gated", f"{parsed.gated} for activation {parsed.kind.value!r} (or None)", gated)
        return parsed

    # -- shape of this rank's part ---------------------------------------------------------------

    @property
    def local_intermediate(self) -> int:
        """I of this rank: `intermediate_size / tp_size`."""
        return self.intermediate_size // self.tp_size

    @property
    def projections(self) -> tuple[Projection, ...]:
        """The projections every expert has."""
        return (Projection.GATE, Projection.UP, Projection.DOWN) if self.gated else (Projection.UP, Projection.DOWN)

    def _dims(self, projection: Projection) -> tuple[int, int]:
        """(N, K) of a projection at the full intermediate size."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            Projection.GATE: (i, h),
            Projection.UP: (i, h),
            Projection.DOWN: (h, i),
            Projection.GATE_UP: (2 * i, h),
        }[projection]

    # -- feeding tensors -------------------------------------------------------------------------

    def wants(self, name: str) -> bool:
        """Whether `add(name, ...)` would keep (or read) this tensor; reads nothing. True also for a tensor of
        this layer's experts that no format understands (an int8 zero point), of an expert id >= num_experts or
        that is no whole number: `add` refuses it by name."""
        parsed = parse_expert_name(name, self.prefix)
        if parsed is None:
            odd = unknown_expert_tensor(name, self.prefix) or malformed_expert_id(name, self.prefix)
            return odd is not None and (self.prefix is not None or self._style is None or odd[0] == self._prefix)
        if self.prefix is None and self._style is not None and parsed.prefix != self._prefix:
            return False
        if parsed.kind is TensorKind.INPUT_SCALE:
            return self.static_input_scale is not False
        if parsed.fused or parsed.expert in self.local_experts:
            return True
        return parsed.expert >= self.num_experts  # type: ignore[operator]  # read to be refused, never skipped

    def add(self, name: str, tensor: torch.Tensor) -> bool:
        """Take one checkpoint tensor; True if kept, False if it is not this rank's (or no expert tensor).

        Raises `InvalidInput` naming the tensor when its shape, dtype, kind or values (inf, NaN) do not fit,
        and for a tensor of an expert that no format understands; a refused tensor leaves the loader as it was.
        """
        parsed = parse_expert_name(name, self.prefix)
        if parsed is None:
            refuse_unknown(name, self.prefix, self.spec, self.num_experts)
            return False
        self._check_layer(name, parsed)
        if not isinstance(tensor, torch.Tensor):
            raise invalid(name, "a torch.Tensor", type(tensor).__name__)
        with_data(name, tensor)
        self._check_kind(name, parsed)
        if parsed.kind is TensorKind.INPUT_SCALE and self.static_input_scale is False:
            return False
        if parsed.fused:
            return self._add_fused(name, parsed, tensor)
        if parsed.expert >= self.num_experts:  # type: ignore[operator]
            raise invalid(name, f"an expert id below num_experts={self.num_experts}", parsed.expert)
        n, k = self._dims(parsed.projection)
        check_tensor(name, tensor, *expected_tensor(self.spec, parsed.kind, n, k))
        staged = Staged()
        self._stage(staged, name, parsed.projection, parsed.kind, parsed.expert, tensor, self.tp_size == 1)
        return self._commit(staged)

    def _check_layer(self, name: str, parsed: ExpertTensorName) -> None:
        """One loader, one layer: the first name fixes the prefix and the naming family."""
        if self._style is None:
            self._prefix, self._style = parsed.prefix, parsed.style
        elif self.prefix is None and parsed.prefix != self._prefix:
            raise InvalidInput(
                f"{name}: a tensor of another layer ({parsed.prefix!r}) than the first one loaded "
                f"({self._prefix!r}); pass prefix= to load one layer"
            )

    def _check_kind(self, name: str, parsed: ExpertTensorName) -> None:
        if parsed.kind not in self.spec.kinds():
            raise invalid(
                name,
                f"one of the {self.format} tensors ({', '.join(k.value for k in self.spec.kinds())})",
                parsed.kind.value,
            )
        if parsed.kind is TensorKind.BIAS and not self.bias:
            raise invalid(name, "no bias tensors (the loader was built with bias=False)", "a bias")
        if not self.gated and parsed.projection in (Projection.GATE, Projection.GATE_UP):
            raise invalid(name, "up and down projections only (activation_gated=False)", str(parsed.projection))

    def _add_fused(self, name: str, parsed: ExpertTensorName, t: torch.Tensor) -> bool:
        """A tensor of every expert (leading dimension E), or of the local experts only (E_local)."""
        n, k = self._dims(parsed.projection)
        lead = [self.num_experts]
        if parsed.kind is not TensorKind.INPUT_SCALE and len(self.local_experts) != self.num_experts:
            lead.append(len(self.local_experts))
        transposed = parsed.kind is TensorKind.WEIGHT and self.fused_layout is FusedLayout.IN_OUT
        if transposed and self.spec.quantized:
            raise invalid(name, f"fused {self.format} weights in the out-in layout [E, N, K]", "fused_layout='in-out'")
        shapes, dtypes = expected_tensor(self.spec, parsed.kind, n, k)
        if transposed:
            shapes = [s[::-1] for s in shapes]
        if parsed.kind in _SCALAR_VALUED:
            shapes = [()]
        check_tensor(name, t, [(e, *s) for e in lead for s in shapes], dtypes)
        experts = range(self.num_experts) if parsed.kind is TensorKind.INPUT_SCALE else self.local_experts
        base = self.local_experts.start if t.shape[0] != self.num_experts else 0
        whole = self.tp_size == 1 and t.shape[0] == len(self.local_experts)  # every byte given is kept
        staged = Staged()
        for e in experts:
            one = t[e - base].t() if transposed else t[e - base]
            self._stage(staged, name, parsed.projection, parsed.kind, e, one, whole)
        return self._commit(staged)

    def _stage(
        self,
        staged: Staged,
        name: str,
        projection: Projection,
        kind: TensorKind,
        expert: int,
        t: torch.Tensor,
        view_ok: bool,
    ) -> None:
        """One expert's tensor `[N, K]` (shape checked): split (gate_up), sharded (TP), its values checked and
        staged if local; nothing is kept before the whole tensor passed (`_commit`)."""
        if kind is TensorKind.BLOCKS:
            t = t.reshape(t.shape[0], -1)  # [N, K/32, 16] -> [N, K/2]: the same bytes, a view
        if kind in _SCALAR_VALUED:
            value = float(t.reshape(()))
            if not 0 < value < float("inf"):
                raise invalid(name, "a finite positive scale", value)
            if kind is TensorKind.INPUT_SCALE:
                staged.kept = True
                staged.input_scales.update({(expert, p): value for p in self._split_projections(projection)})
                return
        if expert not in self.local_experts:
            return
        staged.kept = True
        if projection is Projection.GATE_UP:
            pieces = zip(
                (Projection.GATE, Projection.UP),
                split_gate_up(name, self.spec, kind, t, self.intermediate_size, self.interleaved),
            )
        else:
            pieces = zip((projection,), (t,))
        for p, piece in pieces:
            if (
                kind is TensorKind.WEIGHT_SCALE_INV
                and p is not Projection.DOWN
                and self.gated
                and self.local_intermediate % FP8_GROUP_SIZE
            ):
                raise InvalidInput(
                    f"{name}: gate and up concatenated along N need 128x128 blocks that do not straddle "
                    f"them: expected I per rank (intermediate_size / tp_size) a multiple of {FP8_GROUP_SIZE}, "
                    f"got {self.local_intermediate}"
                )
            local = shard(
                name,
                self.spec,
                p,
                kind,
                piece,
                self.tp_rank * self.local_intermediate,
                self.local_intermediate,
                self.intermediate_size,
            )
            refuse_non_finite(name, local, e8m0=kind is TensorKind.SCALES)
            if kind in (TensorKind.WEIGHT_SCALE, TensorKind.WEIGHT_SCALE_INV):
                refuse_negative_scales(name, local)
            key = (expert - self.local_experts.start, p, kind)
            if key in self._sources or key in staged.parts:
                raise InvalidInput(
                    f"{name}: expert {expert}'s {p} {kind} was already loaded from {self._sources.get(key, name)}"
                )
            staged.parts[key] = (name, local, view_ok and local is piece)

    def _split_projections(self, projection: Projection) -> tuple[Projection, ...]:
        return (Projection.GATE, Projection.UP) if projection is Projection.GATE_UP else (projection,)

    def _commit(self, staged: Staged) -> bool:
        """Keep what `_stage` checked; whether anything was kept."""
        for key, (name, t, view_ok) in staged.parts.items():
            if not view_ok and t.untyped_storage().nbytes() > t.numel() * t.element_size():
                t = t.clone()  # a view of a larger tensor: keep only this rank's part, not the rest
            self._parts[key], self._sources[key] = t, name
        self._input_scales.update(staged.input_scales)
        return staged.kept

    # -- results ---------------------------------------------------------------------------------

    def _uses_input_scales(self) -> bool:
        return bool(self.static_input_scale) or (self.static_input_scale is None and bool(self._input_scales))

    def missing(self) -> list[str]:
        """The names of the tensors `build()` still needs (this rank's, and every expert's input scales)."""
        kinds = [k for k in self.spec.required if k is not TensorKind.INPUT_SCALE]
        kinds += [TensorKind.BIAS] if self.bias else []
        names: list[str] = []
        for e in self.local_experts:
            names += [
                self._name(e, p, k)
                for p in self.projections
                for k in kinds
                if (e - self.local_experts.start, p, k) not in self._parts
            ]
        return list(dict.fromkeys(names + self._missing_input_scales()))

    def _missing_input_scales(self) -> list[str]:
        if not self._uses_input_scales():
            return []
        return list(
            dict.fromkeys(
                self._name(e, p, TensorKind.INPUT_SCALE)
                for e in range(self.num_experts)
                for p in self.projections
                if (e, p) not in self._input_scales
            )
        )

    def _name(self, expert: int, projection: Projection, kind: TensorKind) -> str:
        style = self._style or NameStyle.HF
        prefix = self.prefix if self.prefix is not None else getattr(self, "_prefix", "")
        if style is NameStyle.FUSED and projection is not Projection.DOWN and self.gated:
            projection = Projection.GATE_UP
        return expert_tensor_name(prefix, expert, projection, kind, style)

    def _require_complete(self, input_scales_only: bool = False) -> None:
        missing = self._missing_input_scales() if input_scales_only else self.missing()
        if missing:
            raise InvalidInput(
                f"checkpoint: expected every expert tensor of this rank, got {len(missing)} "
                f"missing: {', '.join(missing)}"
            )

    def _max_input_scale(self, down: bool) -> float:
        return max(v for (_, p), v in self._input_scales.items() if (p is Projection.DOWN) == down)

    def scheme(self) -> QuantScheme:
        """The `moe` scheme these weights run under; fp8 (static) and nvfp4 take the checkpoint's
        activation scales, so every expert's `input_scale` must have been added (the weights need not)."""
        if self.format in _FLOAT_SCHEMES:
            return Unquantized(_FLOAT_SCHEMES[self.format])
        if self.format is CheckpointFormat.FP8_BLOCK128:
            return W8A8Fp8Block()
        if self.format is CheckpointFormat.INT8:
            return W8A8Int8()
        if self.format is CheckpointFormat.MXFP4:
            return W4A16MxFp4()
        if not self._uses_input_scales():
            return W8A8Fp8()
        self._require_complete(input_scales_only=True)
        scale_in, scale_down = self._max_input_scale(False), self._max_input_scale(True)
        if self.format is CheckpointFormat.FP8:
            return W8A8Fp8(input_scale=scale_in, intermediate_scale=scale_down)
        return NvFp4(input_global_scale=1.0 / scale_in, intermediate_global_scale=1.0 / scale_down)

    def build(self, device: torch.device | None = None) -> ExpertWeights:
        """This rank's `ExpertWeights` (copies, never views of the tensors given); raises `InvalidInput`
        naming every missing tensor."""
        device = as_device("device", device, optional=True)
        self._require_complete()
        scheme = self.scheme()
        global_scales = (None, None)
        if isinstance(scheme, NvFp4):
            global_scales = (scheme.input_global_scale, scheme.intermediate_global_scale)
        return assemble(
            self.spec,
            lambda e, p, k: self._parts[(e, p, k)],
            len(self.local_experts),
            self.activation,
            self.bias,
            *global_scales,
            device=device,
            down_bias_here=self.tp_rank == 0,
        )
