"""``jaxdist-worker`` / ``python -m jaxdist.worker``: the generic worker process.

Prints ``jaxdist-worker listening on HOST:PORT device=PLATFORM:INDEX`` on stdout once it is ready,
its first line (then ``jaxdist-worker health on HOST:PORT``, ``jaxdist-worker data port on
HOST:PORT`` and ``jaxdist-worker metrics on http://HOST:PORT/metrics`` when there are such
ports; they come after it so that a reader waiting for the first line finds it first), and its
gRPC health
turns ``SERVING``. SIGTERM (or SIGINT) turns health ``NOT_SERVING``, drains
in-flight frames, then exits 0, at once even while a stage compiles (the load is abandoned).
A shutdown that has not finished :data:`SHUTDOWN_DEADLINE_S` after the signal prints every
thread's stack to stderr and exits 1; ``kill -USR1 PID`` prints them at any time.

Before jax starts a backend, the worker sets how it takes GPU memory: as needed, so several
workers share a GPU, or ``--gpu-memory-fraction F`` preallocated; jax's own ``XLA_PYTHON_CLIENT_*``
variables, when the user set them, decide instead (:func:`jaxdist.core.config.gpu_memory_env`).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import select
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

from jaxdist.core import codec
from jaxdist.core import config as jd_config
from jaxdist.core.about import version_line
from jaxdist.core.errors import JaxdistError
from jaxdist.worker.limits import MAX_ID_BYTES

if TYPE_CHECKING:  # gRPC is imported after logging is set up
    from jaxdist.core.transport.trust import HopPattern

DRAIN_TIMEOUT_S = 30.0
"""How long SIGTERM waits for in-flight frames to leave."""
SHUTDOWN_DEADLINE_S = DRAIN_TIMEOUT_S + 15.0
"""From SIGTERM to exit at most: the drain, then the servers' stop (2 s of grace) and the
release of stages, sessions and files. Past it the shutdown is stuck (a thread that cannot be
stopped): the worker prints every thread's stack and exits 1 rather than hang."""

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _size(text: str) -> int:
    """A byte count: ``1048576``, ``512M`` (10^6), ``1GiB`` (2^30); for argparse."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]i?)?B?\s*", text, re.ASCII | re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 1048576, 512M or "
                                         f"4GiB, found {text!r}")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]


def _host_port(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9100`` for IPv6; port 0 picks a free port); for argparse."""
    host, _, port = text.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port, re.ASCII) or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:9100, found "
                                         f"{text!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def _data_listen(text: str) -> str:
    """``--data-listen``: ``off``, or ``HOST:PORT`` as :func:`_host_port` reads it."""
    if text.strip().lower() == "off":
        return "off"
    host, port = _host_port(text)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _allowed_custom_calls(patterns: list[str]) -> frozenset[str]:
    from jaxdist.core.vetting import DEFAULT_CUSTOM_CALL_ALLOWLIST

    for pattern in patterns:
        if not pattern.strip() or pattern.strip("*?") == "":
            raise JaxdistError(f"--allow-custom-call {pattern!r}: expected a target name or a "
                               f"pattern naming some (e.g. 'lapack_*_ffi'), not one that "
                               f"matches every target")
    if patterns:
        logging.getLogger("jaxdist.worker").warning(
            "custom call targets allowed beyond the default: %s (artifacts may run this native "
            "code on buffers XLA does not check)", ", ".join(patterns))
    return DEFAULT_CUSTOM_CALL_ALLOWLIST | frozenset(patterns)


