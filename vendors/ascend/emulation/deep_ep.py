"""An emulation of the Ascend DeepEP port's `Buffer` (sgl-kernel-npu, `python/deep_ep/`) for one rank.

It models the PORT's contract, not CUDA DeepEP's. Sources (sgl-project/sgl-kernel-npu at
f425bdf, 2026-08-21): `python/deep_ep/deep_ep/buffer.py`, `.../strategies/normal_strategy.py`,
`.../ep_strategy.py`, `python/deep_ep/doc/NORMAL_API.md`, `doc/FUSED_DEEP_MOE.md`,
`tests/python/deepep/test_fused_deep_moe.py`, and `../shared/reference/torch_npu.md`.

- `Buffer(group)` calls `group.rank()` and `group.size()` (buffer.py `__init__`): `None`
  fails with the AttributeError the port raises. More than one rank: NotImplementedError.
- normal `dispatch` returns one row per (token, local expert) pair, grouped by local expert
  (token order within an expert, assumption), `num_recv_tokens_per_expert_list` the rows per
  expert; `recv_topk_idx` / `recv_topk_weights` are allocated but NOT filled (torch.md): here
  they hold garbage (ids 2**40, weights NaN) so a caller that reads them computes wrong.
  int8 rows come back as `(int8 [R, H], fp32 [R])` (buffer.py dispatch docstring).
  Which form: `quant_mode=` ("bf16" | "int8"; normal_strategy.py) where the modelled port
  version has it, else the variable `DEEP_NORMAL_MODE_USE_INT8_QUANT == "1"`, read at the call.
- `combine(x, handle)` applies the dispatch's `topk_weights` itself (the handle carries
  them; normal_strategy.py `_intranode_combine` passes `topk_weights_ori` to the kernel).
- `fused_deep_moe` (FuseMode 1): built for A3 and A5 only; the limits of FUSED_DEEP_MOE.md
  (bs 1..256, hidden 512..7168, gmm1 N = 2I 1024..6144 (A5: a multiple of 1024), top-k 1..12,
  experts 1..512, bs <= num_max_dispatch_tokens_per_rank); int8 weights in FRACTAL_NZ (the
  emulated tag of `npu_format`; A3 only: the A5 host op also takes ND), w13 and its scale
  tile-permuted along N (64-column gate/up tiles, `reshape_fusion_gmm_weight` /
  `permute_weight` of the port's test), w2 `[E, H, I]`. Id -1 means "not dispatched"
  (buffer.py docstring; the port's test zeroes those weights); other ids outside
  [0, num_experts) raise. Computed with a plain per-expert loop, independent of the vendor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vendors.ascend.emulation.npu_format import ACL_FORMAT_FRACTAL_NZ, get_npu_format

INT8_VARIABLE = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
#: Modelled port versions: "variable-only" (dispatch has no `quant_mode`: the port before
#: the strategy refactor, sgl-kernel-npu 2025/early 2026) and "quant-mode" (f425bdf).
PORT_VERSIONS = ("variable-only", "quant-mode")
DEFAULT_PORT_VERSION = "quant-mode"
GMM_TILE_N = 64  # test_fused_deep_moe.py GMM_TILE_N_DIM
_UNFILLED_ID = 2**40


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs: the source token and routing weight of every received row."""

    source_tokens: torch.Tensor
    row_weights: torch.Tensor
    num_tokens: int


class EmulatedDeepEp:
    """Module-like access to the emulated port: `EmulatedDeepEp(npu).Buffer(group)`."""

    def __init__(self, npu: Any, version: str = DEFAULT_PORT_VERSION) -> None:
        if version not in PORT_VERSIONS:
            raise ValueError(f"deep_ep emulation: unknown port version {version!r}; modelled: {PORT_VERSIONS}")
        self._npu = npu
        self.version = version

    def Buffer(
        self,
        group: Any,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,  # noqa: N802
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 12,
        **kwargs: Any,
    ) -> EmulatedBuffer:
        """The port's constructor: `group` is required and must answer `rank()` / `size()`."""
        return EmulatedBuffer(self._npu, group, self.version)


