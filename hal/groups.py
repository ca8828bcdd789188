"""How the rows of a grouped matmul are split among groups (experts).

Rows are sorted by group. The split is given either as per-group row counts or as
cumulative end offsets (the two forms engines and kernels use; torch_npu calls them
`group_list_type` 1 and 0).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from hal.errors import InvalidInput


class GroupListKind(str, enum.Enum):
    """The form of a group list."""

    COUNTS = "counts"  #: rows per group
    OFFSETS = "offsets"  #: cumulative end row of each group

    def __str__(self) -> str:
        return self.value


_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Groups:
    """A validated group list: a 1-D int32/int64 tensor and its form.

    Construction checks only metadata (no device synchronisation); `check_values`
    checks the numbers and is meant for host-side reference code.
    """

    tensor: torch.Tensor
    kind: GroupListKind

    def __post_init__(self) -> None:
        if type(self.kind) is not GroupListKind:  # a member already (every call the layer makes) is kept as is
            object.__setattr__(self, "kind", GroupListKind(self.kind))
        if not isinstance(self.tensor, torch.Tensor):
            raise InvalidInput(f"groups: expected a 1-D int32/int64 tensor, got {type(self.tensor).__name__}")
        if self.tensor.dim() != 1 or self.tensor.dtype not in _INT_DTYPES:
            raise InvalidInput(
                f"groups ({self.kind}): expected a 1-D int32/int64 tensor, "
                f"got {self.tensor.dtype} of shape {tuple(self.tensor.shape)}"
            )
        if self.tensor.numel() == 0:
            raise InvalidInput(f"groups ({self.kind}): expected at least one group, got none")

    @classmethod
    def from_counts(cls, counts: torch.Tensor) -> Groups:
        """Groups given as rows per group."""
        return cls(counts, GroupListKind.COUNTS)

    @classmethod
    def from_offsets(cls, offsets: torch.Tensor) -> Groups:
        """Groups given as the cumulative end row of each group."""
        return cls(offsets, GroupListKind.OFFSETS)

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return self.tensor.numel()

    def counts(self) -> torch.Tensor:
        """Rows per group, int64, on the tensor's device."""
        t = self.tensor if self.tensor.dtype == torch.int64 else self.tensor.to(torch.int64)
        if self.kind is GroupListKind.COUNTS:
            return t
        return torch.diff(t, prepend=t.new_zeros(1))

    def offsets(self) -> torch.Tensor:
        """Cumulative end row of each group, int64, on the tensor's device."""
        t = self.tensor.to(torch.int64)
        return t if self.kind is GroupListKind.OFFSETS else torch.cumsum(t, 0)

    def check_values(self, rows: int) -> list[int]:
        """Validate the numbers against `rows` and return the counts as Python ints.

        Counts must be non-negative, offsets non-decreasing and non-negative, and the
        total must equal `rows`. Reads the values on the host.
        """
        values = [int(v) for v in self.tensor.tolist()]
        if self.kind is GroupListKind.COUNTS:
            if any(v < 0 for v in values):
                raise InvalidInput(f"groups (counts): expected non-negative counts, got {values}")
            counts = values
        else:
            if any(v < 0 for v in values) or any(b < a for a, b in zip(values, values[1:])):
                raise InvalidInput(f"groups (offsets): expected non-negative, non-decreasing offsets, got {values}")
            counts = [b - a for a, b in zip([0, *values], values)]
        if sum(counts) != rows:
            raise InvalidInput(
                f"groups ({self.kind}): expected groups covering all {rows} rows, got {sum(counts)} rows in {values}"
            )
        return counts
