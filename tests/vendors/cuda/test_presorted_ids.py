"""The routing launch's sort is handed to the sort call only for the same, unchanged ids (runs on the CPU)."""

from __future__ import annotations

import gc
import weakref

import torch

from hal.reference import sort_by_expert
from vendors.cuda.presorted import PresortedIds


def _sorted(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, ...]:
    order, inverse, counts = sort_by_expert(ids, experts)
    return order, inverse, counts, order // ids.shape[1]


def test_the_kept_sort_is_taken_once_for_the_same_ids():
    kept, ids = PresortedIds(), torch.tensor([[3, 1], [0, 3]])
    sorted_pairs = _sorted(ids, 4)
    kept.keep(ids, 4, sorted_pairs)
    assert kept.take(ids, 4, tokens=True) is sorted_pairs
    assert kept.take(ids, 4, tokens=True) is None  # once: a second sort of the ids sorts again


def test_without_tokens_the_kept_sort_gives_order_inverse_and_counts():
    kept, ids = PresortedIds(), torch.tensor([[2, 0]])
    sorted_pairs = _sorted(ids, 3)
    kept.keep(ids, 3, sorted_pairs)
    assert kept.take(ids, 3, tokens=False) == sorted_pairs[:3]


def test_other_ids_an_equal_copy_or_another_expert_count_are_not_given_the_kept_sort():
    kept, ids = PresortedIds(), torch.tensor([[1, 0]])
    kept.keep(ids, 2, _sorted(ids, 2))
    assert kept.take(ids.clone(), 2, tokens=True) is None
    assert kept.take(ids, 3, tokens=True) is None
    assert kept.take(ids, 2, tokens=True) is not None


def test_ids_written_in_place_since_are_not_given_the_kept_sort():
    kept, ids = PresortedIds(), torch.tensor([[1, 0]])
    kept.keep(ids, 2, _sorted(ids, 2))
    ids[0, 0] = 0
    assert kept.take(ids, 2, tokens=True) is None


def test_the_kept_sort_does_not_keep_its_ids_alive():
    kept, ids = PresortedIds(), torch.tensor([[1, 0]])
    kept.keep(ids, 2, _sorted(ids, 2))
    alive = weakref.ref(ids)
    del ids
    gc.collect()
    assert alive() is None


def test_the_kept_sort_goes_when_its_ids_go():
    kept, ids = PresortedIds(), torch.tensor([[1, 0]])
    sorted_pairs = _sorted(ids, 2)
    kept.keep(ids, 2, sorted_pairs)
    order = weakref.ref(sorted_pairs[0])
    del sorted_pairs, ids
    gc.collect()
    assert order() is None
