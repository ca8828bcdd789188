"""Reference per-expert bias: each row of a grouped-matmul output plus its group's bias row."""

from __future__ import annotations

import torch

from hal import checks
from hal.groups import Groups


def add_expert_bias(y: torch.Tensor, bias: torch.Tensor, groups: Groups) -> torch.Tensor:
    """`y[r] + bias[group of r]` for `y` `[M, N]` sorted by group and `bias` `[G, N]`, computed in
    fp32, returned in y.dtype. Rows past the groups' total (padding) take the last group's bias."""
    checks.expert_bias_operands(y, bias, groups)
    return add_group_bias(y, bias, groups)


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, groups: Groups) -> torch.Tensor:
    """`add_expert_bias` of checked operands (no host synchronisation)."""
    rows = torch.arange(y.shape[0], device=y.device)
    offsets = groups.offsets().to(y.device)
    group_of_row = torch.searchsorted(offsets, rows, right=True).clamp_(max=bias.shape[0] - 1)
    return (y.to(torch.float32) + bias.to(torch.float32)[group_of_row]).to(y.dtype)
