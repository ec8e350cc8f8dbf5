"""Weight roots under races and odd files (issue #15 item 6), on the real file system.

A FIFO cannot hang a describe (nor, through the cache's lock, everyone else's); a directory
swapped for a link to outside the root between the check and the open serves nothing; describing
files leaves no descriptor open; a NUL byte, an over-long name or an over-long path is refused by
name, with a short message, through the worker too.
"""

from __future__ import annotations

import os
import pathlib
import threading

import grpc
import numpy as np
import pytest
from gguf import GGUFWriter

from jaxdist.core.errors import WeightError
from jaxdist.core.weights import WeightCache
from jaxdist.core.weights.uri import open_checked, resolve_path


def _gguf(path: pathlib.Path, name: str = "w") -> None:
    w = GGUFWriter(str(path), "llama")
    w.add_tensor(name, np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_fifo_is_refused_without_blocking_and_others_are_served(tmp_path):
    os.mkfifo(tmp_path / "trap.gguf")
    _gguf(tmp_path / "real.gguf")
    cache = WeightCache([tmp_path])
    outcome: dict[str, object] = {}

    def describe_fifo() -> None:
        try:
            cache.describe("trap.gguf")
        except WeightError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=describe_fifo, daemon=True)
    t.start()
    t.join(60)  # a hang guard, not a timing assertion: a blocked open() never returns
    assert not t.is_alive(), "describe blocked on a FIFO"
    error = outcome["error"]
    assert isinstance(error, WeightError) and "is a FIFO" in str(error)
    assert error.code == "FAILED_PRECONDITION"
    assert list(cache.describe("real.gguf")) == ["w"]  # the cache still serves


def test_a_directory_swapped_for_a_link_outside_serves_nothing(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (root / "d" / "w.bin").write_bytes(b"\0" * 16)
    (outside / "w.bin").write_bytes(b"secret!!" * 2)
    real = resolve_path("d/w.bin", [root])  # checked while d is a directory
    (root / "d").rename(root / "d.old")
    (root / "d").symlink_to(outside)  # ... then d leads outside the root
    with pytest.raises(WeightError, match="changed while it was opened") as info:
        open_checked(real, [root], where="d/w.bin")
    assert info.value.code == "PERMISSION_DENIED"
    with pytest.raises(WeightError, match="outside the weight roots"):
        WeightCache([root]).load("file://d/w.bin", param="w", shape=(4,), dtype="float32")


def test_racing_swaps_never_serve_a_file_outside_the_root(tmp_path):
    """A thread swaps a directory and a link to outside as fast as it can while the cache
    binds a file:// weight through it: every bind gives the root's bytes or is refused."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "real").mkdir(parents=True)
    outside.mkdir()
    (root / "real" / "w.bin").write_bytes(np.zeros(4, np.float32).tobytes())
    (outside / "w.bin").write_bytes(np.full(4, 7, np.float32).tobytes())
    (root / "link").symlink_to(outside)
    os.rename(root / "real", root / "d")
    stop = threading.Event()

    def swap() -> None:
        while not stop.is_set():
            os.rename(root / "d", root / "real")
            os.rename(root / "link", root / "d")
            os.rename(root / "d", root / "link")
            os.rename(root / "real", root / "d")

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    served, refused = 0, 0
    try:
        for _ in range(1500):
            cache = WeightCache([root])
            try:
                arr = cache.load("file://d/w.bin", param="w", shape=(4,), dtype="float32")
            except WeightError:
                refused += 1
                continue
            assert not arr.any(), "bytes from outside the weight root were served"
            served += 1
    finally:
        stop.set()
        swapper.join()
    assert served + refused == 1500


def test_describing_many_files_leaves_no_descriptor_open(tmp_path):
    for i in range(50):
        _gguf(tmp_path / f"m{i}.gguf")
    cache = WeightCache([tmp_path])
    cache.describe("m0.gguf")  # imports and first-use costs out of the count
    before = _open_fds()
    for i in range(50):
        assert list(cache.describe(f"m{i}.gguf")) == ["w"]
        cache.metadata(f"m{i}.gguf")
    assert _open_fds() <= before
    assert cache.open_files() == ()  # a describe caches no reader


@pytest.mark.parametrize("path, what", [
    ("bad\x00name.gguf", "NUL byte"),
    ("x" * 256 + ".gguf", "more than a file name may"),
    ("d/" * 50_000 + "m.gguf", "characters, more than 4096"),
])
def test_impossible_paths_are_refused_by_name_and_briefly(tmp_path, path, what):
    with pytest.raises(WeightError, match=what) as info:
        WeightCache([tmp_path]).describe(path)
    assert info.value.code == "INVALID_ARGUMENT"
    assert len(str(info.value)) < 600


def test_the_worker_answers_impossible_paths_with_a_code_and_a_clipped_message(tmp_path):
    from jaxdist.coordinator.spawn import spawn_workers, stop_workers
    from jaxdist.core.transport.channel import make_channel, stub_for
    from jaxdist.proto import jaxdist_pb2 as pb

    os.mkfifo(tmp_path / "trap.gguf")
    _gguf(tmp_path / "real.gguf")
    (w,) = spawn_workers(1, weights_roots=[str(tmp_path)])
    try:
        stub = stub_for(make_channel(w.address))
        for path, code in (("bad\x00.gguf", grpc.StatusCode.INVALID_ARGUMENT),
                           ("d/" * 50_000 + "m.gguf", grpc.StatusCode.INVALID_ARGUMENT),
                           ("trap.gguf", grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.RpcError) as info:
                stub.DescribeWeights(pb.DescribeWeightsRequest(path=path), timeout=60)
            assert info.value.code() == code, (path[:20], info.value.details()[:200])
            assert len(info.value.details()) <= 4100
        reply = stub.DescribeWeights(pb.DescribeWeightsRequest(path="real.gguf"), timeout=60)
        assert [t.name for t in reply.tensors] == ["w"]
    finally:
        stop_workers([w])
