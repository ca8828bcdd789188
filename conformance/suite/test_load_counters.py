"""`accumulate_counts`: the load counters a layer keeps on the device, against counts made on the host,
over many calls (the ring wraps), at decode and prefill sizes (one launch and many programs on CUDA),
for ids of either integer width and ids outside the range (not counted)."""

from __future__ import annotations

import pytest
import torch

from conformance.capability import LOAD_COUNTERS, mark
from conformance.reference import generator
from hal import InvalidInput

pytestmark = mark(LOAD_COUNTERS)


def _counters(vendor, bins: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    make = {"dtype": torch.int64, "device": vendor.device}
    return torch.zeros(bins, **make), torch.zeros(rows, bins, **make), torch.zeros(1, **make)


@pytest.mark.parametrize(
    "bins, sizes", [(8, [1, 2, 3, 5]), (128, [8, 64, 512, 7]), (257, [24576, 3, 40000, 8]), (1000, [31, 16385, 0, 2])]
)
def test_accumulated_counts_match_host_counts(hal_vendor, bins, sizes):
    gen = generator("counters", bins)
    rows = 3  # a window of two calls
    total, ring, step = _counters(hal_vendor, bins, rows)
    history = []
    for call, n in enumerate(sizes * 2):
        ids = torch.randint(-2, bins + 3, (n,), generator=gen)
        if call % 2:
            ids = ids.to(torch.int32)
        counted = torch.bincount(ids[(ids >= 0) & (ids < bins)].long(), minlength=bins)
        history.append(counted)
        hal_vendor.accumulate_counts(ids.to(hal_vendor.device), total, ring, step, ids=True)
    assert torch.equal(total.cpu(), sum(history)), "cumulative counts differ from the host's"
    assert torch.equal(ring.sum(0).cpu(), history[-1] + history[-2]), "the window is not the last two calls"
    assert int(step.item()) == len(history)
    assert not ring[int(step.item()) % rows].any(), "the ring's next row is not zero"


def test_accumulated_given_counts(hal_vendor):
    gen = generator("counters", "given")
    total, ring, step = _counters(hal_vendor, 97, 5)
    calls = [torch.randint(0, 4096, (97,), generator=gen, dtype=torch.int32) for _ in range(7)]
    for counts in calls:
        hal_vendor.accumulate_counts(counts.to(hal_vendor.device), total, ring, step, ids=False)
    assert torch.equal(total.cpu(), sum(c.long() for c in calls))
    assert torch.equal(ring.sum(0).cpu(), sum(c.long() for c in calls[-4:]))


def test_bad_counters_are_refused(hal_vendor):
    total, ring, step = _counters(hal_vendor, 8, 3)
    ids = torch.zeros(4, dtype=torch.int64, device=hal_vendor.device)
    with pytest.raises(InvalidInput, match="values"):
        hal_vendor.accumulate_counts(ids.float(), total, ring, step, ids=True)
    with pytest.raises(InvalidInput, match="values"):
        hal_vendor.accumulate_counts(ids, total, ring, step, ids=False)  # counts need one per bin
    with pytest.raises(InvalidInput, match="counters"):
        hal_vendor.accumulate_counts(ids, total, ring[:1], step, ids=True)
    with pytest.raises(InvalidInput, match="total"):
        hal_vendor.accumulate_counts(ids, total.int(), ring, step, ids=True)
