"""The step shapes of a causal LM: what exporters compile ahead of time and the generator sends.

One policy, shared by the two sides that must agree on it: an exporter lists
:func:`step_buckets` as its model's shape buckets (every worker compiles them at LoadStage), and
:class:`jaxdist.coordinator.engine.Engine` pads each step to one of them (:func:`decode_rows` for a
step's rows, the smallest prefill bucket holding a prompt chunk). So no request waits for a
compile. Kept apart from the generation loop so that exporters, which describe models, do not
import it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["decode_rows", "prefill_rows", "step_buckets"]


def decode_rows(n: int, max_slots: int) -> int:
    """The rows a decode step of ``n`` active sequences is padded to: the next power of two,
    capped at ``max_slots``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, max_slots)


def prefill_rows(max_slots: int, prefill_buckets: Sequence[int]) -> int:
    """The most prompts one prefill step takes together: every slot, when the smallest
    prefill bucket is longer than one token (else prompts are fed one token per step anyway).

    >>> prefill_rows(4, (16, 64)), prefill_rows(1, (16,)), prefill_rows(4, (1,))
    (4, 1, 1)
    """
    return max_slots if min(int(n) for n in prefill_buckets) > 1 else 1


def step_buckets(max_slots: int, prefill_buckets: Sequence[int]) -> list[dict[str, int]]:
    """Every step shape the generator sends, for exporters to compile ahead of time.

    Decode runs all active rows padded by :func:`decode_rows`. Prefill runs one prompt per
    step at a bucket length, or, when several prompts wait, up to :func:`prefill_rows` of them
    together in chunks of the smallest bucket, their rows padded the same way.

    >>> step_buckets(4, (16, 64))  # doctest: +NORMALIZE_WHITESPACE
    [{'b': 1, 's': 1}, {'b': 2, 's': 1}, {'b': 4, 's': 1}, {'b': 1, 's': 16}, {'b': 1, 's': 64},
     {'b': 2, 's': 16}, {'b': 4, 's': 16}]
    """
    rows = sorted({decode_rows(n, max_slots) for n in range(1, max_slots + 1)})
    first = min(int(n) for n in prefill_buckets)
    batched = rows if prefill_rows(max_slots, prefill_buckets) > 1 else []
    return ([{"b": b, "s": 1} for b in rows]
            + [{"b": 1, "s": int(n)} for n in prefill_buckets if int(n) > 1]
            + [{"b": b, "s": first} for b in batched if b > 1])