def _peer_pattern(text: str) -> HopPattern:
    """``--peer-allow``: a next-hop pattern (``transport.trust.parse_hop_pattern``)."""
    from jaxdist.core.transport.trust import parse_hop_pattern

    try:
        return parse_hop_pattern(text)
    except JaxdistError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxdist-worker", description="The generic jaxdist worker: "
                                "runs any stage a coordinator ships to it.")
    p.add_argument("--version", action="version", version=version_line("jaxdist-worker"))
    p.add_argument("--listen", default="127.0.0.1:50051",
                   help="HOST:PORT to serve on; port 0 picks a free port (default %(default)s)")
    p.add_argument("--data-listen", type=_data_listen, default=None, metavar="HOST:PORT|off",
                   help="the data port: the previous stages' workers send frames here over "
                        "TCP instead of gRPC, with this worker's token and TLS (see "
                        "SECURITY.md); 'off': they use gRPC (default: the --listen host, a "
                        "free port)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda[:N] | rocm[:N] | tpu[:N] | metal (default %(default)s)")
    p.add_argument("--gpu-memory-fraction", default=None, metavar="F",
                   help="preallocate this fraction of the GPU's memory, 0 < F <= 1 (default: "
                        "allocate as needed, so several workers can share a GPU; the "
                        "XLA_PYTHON_CLIENT_* variables, when set, decide instead)")
    p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                   help="directory weight URIs may resolve under (repeatable)")
    p.add_argument("--allow-custom-call", action="append", default=[], metavar="PATTERN",
                   help="also accept artifacts calling custom call targets matching this "
                        "fnmatch pattern, e.g. 'lapack_*_ffi' for jnp.linalg on CPU "
                        "(repeatable; default: only shape_assertion and jaxdist's own kernels; "
                        "this trusts the artifacts' authors with native code, see SECURITY.md)")
    p.add_argument("--artifact-cache", default=str(jd_config.default_artifact_cache()),
                   metavar="DIR", help="on-disk artifact cache (default %(default)s)")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache ('off' to disable; default "
                        "$JAXDIST_COMPILATION_CACHE or ~/.cache/jaxdist/xla)")
    p.add_argument("--max-artifact-cache-bytes", type=_size, default=4 << 30, metavar="SIZE",
                   help="bytes of artifacts kept in --artifact-cache; storing one past it "
                        "deletes the least recently used, never a loaded stage's; 0: no bound "
                        "(default %(default)s)")
    p.add_argument("--max-compilation-cache-bytes", type=_size,
                   default=jd_config.DEFAULT_COMPILATION_CACHE_BYTES,
                   metavar="SIZE",
                   help="bytes of compiled executables kept in --compilation-cache (JAX "
                        "deletes the least recently used past it); 0: no bound "
                        "(default %(default)s)")
    limits = p.add_argument_group("limits", "exceeding one is RESOURCE_EXHAUSTED, naming the "
                                  "limit (see SECURITY.md); SIZE is bytes, or 512M, 4G, 1GiB ...")
    limits.add_argument("--max-sessions", type=int, default=64, metavar="N",
                        help="sessions held at once, all stages; a new one beyond is refused "
                             "(default %(default)s)")
    limits.add_argument("--session-idle-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="reclaim a session after this long without a step; 0: never "
                             "(default %(default)s)")
    limits.add_argument("--max-kv-bytes", type=_size, default=None, metavar="SIZE",
                        help="session state (KV cache) bytes held at once, all sessions and "
                             "stages; 0: no limit (default: half the device's memory, the RAM "
                             "for cpu)")
    limits.add_argument("--max-artifact-bytes", type=_size, default=256 << 20, metavar="SIZE",
                        help="largest artifact, uploaded or inlined in a spec "
                             "(default %(default)s)")
    limits.add_argument("--max-upload-bytes", type=_size, default=512 << 20, metavar="SIZE",
                        help="bytes held by all unfinished artifact uploads at once; an upload "
                             "that would pass it is refused (default %(default)s)")
    limits.add_argument("--upload-idle-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="an artifact upload that sends nothing for this long is dropped "
                             "(default %(default)s)")
    limits.add_argument("--max-inflight-bytes", type=_size, default=2 << 30, metavar="SIZE",
                        help="bytes held by all frames being received at once, all streams; a "
                             "frame that would pass it is refused (default %(default)s)")
    limits.add_argument("--frame-idle-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a stream that began a frame and sends nothing more of it for "
                             "this long is ended (default %(default)s)")
    limits.add_argument("--max-streams-per-peer", type=int, default=256, metavar="N",
                        help="Push, Subscribe and data connections one owner (a pipeline "
                             "whose key they prove, else a peer host) may hold open at once; "
                             "past it, the owner's stream of frames idle for "
                             "--frame-idle-timeout is closed for the new one (default "
                             "%(default)s)")
    limits.add_argument("--max-id-bytes", type=int, default=MAX_ID_BYTES, metavar="N",
                        help="longest pipeline, stage, session or reply-to id, or model name, "
                             "in UTF-8 bytes; a request with a longer one is refused "
                             "(default %(default)s)")
    limits.add_argument("--max-compiled-shapes", type=int, default=64, metavar="N",
                        help="input shapes compiled per pipeline, the buckets of all its "
                             "stages here included; a stage or a frame of a further shape is "
                             "refused (default %(default)s)")
    limits.add_argument("--max-subscriber-events", type=int, default=1024, metavar="N",
                        help="events waiting for one coordinator's subscription; a subscriber "
                             "that lets more pile up is dropped (default %(default)s)")
    limits.add_argument("--max-subscriber-bytes", type=_size, default=256 << 20, metavar="SIZE",
                        help="bytes of events waiting for one subscription; past it the "
                             "subscriber is dropped (default %(default)s)")
    limits.add_argument("--max-queued-event-bytes", type=_size, default=512 << 20,
                        metavar="SIZE",
                        help="bytes of events waiting for all subscriptions together; past it "
                             "the subscriber holding the most is dropped (default %(default)s)")
    limits.add_argument("--max-frame-bytes", type=_size, default=1 << 30, metavar="SIZE",
                        help="tensor bytes in one frame, all its tensors (default %(default)s)")
    limits.add_argument("--max-tensors-per-frame", type=int, default=codec.DEFAULT_MAX_TENSORS,
                        metavar="N",
                        help="tensors in one frame (default %(default)s)")
    auth = p.add_argument_group(
        "authentication", "what callers must present; the same files are this worker's "
        "credentials towards its next hops (see SECURITY.md). Without a token or mutual TLS, "
        "anyone who reaches the port can run code here: a non-loopback --listen warns.")
    auth.add_argument("--token-file", default=None, metavar="FILE",
                      help="require every call to carry 'authorization: Bearer <token>', the "
                           "token being this file's content")
    auth.add_argument("--tls-cert", default=None, metavar="PEM",
                      help="serve TLS with this certificate (chain); also the client "
                           "certificate presented to next hops")
    auth.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    auth.add_argument("--tls-ca", default=None, metavar="PEM",
                      help="mutual TLS: require client certificates signed by this CA; also "
                           "verifies the next hops' certificates")
    auth.add_argument("--peer-allow", action="append", default=[], type=_peer_pattern,
                      metavar="PATTERN",
                      help="next hops a LoadStage may name beyond loopback: HOST, HOST:PORT, "
                           "a CIDR such as 10.0.0.0/8, or '*' (repeatable). With mutual TLS "
                           "(--tls-cert, --tls-key, --tls-ca) every hop is verified against the "
                           "CA instead and this is not needed; other hops are refused")
    auth.add_argument("--insecure-token", action="store_true",
                      help="let this worker (having a --token-file) send its pipelines' hop "
                           "credentials in plaintext to an allowed next hop that is not "
                           "loopback (without it such a hop is refused; anyone on the path can "
                           "read them and push frames into those pipelines). The token itself "
                           "never goes to a next hop")
    ops = p.add_argument_group(
        "health and metrics", "plaintext ports without credentials, off by default; bind them to "
        "loopback or a private network (see SECURITY.md)")
    ops.add_argument("--health-listen", type=_host_port, default=None, metavar="HOST:PORT",
                     help="also serve gRPC health (grpc.health.v1, nothing else) in plaintext "
                          "here, for probes that cannot do this worker's TLS or token, such as "
                          "Kubernetes' gRPC probes. Health is always on --listen too")
    ops.add_argument("--metrics-listen", type=_host_port, default=None, metavar="HOST:PORT",
                     help="serve Prometheus metrics over HTTP here (any path, e.g. /metrics): "
                          "stage compute times, frames, bytes, sessions, state bytes, compile "
                          "cache; they name the pipelines")
    kern = p.add_argument_group("CPU kernels", "native kernels for quantized GGUF weights "
                                "(jaxdist.core.kernels; built on first start, then cached)")
    kern.add_argument("--kernel-threads", type=int, default=0, metavar="N",
                      help="threads per kernel call; 0: one per CPU this process may use "
                           "(its affinity mask, capped by a cgroup CPU quota), the caller "
                           "included (default %(default)s)")
    kern.add_argument("--no-kernels", action="store_true",
                      help="register no kernels: advertise none, so coordinators bind this "
                           "worker's weights dequantized")
    p.add_argument("--log-level", default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=opts.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Before anything starts a jax backend (the device is resolved in create_server): jaxlib
    # reads these variables when it creates the GPU backend, which by default would take 75%
    # of the GPU and leave too little for the other workers on it. On a cpu worker this is
    # still needed: listing the devices starts every backend, a GPU's included.
    try:
        fraction = (None if opts.gpu_memory_fraction is None
                    else jd_config.check_gpu_memory_fraction(opts.gpu_memory_fraction))
        jd_config.apply_gpu_memory_env(fraction)
    except JaxdistError as exc:
        print(f"jaxdist-worker: {exc}", file=sys.stderr)
        return 2
    # Imported after logging is set up: importing jax is slow and may log.
    from jaxdist.core.transport import security
    from jaxdist.core.transport.trust import PeerTrust
    from jaxdist.core.openfiles import raise_fd_limit
    from jaxdist.worker.server import create_server
    from jaxdist.worker.config import WorkerConfig

    for flag, value, least in (("--max-sessions", opts.max_sessions, 1),
                               ("--max-tensors-per-frame", opts.max_tensors_per_frame, 1),
                               ("--max-artifact-bytes", opts.max_artifact_bytes, 1),
                               ("--max-upload-bytes", opts.max_upload_bytes, 1),
                               ("--upload-idle-timeout", opts.upload_idle_timeout, 0.1),
                               ("--max-frame-bytes", opts.max_frame_bytes, 1),
                               ("--max-inflight-bytes", opts.max_inflight_bytes, 1),
                               ("--frame-idle-timeout", opts.frame_idle_timeout, 0.1),
                               ("--max-streams-per-peer", opts.max_streams_per_peer, 1),
                               ("--max-subscriber-events", opts.max_subscriber_events, 1),
                               ("--max-id-bytes", opts.max_id_bytes, 16),
                               ("--max-compiled-shapes", opts.max_compiled_shapes, 1),
                               ("--max-subscriber-bytes", opts.max_subscriber_bytes, 1),
                               ("--max-queued-event-bytes", opts.max_queued_event_bytes, 1),
                               ("--session-idle-timeout", opts.session_idle_timeout, 0),
                               ("--kernel-threads", opts.kernel_threads, 0)):
        if value < least:
            print(f"jaxdist-worker: {flag} must be >= {least}, got {value}", file=sys.stderr)
            return 2
    if opts.max_inflight_bytes < opts.max_frame_bytes:
        print(f"jaxdist-worker: --max-inflight-bytes ({opts.max_inflight_bytes}) must be >= "
              f"--max-frame-bytes ({opts.max_frame_bytes}), or no frame of the largest size "
              f"could be received", file=sys.stderr)
        return 2
    if opts.max_queued_event_bytes < opts.max_subscriber_bytes:
        print(f"jaxdist-worker: --max-queued-event-bytes ({opts.max_queued_event_bytes}) must "
              f"be >= --max-subscriber-bytes ({opts.max_subscriber_bytes}), or a subscription "
              f"could never hold its own bound", file=sys.stderr)
        return 2
    if 0 < opts.max_artifact_cache_bytes < opts.max_artifact_bytes:
        print(f"jaxdist-worker: --max-artifact-cache-bytes ({opts.max_artifact_cache_bytes}) "
              f"must be 0 (no bound) or >= --max-artifact-bytes ({opts.max_artifact_bytes}), "
              f"or an artifact of the largest size could not stay in the cache",
              file=sys.stderr)
        return 2
    if opts.max_compilation_cache_bytes < 0 or opts.max_artifact_cache_bytes < 0:
        print("jaxdist-worker: --max-artifact-cache-bytes and --max-compilation-cache-bytes "
              "must be >= 0 (0: no bound)", file=sys.stderr)
        return 2
    if opts.max_upload_bytes < opts.max_artifact_bytes:
        print(f"jaxdist-worker: --max-upload-bytes ({opts.max_upload_bytes}) must be >= "
              f"--max-artifact-bytes ({opts.max_artifact_bytes}), or no artifact of the largest "
              f"size could be uploaded", file=sys.stderr)
        return 2
    cache_dir = opts.compilation_cache
    if cache_dir is None:
        cache_dir = jd_config.default_compilation_cache()
    elif cache_dir.lower() == "off":
        cache_dir = None
    try:
        files = {"token_file": opts.token_file, "tls_cert": opts.tls_cert,
                 "tls_key": opts.tls_key, "tls_ca": opts.tls_ca}
        auth = security.server_auth(**files)
        config = WorkerConfig(weights_roots=opts.weights_root, artifact_cache=opts.artifact_cache,
                              max_artifact_cache_bytes=opts.max_artifact_cache_bytes,
                              device=opts.device, max_sessions=opts.max_sessions,
                              session_idle_timeout=opts.session_idle_timeout,
                              max_kv_bytes=opts.max_kv_bytes,
                              max_artifact_bytes=opts.max_artifact_bytes,
                              max_upload_bytes=opts.max_upload_bytes,
                              upload_idle_timeout=opts.upload_idle_timeout,
                              max_frame_bytes=opts.max_frame_bytes,
                              max_inflight_bytes=opts.max_inflight_bytes,
                              frame_idle_timeout=opts.frame_idle_timeout,
                              max_streams_per_peer=opts.max_streams_per_peer,
                              max_tensors_per_frame=opts.max_tensors_per_frame,
                              max_id_bytes=opts.max_id_bytes,
                              max_compiled_shapes=opts.max_compiled_shapes,
                              max_subscriber_events=opts.max_subscriber_events,
                              max_subscriber_bytes=opts.max_subscriber_bytes,
                              max_queued_event_bytes=opts.max_queued_event_bytes,
                              peer_auth=security.client_auth(**files),
                              peer_trust=PeerTrust(opts.peer_allow,
                                                   insecure_token=opts.insecure_token),
                              kernels=not opts.no_kernels,
                              kernel_threads=opts.kernel_threads,
                              allowed_custom_calls=_allowed_custom_calls(opts.allow_custom_call))
        data_listen = opts.data_listen or f"{opts.listen.rpartition(':')[0]}:0"
        raise_fd_limit()  # before the server sizes its connection bound from it
        server, servicer, address = create_server(
            opts.listen, config, auth, data_listen=None if data_listen == "off" else data_listen)
    except JaxdistError as exc:
        print(f"jaxdist-worker: {exc}", file=sys.stderr)
        return 2
    metrics = None
    ports: list[str] = []  # printed after the ready line
    try:
        if opts.health_listen is not None:
            health_address = servicer.health.serve(*opts.health_listen)
            ports.append(f"jaxdist-worker health on {health_address}")
        if servicer.data_port:
            ports.append(f"jaxdist-worker data port on "
                         f"{data_listen.rpartition(':')[0]}:{servicer.data_port}")
        if opts.metrics_listen is not None:
            from jaxdist.worker.metrics import serve_metrics

            metrics_host, metrics_port = opts.metrics_listen
            metrics = serve_metrics(metrics_host, metrics_port, servicer)
            ports.append(f"jaxdist-worker metrics on http://{metrics.address}/metrics")
    except JaxdistError as exc:
        print(f"jaxdist-worker: {exc}", file=sys.stderr)
        server.stop(grace=0).wait()
        servicer.close()
        servicer.health.close()
        return 2
    jd_config.configure_compilation_cache(cache_dir, servicer.device.device_kind,
                                          max_bytes=opts.max_compilation_cache_bytes)
    warning = security.exposure_warning(opts.listen.rpartition(":")[0], auth)
    if warning is None and servicer.data_port:
        warning = security.exposure_warning(data_listen.rpartition(":")[0], auth)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    if not opts.weights_root:
        logging.getLogger("jaxdist.worker").warning(
            "no --weights-root given: every weight URI will be refused")
    for root in opts.weights_root:
        if not os.path.isdir(root):
            logging.getLogger("jaxdist.worker").warning(
                "--weights-root %s is not a directory (yet): weight URIs under it are refused "
                "until it exists", root)
    wake = _SignalWakeup(signal.SIGTERM, signal.SIGINT)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand, to stderr
    servicer.health.set_serving()
    print(f"jaxdist-worker listening on {address} device={servicer.device_name}", flush=True)
    for line in ports:
        print(line, flush=True)
    wake.wait()
    _arm_shutdown_watchdog(SHUTDOWN_DEADLINE_S)
    log = logging.getLogger("jaxdist.worker")
    drained = servicer.drain(timeout=DRAIN_TIMEOUT_S)  # health turns NOT_SERVING first
    servicer.hub.shutdown()  # ends the coordinators' subscriptions, so the grace period is short
    if not server.stop(grace=2).wait(timeout=10):
        log.warning("the gRPC server did not stop within 10 s; going on with the shutdown")
    servicer.close()
    servicer.health.close()  # the --health-listen port answers NOT_SERVING until here
    if metrics is not None:
        metrics.close()
    if not drained:
        log.warning("shut down with frames still in flight")
    if len(servicer.loads):
        # A load thread may be inside an XLA compile, which cannot be stopped, and the
        # interpreter would wait for it at exit; its stage is discarded anyway (worker/loads.py).
        log.warning("exiting while %d LoadStage calls are still compiling or binding; they are "
                    "abandoned", len(servicer.loads))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


class _SignalWakeup:
    """Catches ``signums``; :meth:`wait` blocks until one has arrived (main thread only).

    The C-level handler writes the signal to a socket (``signal.set_wakeup_fd``) and the Python
    handler does nothing, so no lock is taken inside a handler (a handler setting a
    ``threading.Event`` deadlocks when it interrupts the main thread inside that event's own
    ``wait``), and a signal that arrives before the wait is not lost."""

    def __init__(self, *signums: signal.Signals) -> None:
        self._signums = set(signums)
        self._reader, self._writer = socket.socketpair()  # both live as long as this object
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in signums:
            signal.signal(signum, lambda _signum, _frame: None)

    def wait(self) -> None:
        while True:
            select.select([self._reader], [], [])
            try:
                if self._signums.intersection(self._reader.recv(64)):
                    return
            except BlockingIOError:
                continue


def _arm_shutdown_watchdog(deadline_s: float) -> None:
    """Exit 1, after printing every thread's stack, if the process still runs ``deadline_s``
    from now (a daemon thread: it keeps running while the interpreter joins the others)."""
    def watch() -> None:
        if not done.wait(deadline_s):
            logging.getLogger("jaxdist.worker").error(
                "shutdown did not finish within %g s of the signal; the threads' stacks "
                "follow, then exit 1", deadline_s)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(1)

    done = threading.Event()  # never set: the process ends first
    threading.Thread(target=watch, name="shutdown-watchdog", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
