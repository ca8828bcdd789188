"""The named model shapes, token counts and precisions `hal bench` runs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """One MoE layer's shape: hidden size, expert intermediate size, experts on this device, top-k."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    note: str = ""


SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("qwen3-30b-a3b", 2048, 768, 128, 8),
        ModelShape("mixtral-8x7b", 4096, 14336, 8, 2),
        # One rank of an 8-way expert-parallel DeepSeek-V3 layer: 32 local experts of 256.
        # A token's 8 choices land on this rank 8 * 32 / 256 = 1 time on average, so the
        # rank's work is modelled as top-1 over its 32 experts (dispatch traffic excluded).
        ModelShape(
            "deepseek-v3-ep8",
            7168,
            2048,
            32,
            1,
            note="one EP8 rank: 32 local experts of 256, top-8 -> 1 local pair per token",
        ),
        # A small shape any device (the CPU included) finishes quickly.
        ModelShape("tiny", 256, 128, 8, 2),
    )
}

#: The token counts of a full run (decode to prefill).
TOKENS = (1, 8, 64, 512, 4096, 16384)
#: The most tokens one case of `hal bench` or `hal tune` takes: a prefill chunk of a million tokens is far past
#: what a layer is called with, and the largest shape's buffers at this size already need hundreds of GiB.
MAX_TOKENS = 1 << 20
#: Token counts of the small CPU run.
CPU_TOKENS = (1, 8, 64)

#: Precision name -> the layer's quantization scheme.
PRECISIONS: dict[str, str] = {"bf16": "unquantized", "fp8": "w8a8-fp8-block", "fp8-rowwise": "w8a8-fp8"}
#: The precisions a run takes where none is named (those the vendor declares).
DEFAULT_PRECISIONS = ("bf16", "fp8")


def peak_of(precision: str) -> str:
    """The measured matmul peak a precision's roofline uses: `fp8` for every fp8 scheme, else `bf16`."""
    return "fp8" if precision.startswith("fp8") else "bf16"


def parse_shapes(names: list[str] | None, default: tuple[str, ...]) -> list[ModelShape]:
    """The shapes named (or the defaults); raises ValueError naming the known ones."""
    chosen = names or list(default)
    unknown = [n for n in chosen if n not in SHAPES]
    if unknown:
        raise ValueError(f"unknown model shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    return [SHAPES[n] for n in chosen]
