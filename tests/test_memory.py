"""What keeps a worker's memory near its bound weights: weights bound into new aligned arrays
that the CPU device takes in place, the weight files' pages released as they are read, the
readers dropped after a bind, and free heap given back (``jaxdist.core.heap``).

RSS is compared within one run (with and without the release), never against fixed numbers.
"""

from __future__ import annotations

import mmap
import platform

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxdist.core.heap import release_free_heap
from jaxdist.core.weights import WeightCache
from jaxdist.core.weights import cache as cache_module
from jaxdist.core.weights import convert

MB = 1 << 20


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")


def _maps_a_file(a: np.ndarray) -> bool:
    base = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return True
        base = getattr(base, "base", None)
    return False


@pytest.fixture
def big(tmp_path):
    """A 32 MiB float32 tensor in a safetensors file (in the page cache: just written)."""
    w = np.random.default_rng(0).standard_normal((2048, 4096), dtype=np.float32)
    save_file({"w": w, "t": w[:64, :32].copy()}, str(tmp_path / "big.safetensors"))
    return tmp_path, w


@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/status")
def test_load_copies_into_an_aligned_array_and_releases_the_file_pages(big):
    root, w = big
    uri = "safetensors://big.safetensors#w"
    with WeightCache([root]) as cache:
        # Control, in the same run: reading the map without releasing keeps its pages resident.
        before = _rss_file()
        view = cache.resolve(uri)
        assert _maps_a_file(view)
        float(view.sum())
        kept = _rss_file() - before
        convert.drop_pages(view)
        del view
        before = _rss_file()
        out = cache.load(uri, param="w", shape=w.shape, dtype="float32")
        left = _rss_file() - before
    np.testing.assert_array_equal(out, w)
    assert out.ctypes.data % 64 == 0 and out.flags.c_contiguous and not _maps_a_file(out)
    assert kept > 0.9 * w.nbytes, kept
    assert left < 0.1 * kept, (left, kept)


def test_cpu_device_takes_the_bound_array_in_place(big):
    root, w = big
    with WeightCache([root]) as cache:
        host = cache.load("safetensors://big.safetensors#t", param="t", shape=(32, 64),
                          dtype="float32", transpose=True)
    dev = jax.device_put(host, jax.devices("cpu")[0], may_alias=True)
    assert dev.unsafe_buffer_pointer() == host.ctypes.data  # no second copy of the weight
    np.testing.assert_array_equal(np.asarray(dev), w[:64, :32].T)


def test_blockwise_bind_matches_the_whole_tensor(smollm2, monkeypatch):
    # Blocks of a few rows, so every path converts a tensor in many blocks.
    monkeypatch.setattr(cache_module, "BIND_BLOCK_BYTES", 3000)
    uri = f"gguf://{smollm2.name}#blk.0.attn_q.weight"  # Q4_1
    with WeightCache([smollm2.parent]) as cache:
        whole = cache.resolve(uri)
        info = cache.info(uri)
        got = cache.load(uri, param="wq", shape=info.shape[::-1], dtype="float32",
                         transpose=True)
        half = cache.load(uri, param="wq", shape=info.shape, dtype="float16")
        norm = cache.load(f"gguf://{smollm2.name}#blk.0.attn_norm.weight", param="n",
                          shape=(576,), dtype="float32")
    np.testing.assert_array_equal(got, whole.T)
    np.testing.assert_array_equal(half, whole.astype(np.float16))
    assert norm.shape == (576,) and norm.ctypes.data % 64 == 0


def test_drop_readers_keeps_the_cache_usable(big):
    root, w = big
    with WeightCache([root]) as cache:
        cache.load("safetensors://big.safetensors#t", param="t", shape=(64, 32), dtype="float32")
        assert len(cache.open_files()) == 1
        cache.drop_readers()
        assert cache.open_files() == ()
        again = cache.load("safetensors://big.safetensors#t", param="t", shape=(64, 32),
                           dtype="float32")
    np.testing.assert_array_equal(again, w[:64, :32])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_release_free_heap_runs_malloc_trim():
    assert release_free_heap() is True
