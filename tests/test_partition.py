"""jaxdist.export.partition: the balanced split against a brute-force enumeration of every split."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdist.core.errors import SpecError
from jaxdist.export.partition import balanced_split, explicit_split


def all_splits(n: int, k: int) -> list[list[range]]:
    """Every way to cut ``n`` units into ``k`` contiguous, non-empty stages."""
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        out.append([range(edges[i], edges[i + 1]) for i in range(k)])
    return out


def max_load(split: Sequence[range], costs: Sequence[float], caps: Sequence[float]) -> float:
    return max(sum(costs[i] for i in r) / c for r, c in zip(split, caps))


def assert_is_split(split: Sequence[range], n: int, k: int) -> None:
    assert len(split) == k
    assert split[0].start == 0 and split[-1].stop == n
    for a, b in zip(split, split[1:]):
        assert a.stop == b.start
    assert all(len(r) >= 1 and r.step == 1 for r in split)


# Integer costs and capacities keep every load exact in float, so optima compare with ==.
@st.composite
def problems(draw: st.DrawFn, weighted: bool) -> tuple[list[int], int, list[int] | None]:
    costs = draw(st.lists(st.integers(0, 50), min_size=1, max_size=8))
    k = draw(st.integers(1, len(costs)))
    caps = draw(st.lists(st.integers(1, 5), min_size=k, max_size=k)) if weighted else None
    return costs, k, caps


@settings(max_examples=300, deadline=None)
@given(problems(weighted=False))
def test_balanced_split_is_optimal(problem: tuple[list[int], int, None]) -> None:
    costs, k, _ = problem
    caps = [1] * k
    got = balanced_split(costs, k)
    assert_is_split(got, len(costs), k)
    best = min(max_load(s, costs, caps) for s in all_splits(len(costs), k))
    assert max_load(got, costs, caps) == best


@settings(max_examples=300, deadline=None)
@given(problems(weighted=True))
def test_balanced_split_with_capacities_is_optimal(
        problem: tuple[list[int], int, list[int]]) -> None:
    costs, k, caps = problem
    got = balanced_split(costs, k, caps)
    assert_is_split(got, len(costs), k)
    best = min(max_load(s, costs, caps) for s in all_splits(len(costs), k))
    assert max_load(got, costs, caps) == best


def test_capacities_shift_units_to_the_bigger_worker() -> None:
    costs = [1] * 12
    even = balanced_split(costs, 2)
    assert [len(r) for r in even] == [6, 6]
    # A worker with 3x the memory should take 3x the units: 3 + 9.
    weighted = balanced_split(costs, 2, [1.0, 3.0])
    assert [len(r) for r in weighted] == [3, 9]
    assert [len(r) for r in balanced_split(costs, 2, [3.0, 1.0])] == [9, 3]


def test_equal_costs_keep_earlier_stages_lighter() -> None:
    # On a tie, the earlier stage gets fewer units (stage 0 also carries coordinator traffic).
    for n in range(1, 16):
        for k in range(1, n + 1):
            sizes = [len(r) for r in balanced_split([7] * n, k)]
            assert sizes == sorted(sizes), (n, k, sizes)
            assert max(sizes) - min(sizes) <= 1, (n, k, sizes)


def test_one_stage_and_one_unit_per_stage() -> None:
    assert balanced_split([5, 1, 9], 1) == [range(0, 3)]
    assert balanced_split([5, 1, 9], 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_heavy_unit_gets_its_own_stage() -> None:
    assert balanced_split([1, 1, 100, 1, 1], 3) == [range(0, 2), range(2, 3), range(3, 5)]


def test_explicit_split() -> None:
    assert explicit_split(5, [2, 3]) == [range(0, 2), range(2, 5)]
    assert explicit_split(3, [1, 1, 1]) == [range(0, 1), range(1, 2), range(2, 3)]
    assert explicit_split(4, [4]) == [range(0, 4)]


# -- errors ---------------------------------------------------------------------------------------


def test_error_too_many_stages() -> None:
    with pytest.raises(SpecError, match=r"cannot split 3 units into 4 stages: expected between "
                                        r"1 and 3 stages"):
        balanced_split([1, 2, 3], 4)


def test_error_zero_stages() -> None:
    with pytest.raises(SpecError, match=r"cannot split 3 units into 0 stages"):
        balanced_split([1, 2, 3], 0)


def test_error_no_units() -> None:
    with pytest.raises(SpecError, match=r"cannot split 0 units into 1 stages"):
        balanced_split([], 1)


def test_error_capacities_wrong_length() -> None:
    with pytest.raises(SpecError, match=r"capacities: expected 2 positive numbers, found \[1\.0\]"):
        balanced_split([1, 2, 3], 2, [1.0])


def test_error_capacities_not_positive() -> None:
    with pytest.raises(SpecError, match=r"capacities: expected 2 positive numbers, found \[1, 0\]"):
        balanced_split([1, 2, 3], 2, [1, 0])


def test_error_explicit_counts_do_not_add_up() -> None:
    with pytest.raises(SpecError, match=r"split \[2, 2\]: expected positive unit counts adding up "
                                        r"to 5, found a sum of 4"):
        explicit_split(5, [2, 2])


def test_error_explicit_count_not_positive() -> None:
    with pytest.raises(SpecError, match=r"split \[0, 5\]: expected positive unit counts adding up "
                                        r"to 5"):
        explicit_split(5, [0, 5])
