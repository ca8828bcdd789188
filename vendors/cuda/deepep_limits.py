"""What DeepEP v1.2.1 takes (read from its sources: `csrc/deep_ep.cpp`, `csrc/kernels/launch.cuh`,
`internode_ll.cu`, `intranode.cu`, `deep_ep/buffer.py`) and how large its buffers are; device-free, so
the refusals are checked without a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hal import DispatchDtype, InvalidInput, UnsupportedCapability, UnsupportedDispatchDtype

NORMAL, LOW_LATENCY = "normal", "low-latency"
#: Dispatch dtypes deepep carries: bf16 rows, or fp8 e4m3 rows with one fp32 scale per `FP8_GROUP` channels.
CARRIED = (DispatchDtype.BF16, DispatchDtype.FP8)
FP8_GROUP = 128
#: Hidden sizes the low-latency kernels are compiled for (`SWITCH_HIDDEN`).
LOW_LATENCY_HIDDEN = (2048, 2560, 4096, 5120, 6144, 7168, 8192)
#: Most top-k of the low-latency kernels (`kNumMaxTopK`) and of the normal ones (a device assertion).
LOW_LATENCY_MAX_TOP_K = 11
NORMAL_MAX_TOP_K = 32
#: Group sizes of the normal kernels: over NVLink within one host, over RDMA + NVLink across hosts
#: (`Buffer.get_dispatch_config`'s table; internode needs NVSHMEM).
INTRANODE_RANKS = (2, 4, 8)
INTERNODE_RANKS = (16, 24, 32, 64, 128, 144, 160)
#: Most local experts of the intranode notify kernel (its 128 threads) and of the host counters.
INTRANODE_MAX_LOCAL_EXPERTS = 128
MAX_LOCAL_EXPERTS = 1024
#: DeepEP v1.2.1 csrc/kernels/intranode.cu (dispatch): a row is an even number of 16-byte units, and half a row plus
#: an 8-byte barrier fits one warp's 8192-byte TMA buffer.
NORMAL_ROW_MULTIPLE = 32
NORMAL_TMA_BYTES_PER_WARP = 8192
#: The low-latency kernels' TMA wants `capacity * ranks` slots per expert in multiples of 4.
LOW_LATENCY_SLOT_MULTIPLE = 4
#: DeepEP's own workspace per buffer (`NUM_WORKSPACE_BYTES`).
WORKSPACE_BYTES = 32 * 2**20
#: `num_qps_per_rank` of an internode normal buffer (DeepEP's default).
INTERNODE_QPS = 24


class DeepEpDtypeUnsupported(UnsupportedDispatchDtype, UnsupportedCapability):
    """A dispatch dtype deepep does not carry, though the vendor may: both an unsupported dispatch dtype and a
    capability this dispatcher lacks (callers catching either see it)."""


def check_request(
    *,
    dtype: DispatchDtype,
    hidden_size: int,
    num_experts: int,
    world: int,
    capacity: int | None,
    fp8_built: bool,
    nvshmem_built: bool,
) -> None:
    """Refuse, naming the reason, a layer DeepEP cannot serve: its dtype, hidden size, ranks or capacity."""
    mode = NORMAL if capacity is None else LOW_LATENCY
    carried = "bf16 and fp8 (e4m3, fp32 scale per 128 channels)"
    if dtype not in CARRIED:
        raise DeepEpDtypeUnsupported(
            f"deepep carries {carried}, not {dtype}: choose DispatchConfig(dtype='bf16' or 'fp8'), or "
            "ep_dispatcher=None for the torch.distributed dispatcher, which carries every dtype"
        )
    if dtype is DispatchDtype.FP8 and not fp8_built:
        raise DeepEpDtypeUnsupported(
            "deepep fp8: this deep_ep is built without its sm90 features "
            "(DISABLE_SM90_FEATURES), so it carries bf16 only"
        )
    if dtype is DispatchDtype.FP8 and hidden_size % FP8_GROUP:
        raise UnsupportedCapability(
            f"deepep fp8: the hidden size must be a multiple of {FP8_GROUP} (one fp32 "
            f"scale per {FP8_GROUP} channels), got {hidden_size}"
        )
    if hidden_size % 8:
        raise UnsupportedCapability(
            f"deepep: rows must be whole 16-byte units (hidden a multiple of 8 bf16 values), got hidden {hidden_size}"
        )
    row_bytes = hidden_size * (1 if dtype is DispatchDtype.FP8 else 2)
    if row_bytes % NORMAL_ROW_MULTIPLE or row_bytes // 2 + 8 > NORMAL_TMA_BYTES_PER_WARP:
        # DeepEP's intranode kernel copies each half row through one warp's TMA buffer and asserts this on the
        # device (a failed assert kills the process, so refuse here)
        raise UnsupportedCapability(
            f"deepep: a {dtype} row of hidden {hidden_size} is {row_bytes} bytes; its normal-mode kernels need a "
            f"multiple of {NORMAL_ROW_MULTIPLE} bytes of at most {2 * (NORMAL_TMA_BYTES_PER_WARP - 8)}"
        )
    if world < 2:
        raise UnsupportedCapability(
            f"deepep needs an expert-parallel group of 2 or more ranks, got {world}; "
            "one rank dispatches locally (ep_dispatcher=None)"
        )
    if num_experts % world:
        raise InvalidInput(f"num_experts: expected a multiple of the {world} ranks for deepep, got {num_experts}")
    local = num_experts // world
    if capacity is None:
        _check_normal(world, local, nvshmem_built)
    else:
        _check_low_latency(hidden_size, world, capacity, nvshmem_built)
    if local > MAX_LOCAL_EXPERTS:
        raise UnsupportedCapability(f"deepep {mode} mode: at most {MAX_LOCAL_EXPERTS} experts per rank, got {local}")


def _check_normal(world: int, local: int, nvshmem_built: bool) -> None:
    if world not in INTRANODE_RANKS + INTERNODE_RANKS:
        raise UnsupportedCapability(
            f"deepep normal mode: DeepEP v1.2.1 has kernels for groups of {', '.join(map(str, INTRANODE_RANKS))} "
            f"ranks within a host and {', '.join(map(str, INTERNODE_RANKS))} across hosts, not {world}"
        )
    if world in INTRANODE_RANKS and local > INTRANODE_MAX_LOCAL_EXPERTS:
        raise UnsupportedCapability(
            f"deepep normal mode within a host: at most {INTRANODE_MAX_LOCAL_EXPERTS} experts per rank, got {local}"
        )
    if world in INTERNODE_RANKS and not nvshmem_built:
        raise UnsupportedCapability(
            f"deepep normal mode across hosts ({world} ranks) needs a deep_ep built with NVSHMEM"
        )


def _check_low_latency(hidden_size: int, world: int, capacity: int, nvshmem_built: bool) -> None:
    if not nvshmem_built:
        raise UnsupportedCapability(
            "deepep low-latency mode needs a deep_ep built with NVSHMEM (this one was "
            "built without it: see docs/deepep.md)"
        )
    if hidden_size not in LOW_LATENCY_HIDDEN:
        raise UnsupportedCapability(
            f"deepep low-latency mode: DeepEP v1.2.1's kernels are compiled for hidden sizes "
            f"{', '.join(map(str, LOW_LATENCY_HIDDEN))}, not {hidden_size}; use the normal mode (no "
            "max_dispatch_tokens_per_rank) or ep_dispatcher=None"
        )
    if (capacity * world) % LOW_LATENCY_SLOT_MULTIPLE:
        raise InvalidInput(
            f"max_dispatch_tokens_per_rank: expected a capacity whose slots per expert (capacity x {world} ranks) "
            f"are a multiple of {LOW_LATENCY_SLOT_MULTIPLE} for deepep's low-latency kernels, got {capacity}"
        )


@dataclass(frozen=True)
class BufferSize:
    """The sizes one `deep_ep.Buffer` is made with."""

    nvl_bytes: int = 0
    rdma_bytes: int = 0
    qps: int = 1  #: `num_qps_per_rank` (low-latency: at least the local experts)

    @property
    def total_bytes(self) -> int:
        """Device memory the buffer takes: both regions and DeepEP's workspace."""
        return self.nvl_bytes + self.rdma_bytes + WORKSPACE_BYTES

    def covers(self, other: BufferSize) -> bool:
        return self.nvl_bytes >= other.nvl_bytes and self.rdma_bytes >= other.rdma_bytes and self.qps >= other.qps

    def union(self, other: BufferSize) -> BufferSize:
        """The smallest size that covers both."""
        return BufferSize(
            max(self.nvl_bytes, other.nvl_bytes), max(self.rdma_bytes, other.rdma_bytes), max(self.qps, other.qps)
        )

    def describe(self) -> str:
        parts = [f"NVLink {self.nvl_bytes / 2**20:.1f} MiB"] if self.nvl_bytes else []
        parts += [f"RDMA/NVSHMEM {self.rdma_bytes / 2**20:.1f} MiB"] if self.rdma_bytes else []
        return " + ".join([*parts, f"workspace {WORKSPACE_BYTES / 2**20:.0f} MiB"])


