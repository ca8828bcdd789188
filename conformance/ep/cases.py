"""The cases of the expert-parallel section: dispatchers x modes x dispatch dtypes x shapes.

The list depends only on the vendor's declared capabilities, the depth and the number of ranks,
so every rank builds the same list in the same order. A case names a dispatcher (`torch` for the
torch.distributed one, else a name from `Capabilities.ep_dispatchers`), a mode, the requested
dispatch dtype (run with the scheme that consumes it) and a shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hal import Capabilities, DispatchConfig

#: The name of the torch.distributed dispatcher in case ids (`DispatchConfig(ep_dispatcher=None)`).
TORCH = "torch"
#: Modes: the two auto cases give the same auto layer a batch within its capacity and one above it.
MODES = ("normal", "low-latency", "auto-small", "auto-large")
#: The dispatch dtypes the section requests, each with the scheme whose grouped matmul consumes it.
DTYPE_SCHEMES = {"bf16": "unquantized", "fp8": "w8a8-fp8-block", "int8": "w8a8-int8"}
#: Token patterns over the ranks (see `Shape.tokens_per_rank`).
PATTERNS = ("even", "uneven", "zero-rank")


@dataclass(frozen=True)
class Shape:
    """A layer shape and how many tokens each rank routes (`tokens` pattern, `base` tokens)."""

    name: str
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    tokens: str
    base: int
    idle_experts: bool = False  #: some experts (all of the last rank's) are picked by no token

    def num_experts(self, world: int) -> int:
        """`experts`, rounded up to a multiple of the ranks (every rank holds as many)."""
        return -(-self.experts // world) * world

    def tokens_per_rank(self, world: int) -> list[int]:
        """even: `base` on every rank; uneven: `base + 5 r` on rank r; zero-rank: none on rank 0, `base` elsewhere."""
        if self.tokens == "even":
            return [self.base] * world
        if self.tokens == "uneven":
            return [self.base + 5 * r for r in range(world)]
        return [0] + [self.base] * (world - 1)

    def idle(self, world: int) -> list[int]:
        """The experts no token picks: every fourth one and, with several ranks, all of the last rank's
        (fewer where too few would be left for top-k)."""
        if not self.idle_experts:
            return []
        experts = self.num_experts(world)
        last_rank = range(experts - experts // world, experts) if world > 1 else range(0)
        chosen = sorted({e for e in range(experts) if e % 4 == 3} | set(last_rank))
        if experts - len(chosen) < self.top_k:
            chosen = [e for e in range(experts) if e % 4 == 3]
        return chosen


#: Small shapes, for a CPU (`--depth quick`): H 200 and 128 leave partial 128-channel groups.
QUICK_SHAPES = (
    Shape("top2-E8-H256-even", 8, 256, 128, 2, "even", 12),
    Shape("top1-E16-H200-uneven", 16, 200, 96, 1, "uneven", 5),
    Shape("top8-E16-H256-zero-rank", 16, 256, 64, 8, "zero-rank", 9),
    Shape("top2-E16-H128-idle", 16, 128, 64, 2, "uneven", 7, idle_experts=True),
)
#: Realistic shapes added at `--depth full` (for devices; the float64 references still run on the host).
FULL_SHAPES = (
    Shape("top8-E64-H1000-uneven", 64, 1000, 384, 8, "uneven", 96),
    Shape("top8-E256-H1024-idle", 256, 1024, 128, 8, "uneven", 128, idle_experts=True),
    Shape("top2-E128-H2048-zero-rank", 128, 2048, 256, 2, "zero-rank", 256),
    Shape("top8-E32-H7168-even", 32, 7168, 128, 8, "even", 64),  # DeepSeek-V3's hidden size (Ascend A3's MC2 needs it)
)


def shapes(depth: str) -> tuple[Shape, ...]:
    """The shapes of a depth: quick's, and at full depth the realistic ones too."""
    return QUICK_SHAPES + (FULL_SHAPES if depth == "full" else ())


@dataclass(frozen=True)
class Case:
    """One expert-parallel check, the same on every rank."""

    dispatcher: str
    mode: str
    dtype: str
    shape: Shape

    @property
    def id(self) -> str:
        """`dispatcher/mode/dtype/shape`, e.g. `torch/auto-large/fp8/top2-E8-H256-even`."""
        return f"{self.dispatcher}/{self.mode}/{self.dtype}/{self.shape.name}"

    @property
    def scheme(self) -> str:
        """The quant scheme that consumes the requested dispatch dtype."""
        return DTYPE_SCHEMES[self.dtype]

    def capacity(self, world: int) -> int | None:
        """`max_dispatch_tokens_per_rank`: none in normal mode; the largest rank's batch in low-latency
        mode and for auto's small batch; half of it for auto's large batch (so that it is above)."""
        if self.mode == "normal":
            return None
        largest = max(self.shape.tokens_per_rank(world))
        return max(1, largest // 2) if self.mode == "auto-large" else max(1, largest)

    def expected_mode(self, world: int) -> str:
        """The mode the layer must take: auto takes low-latency where the largest batch of any rank fits its
        capacity, normal above it."""
        if not self.mode.startswith("auto"):
            return self.mode
        fits = max(self.shape.tokens_per_rank(world)) <= (self.capacity(world) or 0)
        return "low-latency" if fits else "normal"

    def config(self, world: int) -> DispatchConfig:
        """The layer's `DispatchConfig`."""
        return DispatchConfig(
            dtype=self.dtype,
            max_dispatch_tokens_per_rank=self.capacity(world),
            ep_mode="auto" if self.mode.startswith("auto") else self.mode,
            ep_dispatcher=None if self.dispatcher == TORCH else self.dispatcher,
        )

    def describe(self, world: int) -> dict[str, Any]:
        """Plain data for the report."""
        return {
            "id": self.id,
            "dispatcher": self.dispatcher,
            "mode": self.mode,
            "dtype": self.dtype,
            "scheme": self.scheme,
            "shape": {**asdict(self.shape), "experts": self.shape.num_experts(world)},
            "tokens_per_rank": self.shape.tokens_per_rank(world),
            "capacity": self.capacity(world),
            "expected_mode": self.expected_mode(world),
            "idle_experts": self.shape.idle(world),
        }


def dispatchers(caps: Capabilities) -> list[str]:
    """The torch.distributed dispatcher, then the vendor's own, by name."""
    return [TORCH, *sorted(caps.ep_dispatchers)]


def build_cases(caps: Capabilities, depth: str) -> list[Case]:
    """Every case, in the order every rank runs them (mode innermost: the cases of one shape and dtype
    share their single-rank layer and float64 reference)."""
    return [
        Case(d, mode, dtype, shape)
        for d in dispatchers(caps)
        for dtype in DTYPE_SCHEMES
        for shape in shapes(depth)
        for mode in MODES
    ]


def declared_skip(case: Case, caps: Capabilities, vendor: str) -> str | None:
    """Why the vendor's declarations rule a case out (None: run it)."""
    if case.dispatcher != TORCH and case.mode != "normal" and case.dispatcher not in caps.ep_low_latency:
        declared = ", ".join(sorted(caps.ep_low_latency)) or "none"
        return (
            f"vendor {vendor} declares no low-latency mode for its dispatcher {case.dispatcher} "
            f"(ep_low_latency: {declared})"
        )
    return None
