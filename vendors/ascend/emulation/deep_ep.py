"""An emulation of the Ascend DeepEP port's `Buffer` for one rank, on the CPU.

It covers the calls moe-hal's Ascend vendor makes, with the port's names and argument
order: normal-mode `get_dispatch_layout`, `dispatch` and `combine`, and the low-latency
`fused_deep_moe` (W8A8-INT8 only, as the port documents). Like the port, the normal-mode
dispatch decides whether to quantize the rows to int8 from the environment variable
`DEEP_NORMAL_MODE_USE_INT8_QUANT` read when the call runs; int8 rows come back as a pair
(int8 data, fp32 per-token scales) (assumption: the port's return form is not documented
in the material available here).

One rank only: a process group of more than one rank raises `NotImplementedError`. The
fused op computes with a plain per-expert loop in torch, independent of the vendor's
unfused path, so comparing the two means something.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: The variable the port's normal-mode dispatch reads.
INT8_VARIABLE = "DEEP_NORMAL_MODE_USE_INT8_QUANT"


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs to send rows back: the source token of each received row."""

    source_tokens: torch.Tensor
    num_tokens: int


class EmulatedDeepEp:
    """Module-like access to the emulated port: `EmulatedDeepEp(npu).Buffer(group)`."""

    def __init__(self, npu: Any) -> None:
        self._npu = npu

    def Buffer(self, group: object | None = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,  # noqa: N802
               low_latency_mode: bool = False, num_qps_per_rank: int = 24) -> EmulatedBuffer:
        """A buffer for `group` (the port's class name, kept so the vendor's call reads the same)."""
        return EmulatedBuffer(self._npu, group)


class EmulatedBuffer:
    """One rank's DeepEP buffer (emulated)."""

    def __init__(self, npu: Any, group: object | None) -> None:
        if group is not None:
            import torch.distributed as dist

            if dist.get_world_size(group) != 1:
                raise NotImplementedError(
                    "deep_ep emulation: only a single rank is emulated; a process group of "
                    f"{dist.get_world_size(group)} ranks needs the real Ascend DeepEP port")
        self._npu = npu

    # -- normal mode ------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Per-rank and per-expert token counts and which tokens go to which rank."""
        _check_ids(topk_idx, num_experts)
        valid = topk_idx >= 0
        in_rank = valid.any(dim=1, keepdim=True)
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        return per_rank, None, per_expert, in_rank, None

    def dispatch(self, x: torch.Tensor, handle: Any = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None,
                 is_token_in_rank: torch.Tensor | None = None, num_tokens_per_expert: torch.Tensor | None = None,
                 topk_idx: torch.Tensor | None = None, topk_weights: torch.Tensor | None = None,
                 expert_alignment: int = 1, config: Any = None, previous_event: Any = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        """Send each token once to every rank holding one of its experts (here: this rank).

        Returns `(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)`; `recv_x` is `(int8 data, fp32 scales)` when `DEEP_NORMAL_MODE_USE_INT8_QUANT`
        is "1" at the time of the call, else the rows as given.
        """
        if topk_idx is None or topk_weights is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise RuntimeError("deep_ep dispatch: topk_idx, topk_weights, is_token_in_rank and "
                               "num_tokens_per_expert are required in normal mode")
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(f"deep_ep dispatch: x must be a 2-D bf16/fp16 tensor, got {x.dtype} {tuple(x.shape)}")
        source = is_token_in_rank[:, 0].nonzero(as_tuple=True)[0]
        rows = x.index_select(0, source)
        int8 = os.environ.get(INT8_VARIABLE, "0").strip().lower() in ("1", "true")
        recv_x: Any = tuple(self._npu.npu_dynamic_quant(rows)) if int8 else rows
        counts = [int(c) for c in num_tokens_per_expert.tolist()]
        aligned = [-(-c // expert_alignment) * expert_alignment for c in counts]
        return (recv_x, topk_idx.index_select(0, source), topk_weights.index_select(0, source), aligned,
                DispatchHandle(source, x.shape[0]), None)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                config: Any = None, previous_event: Any = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        """Return each received row to its token, summed over ranks: `(combined_x, None, None)`."""
        out = torch.zeros((handle.num_tokens, x.shape[-1]), dtype=x.dtype, device=x.device)
        out.index_add_(0, handle.source_tokens, x)
        return out, None, None

    # -- low latency, fused -----------------------------------------------------------------------

    def fused_deep_moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       gmm1_permuted_weight: torch.Tensor, gmm1_permuted_weight_scale: torch.Tensor,
                       gmm2_weight: torch.Tensor, gmm2_weight_scale: torch.Tensor,
                       num_max_dispatch_tokens_per_rank: int, num_experts: int,
                       quant_mode: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch, `int8 GEMM -> swiglu -> int8 GEMM` per expert, and the weighted combine.

        Activations are quantized per token to int8 (scale `rowmax|x| / 127`) before each GEMM;
        each GEMM's result is rounded to bf16. Returns `(out [T, H] bf16, ep_recv_count)`,
        the tokens each local expert received, int32 `[local_experts]`.
        """
        if quant_mode != 1:
            raise NotImplementedError("deep_ep fused_deep_moe emulation: only quant_mode=1 (W8A8 INT8)")
        t = x.shape[0]
        if t > num_max_dispatch_tokens_per_rank:
            raise RuntimeError(f"deep_ep fused_deep_moe: {t} tokens exceed num_max_dispatch_tokens_per_rank="
                               f"{num_max_dispatch_tokens_per_rank}")
        local = gmm1_permuted_weight.shape[0]
        if num_experts != local:
            raise RuntimeError(f"deep_ep fused_deep_moe: num_experts={num_experts} but one rank holds {local}")
        if gmm1_permuted_weight.dtype != torch.int8 or gmm2_weight.dtype != torch.int8:
            raise RuntimeError("deep_ep fused_deep_moe: W8A8 INT8 expects int8 weights")
        _check_ids(topk_idx, num_experts)
        xq, xs = self._npu.npu_dynamic_quant(x.to(torch.bfloat16))
        out = torch.zeros((t, gmm2_weight.shape[-1]), dtype=torch.float32, device=x.device)
        received = torch.zeros(local, dtype=torch.int32, device=x.device)
        for e in range(local):
            token, slot = (topk_idx == e).nonzero(as_tuple=True)
            received[e] = token.numel()
            if token.numel() == 0:
                continue
            h = _int8_product(xq[token], xs[token], gmm1_permuted_weight[e], gmm1_permuted_weight_scale[e])
            half = h.shape[-1] // 2
            act = (F.silu(h[:, :half].float()) * h[:, half:].float()).to(torch.bfloat16)
            aq, a_scale = self._npu.npu_dynamic_quant(act)
            y = _int8_product(aq, a_scale, gmm2_weight[e], gmm2_weight_scale[e])
            out.index_add_(0, token, topk_weights[token, slot].float().unsqueeze(1) * y.float())
        return out.to(torch.bfloat16), received


def _int8_product(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`(a @ w) * a_scale * w_scale` with the exact integer product, rounded to bf16."""
    acc = a.to(torch.float64) @ w.to(torch.float64)
    return (acc.to(torch.float32) * a_scale.unsqueeze(1) * w_scale.to(torch.float32)).to(torch.bfloat16)


def _check_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise RuntimeError(f"deep_ep: topk_idx must be 2-D int64, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise RuntimeError(f"deep_ep: expert ids must lie in [-1, {num_experts}), got "
                           f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
