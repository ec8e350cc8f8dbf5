"""Workers as Ray actors: one per bundle of a placement group, each running the normal worker.

:func:`start_workers` asks Ray for a placement group of ``n`` equal bundles (``{"GPU": 1}``,
``{"TPU": 1}`` or ``{"CPU": k}``), strategy ``PACK`` or ``STRICT_SPREAD``, waits until it is
placed, and starts one :class:`WorkerActor` in each bundle. Each actor starts ``python -m
jaxdist.worker`` (the ``jaxdist-worker`` program, with the arguments of
:func:`jaxdist.launch.process.worker_args`) as its child and returns the address the worker
printed. :meth:`jaxdist.coordinator.cluster.Cluster.ray` makes a cluster over them.

Decisions:

* **The worker is the actor's child process**, not a server inside the actor: it is the same
  program, with the same flags, as every other worker, and it never loads Ray.
* **Actor death is worker death.** The child is started with ``PR_SET_PDEATHSIG`` = SIGKILL
  (:func:`jaxdist.launch.process.worker_command`, as local workers are), so when the actor's
  process dies (``ray.kill``, a crash, its owner, the coordinator, exiting) the kernel kills
  the worker, and the coordinator fails over to a spare as for any dead worker. The other way
  round, a worker that exits on its own takes its actor with it. Linux only: ``prctl`` is how
  the kernel ties the two.
* **Addresses.** When every bundle is on the coordinator's node, the workers listen on
  loopback; otherwise each listens on its node's IP as Ray knows it, which the other nodes
  reach (``loopback=`` overrides).
* **Next hops.** A worker sends frames only to hops it trusts (SECURITY.md, "What a worker
  sends, and to whom"). On several nodes without mutual TLS each worker is started with
  ``--peer-allow IP`` for every node IP of its placement group: the group's nodes trust each
  other, as Ray's own nodes do. With ``tls_ca`` the cluster's CA decides instead. Workers with
  a token still need ``--insecure-token`` (``extra_args``) to send hop credentials in
  plaintext between nodes, said by the worker that refuses it.
* **Devices.** Ray sets ``CUDA_VISIBLE_DEVICES`` (``TPU_VISIBLE_CHIPS`` for TPUs) of each actor to
  its bundle's accelerators and the worker inherits it, so a worker holding one GPU sees it as
  ``cuda:0``, whichever GPU of the node it is. The default directive follows the bundle:
  ``cuda`` with ``GPU``, ``tpu`` with ``TPU``, ``cpu`` otherwise. A GPU worker allocates GPU
  memory as it needs it, as every worker does (so workers of fractional bundles, ``GPU=0.5``,
  can share a GPU); ``gpu_memory_fraction`` makes each preallocate a fixed share instead.
* Ray is imported on first use: neither ``import jaxdist`` nor a worker loads it.

Example:
    >>> import ray                                                  # doctest: +SKIP
    >>> ray.init(address="auto")                                    # doctest: +SKIP
    >>> group = start_workers(4, resources={"GPU": 1}, strategy="STRICT_SPREAD")  # doctest: +SKIP
    >>> group.addresses                                             # doctest: +SKIP
    ['10.0.0.5:41233', '10.0.0.6:39001', '10.0.0.7:40117', '10.0.0.8:35529']
    >>> group.close()                                               # doctest: +SKIP
"""

from __future__ import annotations

import collections
import importlib
import logging
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, Self

from jaxdist.core.errors import DeviceError, JaxdistError, TransportError
from jaxdist.launch.process import parse_ready, worker_args, worker_command