class EmulatedBuffer:
    """One rank's DeepEP buffer (emulated)."""

    def __init__(self, npu: Any, group: Any, version: str) -> None:
        self.rank, self.group_size = group.rank(), group.size()  # None: AttributeError, as the port
        if self.group_size != 1:
            raise NotImplementedError(f"deep_ep emulation: one rank only, got a group of {self.group_size}")
        self._npu, self._version = npu, version
        if version == "variable-only":  # the older signature: no quant_mode keyword at all
            self.dispatch = self._dispatch_variable_only  # type: ignore[method-assign]

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        """Per-rank and per-expert token counts and which tokens go to which rank."""
        _check_ids(topk_idx, num_experts)
        valid = topk_idx >= 0
        in_rank = valid.any(dim=1, keepdim=True)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return in_rank.sum(dim=0).to(torch.int32), None, per_expert, in_rank, None

    def dispatch(
        self,
        x: torch.Tensor,
        handle: Any = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        dispatch_wait_recv_cost_stats: Any = None,
        quant_mode: str | None = None,
    ) -> tuple:
        """`(recv_x, recv_topk_idx (unfilled), recv_topk_weights (unfilled), counts per local expert,
        handle, event)`; rows per (token, local expert) pair, grouped by expert."""
        if quant_mode is None:
            int8 = os.environ.get(INT8_VARIABLE) == "1"  # normal_strategy.py: getenv(...) == "1"
        elif quant_mode in ("bf16", "int8"):
            int8 = quant_mode == "int8"
        elif quant_mode in ("mx_fp8_e4m3", "mx_fp8_e5m2", "mx_fp4_e2m1"):
            raise NotImplementedError(f"deep_ep emulation: quant_mode={quant_mode!r} (A5 MX formats) is not emulated")
        else:
            raise ValueError(f"Invalid quant_mode: {quant_mode}")
        return self._dispatch(
            x, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, int8
        )

    def _dispatch_variable_only(
        self,
        x: torch.Tensor,
        handle: Any = None,
        num_tokens_per_rank: Any = None,
        num_tokens_per_rdma_rank: Any = None,
        is_token_in_rank: Any = None,
        num_tokens_per_expert: Any = None,
        topk_idx: Any = None,
        topk_weights: Any = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        int8 = os.environ.get(INT8_VARIABLE) == "1"
        return self._dispatch(
            x, handle, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, int8
        )

    def _dispatch(
        self,
        x: torch.Tensor,
        handle: Any,
        is_token_in_rank: Any,
        num_tokens_per_expert: Any,
        topk_idx: Any,
        topk_weights: Any,
        expert_alignment: int,
        int8: bool,
    ) -> tuple:
        if handle is not None:
            raise NotImplementedError("Optional communication handle is not supported yet.")  # the port's words
        if any(v is None for v in (is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)):
            raise AssertionError(
                "deep_ep dispatch: is_token_in_rank, num_tokens_per_expert, topk_idx and "
                "topk_weights are required in normal mode"
            )
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.bfloat16:
            raise TypeError(f"deep_ep dispatch: x must be a bf16 tensor [T, H], got {getattr(x, 'dtype', type(x))}")
        if expert_alignment != 1:
            raise NotImplementedError("deep_ep emulation: expert_alignment != 1 is not emulated")
        num_experts = num_tokens_per_expert.numel()
        _check_ids(topk_idx, num_experts)
        token, slot = (topk_idx >= 0).nonzero(as_tuple=True)
        experts = topk_idx[token, slot]
        order = torch.sort(experts * topk_idx.shape[0] + token, stable=True).indices  # by expert, then token
        token, slot, experts = token[order], slot[order], experts[order]
        rows = x.index_select(0, token)
        recv_x: Any = tuple(self._npu.npu_dynamic_quant(rows)) if int8 else rows
        counts = torch.bincount(experts, minlength=num_experts).tolist()
        unfilled_idx = torch.full((rows.shape[0], topk_idx.shape[1]), _UNFILLED_ID, dtype=torch.int64)
        unfilled_w = torch.full((rows.shape[0], topk_idx.shape[1]), float("nan"), dtype=torch.float32)
        handle = DispatchHandle(token, topk_weights[token, slot].to(torch.float32), x.shape[0])
        return recv_x, unfilled_idx, unfilled_w, counts, handle, None

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        combine_send_cost_stats: Any = None,
    ) -> tuple:
        """Each received row times its pair's dispatch weight, summed per source token: `(out, None, None)`."""
        if x.dim() != 2 or x.shape[0] != handle.source_tokens.numel():
            raise RuntimeError(
                f"deep_ep combine: x must have one row per received pair "
                f"({handle.source_tokens.numel()}), got {tuple(x.shape)}"
            )
        out = torch.zeros((handle.num_tokens, x.shape[-1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, handle.source_tokens, x.float() * handle.row_weights.unsqueeze(1))
        return out.to(x.dtype), None, None

    def fused_deep_moe(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        gmm1_permuted_weight: torch.Tensor,
        gmm1_permuted_weight_scale: torch.Tensor,
        gmm2_weight: torch.Tensor,
        gmm2_weight_scale: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        quant_mode: int = 1,
        fuse_mode: int = 1,
        profile_enable: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FuseMode 1, W8A8 INT8: `(out [bs, H] bf16, ep_recv_count int32 [local * ranks])`."""
        generation = getattr(self._npu, "generation", "A2")
        if generation not in ("A3", "A5"):
            raise RuntimeError(
                f"deep_ep fused_deep_moe: aclnnFusedDeepMoe is not built for {generation} "
                "(FUSED_DEEP_MOE.md: A3 and A5)"
            )
        if quant_mode != 1 or fuse_mode != 1:
            raise NotImplementedError("deep_ep fused_deep_moe emulation: quant_mode=1, fuse_mode=1 only")
        local = gmm1_permuted_weight.shape[0]
        bs, hidden = x.shape
        k, n1 = topk_idx.shape[1], gmm1_permuted_weight.shape[-1]
        problems = _fused_limit_problems(generation, bs, hidden, n1, k, num_experts, num_max_dispatch_tokens_per_rank)
        if problems:
            raise RuntimeError("deep_ep fused_deep_moe: " + "; ".join(problems))
        if num_experts != local:
            raise RuntimeError(f"deep_ep fused_deep_moe: num_experts={num_experts} but one rank holds {local}")
        for name, w, shape in (
            ("gmm1_permuted_weight", gmm1_permuted_weight, (local, hidden, n1)),
            ("gmm2_weight", gmm2_weight, (local, hidden, n1 // 2)),
        ):
            if w.dtype != torch.int8 or tuple(w.shape) != shape:
                raise RuntimeError(
                    f"deep_ep fused_deep_moe: {name} must be int8 {list(shape)}, got {w.dtype} {list(w.shape)}"
                )
            if generation == "A3" and get_npu_format(None, w) != ACL_FORMAT_FRACTAL_NZ:
                raise RuntimeError(
                    f"deep_ep fused_deep_moe: {name} must be FRACTAL_NZ (npu_format_cast(w, 29)), "
                    f"got format {get_npu_format(None, w)}"
                )
        _check_ids(topk_idx, num_experts)
        w13 = unpermute_tiles(gmm1_permuted_weight)
        s13 = unpermute_tiles(gmm1_permuted_weight_scale.to(torch.float32))
        xq, xs = self._npu.npu_dynamic_quant(x.to(torch.bfloat16))
        out = torch.zeros((bs, hidden), dtype=torch.float32, device=x.device)
        received = torch.zeros(local, dtype=torch.int32, device=x.device)
        for e in range(local):
            token, slot = (topk_idx == e).nonzero(as_tuple=True)
            received[e] = token.numel()
            if token.numel() == 0:
                continue
            h = _int8_product(xq[token], xs[token], w13[e], s13[e])
            half = h.shape[-1] // 2
            act = (F.silu(h[:, :half].float()) * h[:, half:].float()).to(torch.bfloat16)
            aq, a_scale = self._npu.npu_dynamic_quant(act)
            y = _int8_product(aq, a_scale, gmm2_weight[e].t(), gmm2_weight_scale[e].to(torch.float32))
            out.index_add_(0, token, topk_weights[token, slot].float().unsqueeze(1) * y.float())
        return out.to(torch.bfloat16), received


def _fused_limit_problems(
    generation: str, bs: int, hidden: int, n1: int, k: int, num_experts: int, capacity: int
) -> list[str]:
    found = []
    for name, value, low, high in (
        ("bs", bs, 1, 256),
        ("hidden", hidden, 512, 7168),
        ("gmm1_hidden", n1, 1024, 6144),
        ("num_topk", k, 1, 12),
        ("num_experts", num_experts, 1, 512),
    ):
        if not low <= value <= high:
            found.append(f"{name}={value} outside [{low}, {high}]")
    if n1 % (2 * GMM_TILE_N):
        found.append(f"gmm1_hidden={n1} must be a multiple of {2 * GMM_TILE_N} (the tile-N permutation)")
    if generation == "A5" and n1 % 1024:
        found.append(f"gmm1_hidden={n1} must be a multiple of 1024 on A5")
    if bs > capacity:
        found.append(f"bs={bs} exceeds num_max_dispatch_tokens_per_rank={capacity}")
    return found


def unpermute_tiles(permuted: torch.Tensor) -> torch.Tensor:
    """Inverse of the port test's tile-N permutation along the last dim: `[.., (N/128, 2, 64)]` ->
    `[.., (2, N/128, 64)]`, i.e. back to gate columns first, then up columns."""
    *lead, n = permuted.shape
    tiles = permuted.reshape(*lead, n // (2 * GMM_TILE_N), 2, GMM_TILE_N)
    return tiles.transpose(-3, -2).reshape(*lead, n)


def _int8_product(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`(a @ w) * a_scale * w_scale` with the exact integer product, rounded to bf16."""
    acc = a.to(torch.float64) @ w.to(torch.float64)
    return (acc.to(torch.float32) * a_scale.unsqueeze(1) * w_scale.to(torch.float32)).to(torch.bfloat16)


def _check_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise RuntimeError(f"deep_ep: topk_idx must be 2-D int64, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise RuntimeError(
            f"deep_ep: expert ids must lie in [-1, {num_experts}), got [{int(topk_idx.min())}, {int(topk_idx.max())}]"
        )
