"""What a worker is told at start-up: :class:`WorkerConfig`, built from the flags by
``worker/__main__.py`` (``jaxdist-worker --help`` lists them) or directly by tests and embedders.

Each limit's meaning and default is in SECURITY.md, "Limits and their defaults".
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxdist.core import artifacts, codec
from jaxdist.core.transport.security import ClientAuth
from jaxdist.core.transport.trust import PeerTrust
from jaxdist.worker.limits import MAX_ID_BYTES

__all__ = ["WorkerConfig"]


@dataclass
class WorkerConfig:
    """Everything a worker is told at start-up."""

    weights_roots: Sequence[str] = ()                 # weight URIs resolve only under these
    artifact_cache: str = ""                          # on-disk artifact store (survives restarts)
    max_artifact_cache_bytes: int = 4 << 30           # its bytes; least recently used go first
    #                                                   (worker/artifact_cache.py); 0: no bound
    device: str = "auto"                              # which devices this worker offers
    # Limits (SECURITY.md, "Limits and their defaults"); exceeding one is RESOURCE_EXHAUSTED.
    max_sessions: int = 64                            # sessions held at once; more are refused
    session_idle_timeout: float = 600.0               # s without a step, then reclaimed; 0: never
    max_kv_bytes: int | None = None                   # session state bytes held at once, all
    #                                                   stages; None: limits.default_max_kv_bytes
    #                                                   (half the device's memory); 0: no limit
    allowed_custom_calls: Collection[str] = artifacts.DEFAULT_CUSTOM_CALL_ALLOWLIST
    max_artifact_bytes: int = 256 << 20               # largest artifact (uploaded or inline)
    max_upload_bytes: int = 512 << 20                 # bytes of all unfinished uploads at once
    upload_idle_timeout: float = 30.0                 # s an upload may send nothing, then ends
    max_frame_bytes: int = 1 << 30                    # tensor bytes in one frame, all tensors
    max_inflight_bytes: int = 2 << 30                 # bytes of frames being received, all streams
    frame_idle_timeout: float = 30.0                  # s a begun frame may wait for its next part
    max_streams_per_peer: int = 256                   # Push, Subscribe, data conns per owner
    max_frame_tensor_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES  # largest tensor in a frame
    max_tensors_per_frame: int = codec.DEFAULT_MAX_TENSORS
    max_id_bytes: int = MAX_ID_BYTES                  # longest id or model name kept
    max_compiled_shapes: int = 64                     # input shapes compiled per pipeline
    max_subscriber_events: int = 1024                 # events waiting for one subscription and
    max_subscriber_bytes: int = 256 << 20             # their bytes; past either, it is dropped
    max_queued_event_bytes: int = 512 << 20           # bytes of events waiting, all subscriptions;
    #                                                   past it the one holding most is dropped
    devices: Sequence[Any] | None = field(default=None, repr=False)  # tests pass fakes
    # TLS this worker presents when it dials its next hops (security.client_auth); its token
    # only makes the hop credential of a pipeline without a key (transport/hop.py)
    peer_auth: ClientAuth = field(default_factory=ClientAuth)
    # The next hops it may send to beyond loopback and its cluster's CA (--peer-allow), and
    # whether hop credentials may go to them in plaintext (--insecure-token): transport/trust.py
    peer_trust: PeerTrust = field(default_factory=PeerTrust)
    kernels: bool = True                              # register the CPU kernels (cpu workers)
    kernel_threads: int = 0                           # threads per kernel call; 0: the process's CPUs
