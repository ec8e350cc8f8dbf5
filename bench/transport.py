"""Transport benchmark: jaxdist's frame paths against a raw-TCP relay chain on loopback.

Two measurements, each against a raw-TCP baseline with the same topology, in the same run:

1. **Per-hop latency of a 4 KB activation, per route between workers.** An identity model
   (units return ``x + 0``, no weights) is deployed as 1, 2 and 3 stages on 3 local workers, once
   per route: ``tcp`` (workers with their default data port: frames between workers over the
   TCP route) and ``grpc`` (3 more workers started ``--data-listen off``: over gRPC ``Push``).
   The median round trip of ``pipe.call`` for a float32 (1, 1024) tensor is taken for each; the
   least-squares slope of the median over the number of stages is what one more worker hop
   adds. The routes and the baseline are measured interleaved. The baseline is a chain of
   1, 2, 3 relay subprocesses: the client sends a length-prefixed ``codec.to_bytes`` message to
   relay 1, each relay forwards it whole to the next, and the last relay answers on a connection
   the client dialled (as the coordinator's ``Subscribe`` stream to the last stage). Relays
   forward bytes without decoding them: the baseline is the transport floor, codec work happens
   at the client ends only, inside the timed region, as in ``pipe.call``. Beside it, a chain of
   *jax relays* with the same topology: each decodes the tensor, runs the compiled identity step
   (``jax.jit``, the same ``x + 0``), copies the result to the host and encodes it; its slope
   (``jax_relay_per_hop_ms`` in the record) is the floor of a hop that computes with jax in a
   Python process, with no frame header, no checks and no event loop.
2. **Bandwidth.** A 1-stage pipeline (coordinator -> worker -> coordinator) against a 1-relay
   chain, for float32 tensors of 4 KiB to 64 MiB; throughput is ``2 * bytes / median RTT``
   (bytes moved both ways). Each returned tensor is compared with the one sent, which covers
   activations above gRPC's 4 MiB default message limit.

Measurements of jaxdist and of the baseline are interleaved in blocks, so drift of a shared
2-core machine hits both alike. Nothing here asserts on time; every record says whether it met
its target.

Usage::

    python bench/transport.py [--quick] [--routes tcp,grpc] [--out results.json]

``per_hop_latency_4KB`` is the ``tcp`` route (the default between workers),
``per_hop_latency_4KB_grpc`` the ``grpc`` route; ``--routes`` picks which are measured.

Prints one JSON object per measurement on stdout (``metric``, ``value``, ``unit``, ``baseline``,
``baseline_value``, ``ratio``, ``target``, ``meets_target`` plus detail keys).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common

_LEN = struct.Struct("<Q")  # length prefix of a raw-TCP message
_RELAY_READY = "relay listening on "
_ROLE_UPSTREAM = b"U"  # a connection that sends messages into a relay
_ROLE_SUBSCRIBER = b"S"  # the client's return connection, dialled to the last relay


# ---------------------------------------------------------------------------------------------
# Raw-TCP relay (runs in its own process; stdlib only, so it starts in milliseconds)


def _connect(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    return _common.nodelay(socket.create_connection((host, int(port))))


def _jax_step() -> Callable[[memoryview], bytes]:
    """What a ``--jax`` relay does to each message: decode the tensor (``codec.from_bytes``),
    run the compiled identity step of the benchmark's model on it, copy the result to the host
    and encode it (``codec.to_bytes``). The least a process that computes with jax does per
    hop: no frame header, no checks, no event loop."""
    import jax
    import numpy as np

    from jaxdist.core import codec

    step = jax.jit(lambda x: x + 0).lower(jax.ShapeDtypeStruct((1, 1024), np.float32)).compile()

    def run(message: memoryview) -> bytes:
        name, x = codec.from_bytes(bytes(message))
        return codec.to_bytes(name, np.asarray(step(x)))

    return run


def _relay_main(next_hop: str | None, jax_step: bool = False) -> int:
    """Forward length-prefixed messages from upstream to ``next_hop`` (or to the subscriber);
    with ``jax_step``, each through :func:`_jax_step` on the way."""
    step = _jax_step() if jax_step else None
    server = socket.create_server(("127.0.0.1", 0))
    print(f"{_RELAY_READY}127.0.0.1:{server.getsockname()[1]}", flush=True)
    down = None
    if next_hop:
        down = _connect(next_hop)
        down.sendall(_ROLE_UPSTREAM)
    up = None
    while up is None or down is None:
        conn, _ = server.accept()
        _common.nodelay(conn)
        role = conn.recv(1)
        if role == _ROLE_UPSTREAM:
            up = conn
        elif role == _ROLE_SUBSCRIBER and not next_hop:
            down = conn
        else:
            conn.close()
    buf = bytearray(1 << 16)
    while True:
        if not _common.recv_into(up, memoryview(buf)[:_LEN.size]):
            return 0
        (n,) = _LEN.unpack_from(buf)
        if len(buf) < _LEN.size + n:
            head = bytes(buf[:_LEN.size])
            buf = bytearray(_LEN.size + n)
            buf[:_LEN.size] = head
        view = memoryview(buf)
        _common.recv_into(up, view[_LEN.size:_LEN.size + n])
        if step is not None:
            out = step(view[_LEN.size:_LEN.size + n])
            down.sendall(_LEN.pack(len(out)) + out)
            continue
        # Store and forward, as a worker needs the whole tensor before it computes.
        down.sendall(view[:_LEN.size + n])


class RawChain:
    """``hops`` relay processes on loopback: client -> relay 1 -> ... -> relay n -> client.

    With ``jax_step``, each relay runs the identity step on every message (:func:`_jax_step`).
    """

    def __init__(self, hops: int, *, jax_step: bool = False) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        try:
            address = last = ""
            for _ in range(hops):  # the last relay first: each dials the one after it
                cmd = [sys.executable, os.path.abspath(__file__), "_relay"]
                if address:
                    cmd += ["--next", address]
                if jax_step:
                    cmd.append("--jax")
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                        stdin=subprocess.DEVNULL)
                self.procs.append(proc)
                line = proc.stdout.readline().strip() if proc.stdout else ""
                if not line.startswith(_RELAY_READY):
                    raise RuntimeError(f"relay (pid {proc.pid}) did not start: {line!r}")
                address = line[len(_RELAY_READY):]
                last = last or address
            self.sub = _connect(last)
            self.sub.sendall(_ROLE_SUBSCRIBER)
            self.send = _connect(address)
            self.send.sendall(_ROLE_UPSTREAM)
        except BaseException:
            self.close()
            raise
        self._hdr = bytearray(_LEN.size)
        self._buf = bytearray(0)

    def call(self, array: Any) -> Any:
        """Send one tensor through the chain and return what comes back (codec both ways)."""
        from jaxdist.core import codec

        self._send(codec.to_bytes("x", array))
        return codec.from_bytes(self._receive())[1]

    def echo(self, data: bytes) -> memoryview:
        """Send already-encoded bytes and receive them back: the wire alone, no codec."""
        self._send(data)
        return self._receive()

    def _send(self, data: bytes) -> None:
        if len(data) <= 1 << 16:  # one segment, as small frames are on a gRPC stream
            self.send.sendall(_LEN.pack(len(data)) + data)
        else:  # no copy of a large payload just to prepend 8 bytes
            self.send.sendall(_LEN.pack(len(data)))
            self.send.sendall(data)

    def _receive(self) -> memoryview:
        """The next message from the last relay; valid until the next receive."""
        _common.recv_into(self.sub, memoryview(self._hdr))
        (n,) = _LEN.unpack_from(self._hdr)
        if len(self._buf) < n:
            self._buf = bytearray(n)
        view = memoryview(self._buf)[:n]
        _common.recv_into(self.sub, view)
        return view

    def close(self) -> None:
        for s in (getattr(self, "send", None), getattr(self, "sub", None)):
            if s is not None:
                s.close()
        _common.stop_relays(self.procs, 5.0)
        self.procs = []


# ---------------------------------------------------------------------------------------------
# Timing helpers


def _timed(fn: Callable[[], Any], n: int, out: list[float]) -> Any:
    result = None
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t0)
    return result


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``ys`` over ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx




def _record(metric: str, value: float, unit: str, baseline_value: float, ratio: float,
            target: str, meets: bool, **detail: Any) -> dict[str, Any]:
    return {"metric": metric, "value": round(value, 4), "unit": unit, "baseline": "raw TCP",
            "baseline_value": round(baseline_value, 4), "ratio": round(ratio, 4), "target": target,
            "meets_target": meets, **detail, "loadavg_1m": round(os.getloadavg()[0], 2)}


# ---------------------------------------------------------------------------------------------
# The measurements


def _identity(params: dict[str, Any], state: dict[str, Any], carry: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"x": carry["x"] + 0}, {}


def _identity_model(n_units: int) -> Any:
    from jaxdist.export.model import Model, Unit

    return Model(f"identity{n_units}", units=[Unit(f"u{i}", _identity) for i in range(n_units)],
                 inputs={"x": ("b, n", "float32")}, buckets=[{"b": 1, "n": 1024}],
                 any_shape=True)  # the bandwidth sweep sends 4 KiB .. 64 MiB


HOP_TARGET_MS = 0.15  # issue #12: one more worker hop of a 4 KB frame
HOP_METRICS = {"tcp": "per_hop_latency_4KB", "grpc": "per_hop_latency_4KB_grpc"}


def measure_hops(pipes: dict[str, dict[int, Any]], chains: dict[int, RawChain],
                 jax_chains: dict[int, RawChain], *, warmup: int, rounds: int, block: int,
                 machine: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-hop latency: slope of the median 4 KB RTT over 1, 2, 3 stages, for each route in
    ``pipes`` (``{"tcp": {1: pipe, 2: pipe, 3: pipe}, "grpc": ...}``), for the raw relay
    chain and for the chain of jax relays, interleaved in blocks. One record per route, each
    with the same baseline (raw TCP) and the jax relays' slope beside it."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((1, 1024)).astype(np.float32)
    samples: dict[tuple[str, int], list[float]] = {}
    systems: dict[tuple[str, int], Callable[[], Any]] = {}
    stages = sorted(chains)
    for k in stages:
        for route, by_stages in pipes.items():
            systems[(route, k)] = lambda p=by_stages[k]: p.call({"x": x})["x"]
        systems[("raw", k)] = lambda c=chains[k]: c.call(x)
        systems[("jax", k)] = lambda c=jax_chains[k]: c.call(x)
    for key, fn in systems.items():
        out = _timed(fn, warmup, [])
        if not np.array_equal(out, x):
            raise RuntimeError(f"{key}: the 4 KB activation came back changed")
        samples[key] = []
    for _ in range(rounds):
        for key, fn in systems.items():
            _timed(fn, block, samples[key])
    med = {key: _median(v) * 1e3 for key, v in samples.items()}
    t_slope, t_icpt = _slope(stages, [med[("raw", k)] for k in stages])
    x_slope, _ = _slope(stages, [med[("jax", k)] for k in stages])
    records = []
    for route in pipes:
        j_slope, j_icpt = _slope(stages, [med[(route, k)] for k in stages])
        detail = {
            "route": route, "payload_bytes": int(x.nbytes), "iterations": rounds * block,
            "jaxdist_median_rtt_ms": {k: round(med[(route, k)], 4) for k in stages},
            "tcp_median_rtt_ms": {k: round(med[("raw", k)], 4) for k in stages},
            "jaxdist_p90_rtt_ms": {k: round(_quantile(samples[(route, k)], 0.9) * 1e3, 4)
                                   for k in stages},
            "tcp_p90_rtt_ms": {k: round(_quantile(samples[("raw", k)], 0.9) * 1e3, 4)
                               for k in stages},
            "jaxdist_intercept_ms": round(j_icpt, 4), "tcp_intercept_ms": round(t_icpt, 4),
            # The floor of a hop that computes with jax: relays that decode, run the compiled
            # identity and encode (no frame header, checks or event loop)
            "jax_relay_per_hop_ms": round(x_slope, 4),
            "jax_relay_median_rtt_ms": {k: round(med[("jax", k)], 4) for k in stages},
            "ratio_vs_jax_relay": round(j_slope / x_slope, 4) if x_slope > 0 else None,
        }
        records.append(_record(HOP_METRICS[route], j_slope, "ms", t_slope,
                               j_slope / t_slope if t_slope > 0 else float("inf"),
                               f"<= {HOP_TARGET_MS} ms", j_slope <= HOP_TARGET_MS, **detail,
                               **machine))
    return records


SIZES: list[tuple[str, int]] = [("4KB", 4 << 10), ("64KB", 64 << 10), ("1MB", 1 << 20),
                                ("4MB", 4 << 20), ("16MB", 16 << 20), ("64MB", 64 << 20)]


def measure_bandwidth(pipe: Any, chain: RawChain, *, budget_s: float, min_iters: int,
                      max_iters: int, machine: dict[str, Any]) -> list[dict[str, Any]]:
    """Round trips of 4 KiB .. 64 MiB through one stage and one relay; GB/s = 2 * bytes / RTT.

    Three systems per size: ``jaxdist`` (``pipe.call``), ``tcp`` (the relay, with
    ``codec.to_bytes``/``from_bytes`` inside the timed call, as ``pipe.call`` has its codec
    inside) and ``tcp_wire`` (the relay moving bytes encoded once beforehand: the wire alone).
    The headline ratio is against ``tcp``; ``ratio_vs_wire`` is against ``tcp_wire``.
    """
    import numpy as np

    from jaxdist.core import codec

    rng = np.random.default_rng(1)
    records = []
    for label, nbytes in SIZES:
        x = rng.standard_normal((1, nbytes // 4), dtype=np.float32)
        data = codec.to_bytes("x", x)
        systems: dict[str, tuple[Callable[[], Any], Callable[[Any], bool]]] = {
            "jaxdist": (lambda x=x: pipe.call({"x": x})["x"],
                        lambda y, x=x: bool(np.array_equal(y, x))),
            "tcp": (lambda x=x: chain.call(x), lambda y, x=x: bool(np.array_equal(y, x))),
            "tcp_wire": (lambda data=data: chain.echo(data), lambda b, data=data: b == data),
        }
        samples: dict[str, list[float]] = {k: [] for k in systems}
        equal: dict[str, bool] = {}
        for key, (fn, check) in systems.items():  # warm-up: a new shape compiles on first call
            equal[key] = check(_timed(fn, 2, []))
        # Interleave in rounds; each system runs until it spent its share of the time budget,
        # with at least min_iters and at most max_iters calls in all.
        rounds = 3
        for r in range(1, rounds + 1):
            for key, (fn, check) in systems.items():
                ts = samples[key]
                goal_s, lo, hi = budget_s * r / rounds, -(-min_iters * r // rounds), \
                    max_iters * r // rounds
                while len(ts) < hi and (sum(ts) < goal_s or len(ts) < lo):
                    equal[key] = check(_timed(fn, 1, ts)) and equal[key]
        med = {k: _median(v) for k, v in samples.items()}
        gbps = {k: 2 * nbytes / med[k] / 1e9 for k in systems}
        ratio = gbps["jaxdist"] / gbps["tcp"]
        records.append(_record(
            f"bandwidth_{label}", gbps["jaxdist"], "GB/s", gbps["tcp"], ratio,
            ">= 0.4 of raw TCP", ratio >= 0.4, bytes=nbytes, shape=list(x.shape),
            iterations={k: len(v) for k, v in samples.items()},
            median_rtt_ms={k: round(v * 1e3, 4) for k, v in med.items()},
            tcp_wire_gbps=round(gbps["tcp_wire"], 4),
            ratio_vs_wire=round(gbps["jaxdist"] / gbps["tcp_wire"], 4),
            meets_target_vs_wire=gbps["jaxdist"] / gbps["tcp_wire"] >= 0.4,
            roundtrip_equal=equal["jaxdist"], tcp_roundtrip_equal=equal["tcp"],
            tcp_wire_roundtrip_equal=equal["tcp_wire"], **machine))
    return records


ROUTE_WORKER_ARGS = {"tcp": [], "grpc": ["--data-listen", "off"]}  # how each route is chosen


def _deploy_hops(cluster: Any, route: str) -> dict[int, Any]:
    """The identity model as 1, 2 and 3 stages on the cluster's 3 workers; checks that the
    stages between workers use ``route``."""
    a, b, c = cluster.addresses
    placement = {1: [a], 2: [a, b], 3: [a, b, c]}
    pipes = {k: cluster.deploy(_identity_model(k), split=[1] * k, workers=placement[k],
                               platforms=("cpu",)) for k in (1, 2, 3)}
    for k, pipe in pipes.items():
        used = {"tcp" if s.next_data_hop else "grpc" for s in pipe.specs[:-1]}
        if used - {route}:
            raise RuntimeError(f"{k} stages meant for the {route} route use {sorted(used)}")
    return pipes


def run(quick: bool, routes: Sequence[str] = ("tcp", "grpc")) -> list[dict[str, Any]]:
    from contextlib import ExitStack

    from jaxdist.coordinator.cluster import Cluster

    machine = _common.machine()
    records: list[dict[str, Any]] = []
    chains, jax_chains = {}, {}
    try:
        for k in (1, 2, 3):
            chains[k] = RawChain(k)
            jax_chains[k] = RawChain(k, jax_step=True)
        with ExitStack() as stack:
            pipes = {}
            for route in routes:
                cluster = stack.enter_context(Cluster.local(
                    3, extra_args=ROUTE_WORKER_ARGS[route]))
                pipes[route] = _deploy_hops(cluster, route)
            if quick:
                hops = measure_hops(pipes, chains, jax_chains, warmup=50, rounds=10, block=30,
                                    machine=machine)
            else:
                hops = measure_hops(pipes, chains, jax_chains, warmup=200, rounds=30,
                                    block=100, machine=machine)
            for chain in jax_chains.values():
                chain.close()
            for hop in hops:
                _emit(hop, records)
            # Bandwidth needs only a 1-stage pipeline (no hop between workers, so no route);
            # close the others so their streams stay quiet.
            first = pipes[routes[0]]
            for by_stages in pipes.values():
                for pipe in by_stages.values():
                    if pipe is not first[1]:
                        pipe.close()
            if quick:
                bw = measure_bandwidth(first[1], chains[1], budget_s=0.4, min_iters=3,
                                       max_iters=300, machine=machine)
            else:
                bw = measure_bandwidth(first[1], chains[1], budget_s=4.0, min_iters=9,
                                       max_iters=3000, machine=machine)
            sixteen = next(r for r in bw if r["metric"] == "bandwidth_16MB")
            _emit(dict(sixteen, metric="throughput_16MB",
                       note="same samples as bandwidth_16MB"), records)
            for r in bw:
                _emit(r, records)
    finally:
        for chain in [*chains.values(), *jax_chains.values()]:
            chain.close()
    return records


def _emit(record: dict[str, Any], records: list[dict[str, Any]]) -> None:
    records.append(record)
    print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer iterations (CI smoke, < 60 s)")
    p.add_argument("--out", metavar="FILE", help="also write the list of records to FILE (JSON)")
    p.add_argument("--routes", default="tcp,grpc",
                   help="routes between workers to measure the per-hop latency of, comma-"
                        "separated: tcp (the workers' data port), grpc (workers started "
                        "--data-listen off) (default %(default)s)")
    opts = p.parse_args(argv)
    routes = [r.strip() for r in opts.routes.split(",") if r.strip()]
    unknown = sorted(set(routes) - set(ROUTE_WORKER_ARGS))
    if unknown or not routes:
        p.error(f"--routes: unknown {unknown or routes}; choose from tcp, grpc")
    t0 = time.perf_counter()
    records = run(opts.quick, routes)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(records, f, indent=1)
    print(f"transport bench done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_relay":
        relay = argparse.ArgumentParser(prog="transport.py _relay")
        relay.add_argument("--next", default=None)
        relay.add_argument("--jax", action="store_true")
        relay_args = relay.parse_args(sys.argv[2:])
        sys.exit(_relay_main(relay_args.next, relay_args.jax))
    sys.exit(main())