def normal_size(deep_ep: Any, hidden_size: int, world: int) -> BufferSize:
    """The normal-mode buffer for rows of `hidden_size` (sized for bf16, the widest row DeepEP sends; fp8 rows
    and their scales take less) on `world` ranks, from DeepEP's size hints for its default configs."""
    row_bytes = 2 * hidden_size
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    nvl = max(int(c.get_nvl_buffer_size_hint(row_bytes, world)) for c in configs)
    if world in INTRANODE_RANKS:
        return BufferSize(nvl, 0, 1)
    rdma = max(int(c.get_rdma_buffer_size_hint(row_bytes, world)) for c in configs)
    return BufferSize(nvl, rdma, INTERNODE_QPS)


def low_latency_size(deep_ep: Any, capacity: int, hidden_size: int, world: int, num_experts: int) -> BufferSize:
    """The low-latency buffer (NVSHMEM) for `capacity` tokens per rank, DeepEP's own size hint."""
    rdma = int(deep_ep.Buffer.get_low_latency_rdma_size_hint(capacity, hidden_size, world, num_experts))
    return BufferSize(0, rdma, num_experts // world)


def memory_refusal(mode: str, size: BufferSize, free_bytes: int, freed_bytes: int, world: int) -> str | None:
    """Why a buffer of `size` cannot be made where `free_bytes` are free (the least over `world` ranks) and
    `freed_bytes` are given back first (the buffer it replaces); None when it fits."""
    available = free_bytes + freed_bytes
    if size.total_bytes <= available:
        return None
    replaced = f" plus {freed_bytes / 2**30:.2f} GiB of the buffer it replaces" if freed_bytes else ""
    return (
        f"deepep {mode} buffer: {size.describe()} = {size.total_bytes / 2**30:.2f} GiB exceeds the free device "
        f"memory ({free_bytes / 2**30:.2f} GiB, the least over the group's {world} ranks{replaced}); "
        + ("lower max_dispatch_tokens_per_rank, or " if mode == LOW_LATENCY else "")
        + "free device memory before building the layer, or use ep_dispatcher=None"
    )
