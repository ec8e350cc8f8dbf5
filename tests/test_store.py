"""jaxdist.core.store.LocalStore: least-recently-used pruning (the worker's bounded artifact
cache is built on it)."""

from __future__ import annotations

import os
import pathlib

import pytest

from jaxdist.core.errors import ArtifactError
from jaxdist.core.store import LocalStore


def _aged(store: LocalStore, data: bytes, when: int) -> str:
    digest = store.put(data, meta={"n": len(data)})
    os.utime(store.path_of(digest), ns=(when, when))
    return digest


def test_prune_deletes_the_least_recently_used_first_and_spares_keep(
        tmp_path: pathlib.Path) -> None:
    store = LocalStore(tmp_path)
    a, b, c, d = (_aged(store, bytes([i]) * 100, when=(i + 1) * 10**9) for i in range(4))
    gone = store.prune(250, keep={a})  # a is the oldest, but kept: b and c go
    assert [e.digest for e in gone] == [b, c]
    assert {e.digest for e in store.list()} == {a, d}
    assert not store.path_of(b).with_name(store.path_of(b).name + ".json").exists()
    assert store.prune(250) == []  # 200 bytes left: nothing more to do
    assert [e.digest for e in store.prune(0, keep={d})] == [a]
    assert [e.digest for e in store.list()] == [d]


def test_touch_makes_an_artifact_the_last_to_go(tmp_path: pathlib.Path) -> None:
    store = LocalStore(tmp_path)
    old, new = _aged(store, b"old" * 40, when=10**9), _aged(store, b"new" * 40, when=2 * 10**9)
    store.touch(old)  # used now: newer than "new"
    assert [e.digest for e in store.prune(150)] == [new]
    store.touch("sha256:" + "0" * 64)  # not stored: nothing to do
    with pytest.raises(ArtifactError, match="is malformed"):
        store.touch("sha256:xyz")
