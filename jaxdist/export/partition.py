"""Group contiguous units into pipeline stages, balanced by weight bytes.

The balanced split minimises the largest per-stage load, where a stage's load is its weight (plus
state) bytes divided by the capacity of the worker it lands on. With equal capacities this is
the classic linear partition problem; an exact dynamic programme over ``n_units x n_stages`` is
cheap for any real model (a few hundred units).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxdist.core.errors import SpecError

__all__ = ["balanced_split", "explicit_split"]


def explicit_split(n_units: int, sizes: Sequence[int]) -> list[range]:
    """Stages from explicit unit counts, e.g. ``[2, 3]`` for 5 units.

    Raises:
        SpecError: a count is not positive or the counts do not add up to ``n_units``.
    """
    if any(s < 1 for s in sizes) or sum(sizes) != n_units:
        raise SpecError(f"split {list(sizes)}: expected positive unit counts adding up to "
                        f"{n_units}, found a sum of {sum(sizes)}")
    out, start = [], 0
    for s in sizes:
        out.append(range(start, start + s))
        start += s
    return out


def balanced_split(costs: Sequence[float], n_stages: int,
                   capacities: Sequence[float] | None = None) -> list[range]:
    """Split units into ``n_stages`` contiguous, non-empty ranges minimising the largest load.

    Args:
        costs: per-unit cost (weight bytes plus state bytes).
        n_stages: number of stages, 1 <= n_stages <= len(costs).
        capacities: per-stage capacity (e.g. the memory of the worker each stage lands on);
            equal by default.

    Returns:
        One ``range`` of unit indices per stage, in order.

    Raises:
        SpecError: impossible stage count or bad capacities.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise SpecError(f"cannot split {n} units into {n_stages} stages: expected between 1 "
                        f"and {n} stages")
    caps = list(capacities) if capacities is not None else [1.0] * n_stages
    if len(caps) != n_stages or any(c <= 0 for c in caps):
        raise SpecError(f"capacities: expected {n_stages} positive numbers, found {caps}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal max-load placing units[:i] on stages[:k]; cut[k][i]: where stage k-1 starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n - (n_stages - k) + 1):
            for j in range(k - 1, i):
                load = max(best[k - 1][j], (prefix[i] - prefix[j]) / caps[k - 1])
                # Ties go to the earlier cut (a longer stage k-1), which keeps earlier stages
                # lighter: stage 0 also carries the coordinator's traffic.
                if load < best[k][i]:
                    best[k][i], cut[k][i] = load, j
    ranges, i = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][i]
        ranges.append(range(j, i))
        i = j
    return ranges[::-1]
