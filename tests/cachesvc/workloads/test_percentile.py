"""The one percentile every bench and the simulator report (q a percent, linear, NaN of nothing)."""

from __future__ import annotations

import math

import pytest

from cachesvc.workloads.table import percentile


def test_one_value_is_every_percentile() -> None:
    assert [percentile([7.0], q) for q in (0, 50, 99, 100)] == [7.0, 7.0, 7.0, 7.0]


def test_two_values_interpolate_linearly() -> None:
    values = [30.0, 10.0]  # unsorted on purpose
    assert percentile(values, 0) == 10.0
    assert percentile(values, 50) == pytest.approx(20.0)
    assert percentile(values, 99) == pytest.approx(29.8)
    assert percentile(values, 100) == 30.0


def test_matches_numpys_default_between_closest_ranks() -> None:
    values = [float(v) for v in (5, 1, 9, 3, 7, 2, 8)]
    numpy = pytest.importorskip("numpy")
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


def test_empty_is_nan_not_a_zero_figure() -> None:
    assert math.isnan(percentile([], 50))


@pytest.mark.parametrize("q", [-1, -0.5, 100.5, 101])
def test_q_outside_0_to_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match="q must be a percent"):
        percentile([1.0, 2.0], q)
