"""The step shapes of a causal LM: what exporters compile ahead of time and the generator sends.

One policy, shared by the two sides that must agree on it: an exporter lists
:func:`step_buckets` as its model's shape buckets (every worker compiles them at LoadStage), and
:class:`jaxdist.coordinator.generation.Generator` pads each step to one of them (:func:`decode_rows` for a
decode step's rows, the smallest prefill bucket holding a prompt chunk). So no request waits for
a compile. Kept apart from the generation loop so that exporters, which describe models, do not
import it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["decode_rows", "step_buckets"]


def decode_rows(n: int, max_slots: int) -> int:
    """The rows a decode step of ``n`` active sequences is padded to: the next power of two,
    capped at ``max_slots``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_slots)


def step_buckets(max_slots: int, prefill_buckets: Sequence[int]) -> list[dict[str, int]]:
    """Every step shape the generator sends, for exporters to compile ahead of time.

    Prefill runs one sequence per step (``b = 1``) at a bucket length; decode runs all active
    rows padded by :func:`decode_rows`.

    >>> step_buckets(4, (16, 64))
    [{'b': 1, 's': 1}, {'b': 2, 's': 1}, {'b': 4, 's': 1}, {'b': 1, 's': 16}, {'b': 1, 's': 64}]
    """
    rows = sorted({decode_rows(n, max_slots) for n in range(1, max_slots + 1)})
    return [{"b": b, "s": 1} for b in rows] + [{"b": 1, "s": int(n)} for n in prefill_buckets
                                               if int(n) > 1]
