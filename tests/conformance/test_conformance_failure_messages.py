"""The words a failing conformance check prints: where the worst element is and how many are out of bounds."""

import torch

from conformance.reference import worst


def test_worst_names_the_element_furthest_out_and_counts_those_outside():
    error = torch.tensor([[0.1, 0.5], [3.0, 0.2]], dtype=torch.float64)
    bound = torch.ones(2, 2, dtype=torch.float64)
    text = worst(error, bound)
    assert text.startswith("1 of 4 elements out of bounds;")
    assert "worst at (1, 0)" in text and "error 3 > bound 1" in text


def test_worst_counts_nan_errors_as_out_of_bounds_and_points_at_the_first():
    error = torch.tensor([0.1, float("nan"), 5.0, float("nan")], dtype=torch.float64)
    bound = torch.ones(4, dtype=torch.float64)
    text = worst(error, bound)
    assert text.startswith("3 of 4 elements out of bounds (2 of them NaN);")
    assert "worst at (1,)" in text and "error nan" in text