__all__ = ["STRATEGIES", "RayWorker", "RayWorkers", "WorkerActor", "import_ray", "start_workers"]

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "STRICT_SPREAD", "SPREAD", "STRICT_PACK")
"""Ray's placement strategies: ``PACK`` (as few nodes as fit), ``STRICT_SPREAD`` (a node per
worker), ``SPREAD`` (spread where possible), ``STRICT_PACK`` (one node)."""


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        JaxdistError: Ray is not installed; the message says how to install it.
    """
    try:
        return importlib.import_module("ray")
    except ImportError as exc:
        raise JaxdistError(f"Ray is not installed ({exc}): pip install 'jaxdist[ray]'"
                           ) from None


class WorkerActor:
    """The Ray actor around one worker: it starts the worker as its child and watches it.

    Runs in a Ray worker process (it is made an actor with ``ray.remote`` by
    :func:`start_workers`); it imports nothing of Ray and nothing of jax.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()     # the ready line came, or the worker failed
        self._stopping = threading.Event()  # the worker is being stopped on purpose
        self._stopped = threading.Event()   # it was, and it has exited
        self._reply: dict[str, Any] = {}
        self._tail: collections.deque[str] = collections.deque(maxlen=15)

    def start(self, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
        """Start the worker; ``{"address", "device", "pid"}`` once it is ready, or ``{"error"}``."""
        # The thread that starts the child lives as long as the child: PR_SET_PDEATHSIG fires
        # when the parent *thread* ends, so a short-lived one would kill the worker with it.
        threading.Thread(target=self._run, args=(args, env), name="jaxdist-worker-watch",
                         daemon=True).start()
        if not self._ready.wait(timeout):
            self._stopping.set()
            if self._proc is not None:
                self._proc.kill()
            return {"error": f"it did not print its ready line within {timeout:g} s",
                    "tail": "".join(self._tail)}
        return dict(self._reply)

    def _run(self, args: list[str], env: dict[str, str]) -> None:
        try:
            proc = subprocess.Popen(worker_command(args, parent=os.getpid()),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        except OSError as exc:
            self._reply = {"error": f"{sys.executable} could not be started: {exc}", "tail": ""}
            self._ready.set()
            return
        self._proc = proc
        assert proc.stdout is not None and proc.stderr is not None  # we made the pipes
        errors = threading.Thread(target=self._forward, args=(proc.stderr,), daemon=True)
        errors.start()
        for line in proc.stdout:
            ready = None if self._ready.is_set() else parse_ready(line)
            if ready is not None:
                self._reply = {"address": ready[0], "device": ready[1], "pid": proc.pid}
                self._ready.set()
            else:  # the worker's other lines go to the actor's stderr: Ray copies an
                # actor's stdout to its driver's, where it would mix with the CLI's output
                sys.stderr.write(line)
                sys.stderr.flush()
        code = proc.wait()
        errors.join()
        if not self._ready.is_set():
            self._reply = {"error": f"it exited with code {code} before it was ready",
                           "tail": "".join(self._tail)}
            self._ready.set()
        elif not self._stopping.is_set():
            print(f"jaxdist-worker pid {proc.pid} exited with code {code}; its actor exits "
                  f"with it", file=sys.stderr, flush=True)
            os._exit(1)
        self._stopped.set()

    def _forward(self, stream: IO[str]) -> None:
        """The worker's stderr, to the actor's (Ray's log files), keeping the last lines."""
        for line in stream:
            self._tail.append(line)
            sys.stderr.write(line)
            sys.stderr.flush()

    def worker_pid(self) -> int | None:
        """The worker process's id on this node (``None`` before it started)."""
        return None if self._proc is None else self._proc.pid

    def wait_stopped(self, timeout: float) -> int | None:
        """The worker's exit code once :meth:`stop` has ended it (``None`` if not within
        ``timeout`` s). A worker that exits on its own takes the actor with it, so then this
        call fails (``ray.exceptions.RayActorError``) instead of returning."""
        if not self._stopped.wait(timeout):
            return None
        return None if self._proc is None else self._proc.returncode

    def stop(self, grace: float) -> int | None:
        """SIGTERM the worker (it drains and exits 0); SIGKILL it after ``grace`` seconds.
        Returns its exit code."""
        self._stopping.set()
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                return proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait()


@dataclass(frozen=True)
class RayWorker:
    """One worker started by :func:`start_workers`."""

    address: str   # HOST:PORT the worker serves on
    device: str    # the device it reported, e.g. cuda:0
    node_ip: str   # the IP of its Ray node
    pid: int       # the worker process on that node
    actor: Any     # the ray.actor.ActorHandle of its WorkerActor; ray.kill(actor) kills both


class RayWorkers:
    """The workers of one placement group; :meth:`close` stops them and frees the group."""

    def __init__(self, workers: Sequence[RayWorker], placement_group: Any) -> None:
        self.workers = list(workers)
        self.placement_group = placement_group
        self._closed = False

    @property
    def addresses(self) -> list[str]:
        return [w.address for w in self.workers]

    def close(self, grace: float = 20.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after ``grace`` s), kill the actors and
        remove the placement group. Actors that died already are skipped."""
        if self._closed:
            return
        self._closed = True
        ray = import_ray()
        if not ray.is_initialized():  # ray.shutdown() ended the actors and the group already
            return
        _stop_actors(ray, [w.actor for w in self.workers], grace)
        _remove_group(self.placement_group)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_workers(n: int, *, resources: Mapping[str, float] | None = None,
                  strategy: str = "PACK", address: str | None = None,
                  placement_timeout: float = 60.0, start_timeout: float = 180.0,
                  loopback: bool | None = None, device: str | None = None,
                  weights_roots: Sequence[str] = (), artifact_cache: str | None = None,
                  compilation_cache: str | None = None, max_sessions: int = 64,
                  log_level: str = "WARNING", env: Mapping[str, str] | None = None,
                  token_file: str | None = None, tls_cert: str | None = None,
                  tls_key: str | None = None, tls_ca: str | None = None,
                  gpu_memory_fraction: float | None = None,
                  extra_args: Sequence[str] = ()) -> RayWorkers:
    """Start ``n`` workers as Ray actors in one placement group and wait until each listens.

    Ray is used as this process finds it: when ``ray.init`` was called already, that
    connection; otherwise ``ray.init(address)`` (``None``: a running local instance, or a new
    one; ``"auto"`` or ``HOST:PORT``: an existing cluster), which stays initialized after
    :meth:`RayWorkers.close`. Paths (weights roots, caches, token and TLS files) are read on
    the nodes, so each node needs them at the same place.

    Args:
        n: number of workers, one per bundle.
        resources: each bundle, e.g. ``{"GPU": 1}``, ``{"TPU": 1}`` or ``{"CPU": 2}``
            (default ``{"CPU": 1}``); the actor holds all of it.
        strategy: Ray's placement strategy, one of :data:`STRATEGIES`.
        address: the Ray cluster to connect to, when Ray is not initialized yet.
        placement_timeout: seconds to wait for Ray to place the group.
        start_timeout: seconds each worker may take to start listening.
        loopback: ``None``: loopback when every bundle is on this process's node, else the
            nodes' IPs; ``True``/``False`` force one or the other.
        device: the workers' device directive (default: from the bundle, see above).
        weights_roots, artifact_cache, compilation_cache, max_sessions, log_level, token_file,
        tls_cert, tls_key, tls_ca, gpu_memory_fraction, extra_args: the worker options, as for
            :func:`jaxdist.launch.process.worker_args` (``None``: the worker's default).
        env: more environment variables for the workers.

    Raises:
        JaxdistError: Ray is not installed.
        TransportError: bad arguments, Ray unreachable, the group not placed in time (naming
            the resources asked for and those the cluster has), or a worker that did not start
            (with the end of its log).
        DeviceError: ``device`` names accelerators the bundle does not hold, or
            ``gpu_memory_fraction`` is not in ``(0, 1]``.
    """
    if n < 1:
        raise TransportError(f"need at least one Ray worker, asked for {n}")
    if strategy not in STRATEGIES:
        raise TransportError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
    bundle = _bundle(resources)
    device = bundle_device(bundle, device)
    if gpu_memory_fraction is not None:
        from jaxdist.core.config import check_gpu_memory_fraction  # it loads jax

        gpu_memory_fraction = check_gpu_memory_fraction(gpu_memory_fraction,
                                                        "gpu_memory_fraction")
    ray = _connect(address)
    from ray.util.placement_group import placement_group

    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy)
    actors: list[Any] = []
    try:
        if not pg.wait(placement_timeout):
            raise _unplaced(ray, pg, n, bundle, strategy, placement_timeout)
        hosts = _hosts(ray, pg, n, loopback)
        actor_class = ray.remote(WorkerActor)
        from ray.util.scheduling_strategies import (
            PlacementGroupSchedulingStrategy,
        )

        extra = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        replies = []
        for i, host in enumerate(hosts):
            options: dict[str, Any] = {
                "num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
                "resources": extra, "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i)}
            if "memory" in bundle:
                options["memory"] = bundle["memory"]
            actor = actor_class.options(**options).remote()
            actors.append(actor)
            listen = f"[{host}]:0" if ":" in host else f"{host}:0"
            args = worker_args(listen, device=device, weights_roots=weights_roots,
                               artifact_cache=artifact_cache,
                               compilation_cache=compilation_cache, max_sessions=max_sessions,
                               log_level=log_level, token_file=token_file, tls_cert=tls_cert,
                               tls_key=tls_key, tls_ca=tls_ca,
                               gpu_memory_fraction=gpu_memory_fraction,
                               extra_args=[*_group_peers(hosts, tls_ca), *extra_args])
            replies.append(actor.start.remote(args, dict(env or {}), start_timeout))
        workers = []
        for i, (host, ref) in enumerate(zip(hosts, replies)):
            try:
                # Beyond the worker's own start_timeout: Ray may first start the actor's process.
                reply = ray.get(ref, timeout=start_timeout + 60)
            except ray.exceptions.RayError as exc:
                raise TransportError(f"Ray worker {i} (bundle {bundle}) did not start: "
                                     f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
                                     ) from None
            if "error" in reply:
                raise TransportError(f"Ray worker {i} on {host}: {reply['error']}; its log ends "
                                     f"with:\n{reply['tail']}")
            workers.append(RayWorker(reply["address"], reply["device"], host, reply["pid"],
                                     actors[i]))
            log.info("Ray worker %d on %s (%s), pid %d", i, reply["address"], reply["device"],
                     reply["pid"])
        return RayWorkers(workers, pg)
    except BaseException:
        _stop_actors(ray, actors, grace=None)
        _remove_group(pg)
        raise


def bundle_device(bundle: Mapping[str, float], device: str | None) -> str:
    """The device directive of a worker holding ``bundle``: ``device``, checked against the
    bundle, or the bundle's own (``cuda`` with ``GPU``, ``tpu`` with ``TPU``, else ``cpu``).

    Ray makes a bundle's accelerators the only ones its actor sees, numbered from 0, so the
    index of ``cuda:N`` or ``tpu:N`` must be below the bundle's count.

    Raises:
        DeviceError: a directive for accelerators the bundle does not hold.

    Example:
        >>> bundle_device({"GPU": 1}, None), bundle_device({"CPU": 2}, None)
        ('cuda', 'cpu')
    """
    gpus, tpus = math.ceil(bundle.get("GPU", 0)), math.ceil(bundle.get("TPU", 0))
    if device is None:
        return "cuda" if gpus else "tpu" if tpus else "cpu"
    from jaxdist.core.devices import parse_directive  # it loads jax

    d = parse_directive(device)
    held = {"cuda": gpus, "rocm": gpus, "tpu": tpus}.get(d.platform)
    if held is not None and (d.index or 0) >= held:
        kind = "TPU" if d.platform == "tpu" else "GPU"
        raise DeviceError(
            f"device {device!r}: each Ray worker holds the bundle {dict(bundle)}, so it sees "
            f"{held} {kind} device{'s' if held != 1 else ''} (Ray sets CUDA_VISIBLE_DEVICES or "
            f"TPU_VISIBLE_CHIPS per actor, numbered from 0); "
            + (f"ask for {kind} in resources" if held == 0 else
               f"expected {d.platform} or {d.platform}:0" if held == 1 else
               f"expected {d.platform} or {d.platform}:0 to {d.platform}:{held - 1}"))
    return str(d)


def _bundle(resources: Mapping[str, float] | None) -> dict[str, float]:
    bundle = dict(resources if resources is not None else {"CPU": 1})
    bad = {k: v for k, v in bundle.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float))
           or not v > 0}
    if not bundle or bad:
        raise TransportError(f"resources {dict(bundle)!r}: expected a bundle of positive "
                             f"amounts such as {{'GPU': 1}}, {{'TPU': 1}} or {{'CPU': 2}}")
    return bundle


def _connect(address: str | None) -> Any:
    """``ray``, initialized: the connection this process has, or ``ray.init(address)``."""
    ray = import_ray()
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto", current):
            raise TransportError(f"address {address!r}: this process is connected to the Ray "
                                 f"cluster at {current} already (ray.init was called); pass "
                                 f"address=None to use it")
        return ray
    try:
        ray.init(address=address)
    except ConnectionError as exc:
        raise TransportError(f"cannot connect to Ray at {address!r}: {exc}") from None
    return ray


def _resources(found: Mapping[str, float]) -> str:
    """A cluster's resources for people, without Ray's per-node and per-group entries."""
    shown = []
    for k, v in sorted(found.items()):
        if k.startswith(("node:", "bundle_group")) or "_group_" in k:
            continue
        shown.append(f"{k} {v / 1e9:.1f} GB" if "memory" in k else f"{k} {v:g}")
    return ", ".join(shown) or "nothing"


def _unplaced(ray: Any, pg: Any, n: int, bundle: Mapping[str, float], strategy: str,
              timeout: float) -> TransportError:
    from ray.util.placement_group import placement_group_table

    state = placement_group_table(pg).get("stats", {}).get("scheduling_state", "PENDING")
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    why = (f"; {strategy} puts each bundle on a node of its own, so it needs {n} nodes"
           if strategy == "STRICT_SPREAD" and n > nodes else "")
    return TransportError(
        f"Ray could not place {n} worker bundle{'s' if n != 1 else ''} of {dict(bundle)} "
        f"(strategy {strategy}) within {timeout:g} s, Ray says {state}: the cluster has "
        f"{nodes} node{'s' if nodes != 1 else ''} with {_resources(ray.cluster_resources())} "
        f"in all, {_resources(ray.available_resources())} free{why}. Ask for resources it "
        f"has (resources=, --ray-resources), fewer workers, or add nodes")


def _hosts(ray: Any, pg: Any, n: int, loopback: bool | None) -> list[str]:
    """The host each bundle's worker listens on (see the module's "Addresses")."""
    from ray.util.placement_group import placement_group_table

    placed = placement_group_table(pg)["bundles_to_node_id"]
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    here = ray.get_runtime_context().get_node_id()
    nodes = [placed[i] for i in range(n)]
    local = all(node == here for node in nodes)
    if loopback and not local:
        elsewhere = sorted({ips.get(node, node) for node in nodes if node != here})
        raise TransportError(f"loopback=True, but Ray placed workers on other nodes "
                             f"({', '.join(elsewhere)}), which cannot reach this one's loopback")
    if local if loopback is None else loopback:
        return ["127.0.0.1"] * n
    return [ips[node] for node in nodes]


def _group_peers(hosts: Sequence[str], tls_ca: Any) -> list[str]:
    """``--peer-allow`` for each node of the group (see the module's "Next hops")."""
    if tls_ca is not None:
        return []
    args = []
    for host in sorted({h for h in hosts if h != "127.0.0.1"}):
        args += ["--peer-allow", host]
    return args


def _stop_actors(ray: Any, actors: Sequence[Any], grace: float | None) -> None:
    """Stop each actor's worker within about ``grace`` seconds, then kill the actors (``None``:
    kill at once; the workers die with them)."""
    if grace is not None:
        stops = []
        for actor in actors:
            try:
                stops.append(actor.stop.remote(grace))
            except ray.exceptions.RayError:
                pass
        if stops:  # one wait for all: an actor that died already answers with an error at once
            ray.wait(stops, num_returns=len(stops), timeout=grace + 10)
    for actor in actors:
        try:
            ray.kill(actor)
        except ray.exceptions.RayError:
            pass


def _remove_group(pg: Any) -> None:
    from ray.util.placement_group import remove_placement_group

    remove_placement_group(pg)
