"""``jaxdist status``: what each worker runs, as a table or JSON.

Per worker: address, device, versions, uptime, memory (on a GPU or TPU: what the worker's process
holds on its device, its weights, KV caches and executables; on a cpu: the host's RAM), sessions,
cached artifacts, and every
loaded stage with its pipeline id, model, artifact digest, bound weight bytes (of them, GGML
blocks bound as stored: "packed"; and the GGML types dequantized when bound), sessions and route
(how its frames leave: "tcp" to the next worker's data port, or "grpc"), plus
the worker's CPU kernels (version, types, threads, or why it has none), and the stages still
loading, with their phase (load, compile, bind) and how long it has run. Pipelines
left loaded by ``jaxdist deploy`` show up here; ``jaxdist unload`` removes them.

The workers are asked at once. One that does not answer within ``--timeout`` is shown as
``ADDRESS  down: WHY`` (in ``--json``: ``{"address", "down": true, "error"}``) among the
others, and the command then ends with one line, ``jaxdist: error: 1 of 3 workers did not
answer: WHY`` (each WHY names its worker), and exit status 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
from typing import TYPE_CHECKING, Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from jaxdist.cli.common import add_auth_args, client_args_of, fmt_bytes
from jaxdist.core.errors import JaxdistError

if TYPE_CHECKING:
    from jaxdist.proto import jaxdist_pb2 as pb

__all__ = ["add_parser", "memory_line"]


_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}


def _as_json(msg: Message) -> dict[str, Any]:
    """The message as JSON, with 64-bit integers as numbers (proto3 JSON writes them as strings,
    for JavaScript; byte counts read better as numbers, and Python's json is exact)."""
    out: dict[str, Any] = MessageToDict(msg, preserving_proto_field_name=True)

    def fix(d: dict[str, Any], desc: Any) -> None:
        for f in desc.fields:
            if f.name not in d:
                continue
            if f.cpp_type in _INT64:
                d[f.name] = ([int(v) for v in d[f.name]] if isinstance(d[f.name], list)
                             else int(d[f.name]))
            elif f.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE and f.message_type is not None \
                    and not f.message_type.GetOptions().map_entry:
                for item in (d[f.name] if isinstance(d[f.name], list) else [d[f.name]]):
                    fix(item, f.message_type)

    fix(out, msg.DESCRIPTOR)
    return out


def add_parser(sub: Any) -> None:
    status = sub.add_parser("status", help="show what each worker runs")
    status.add_argument("--workers", required=True, help="comma-separated HOST:PORT")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=5.0)
    add_auth_args(status)
    status.set_defaults(run=run)


def run(opts: argparse.Namespace) -> int:
    addresses = [a.strip() for a in opts.workers.split(",") if a.strip()]
    if not addresses:
        raise JaxdistError("status needs --workers HOST:PORT[,HOST:PORT...]")
    args = client_args_of(opts)
    # Asked at once, so each worker that does not answer costs --timeout once, not in turn.
    with concurrent.futures.ThreadPoolExecutor(min(len(addresses), 16)) as pool:
        answers = list(pool.map(lambda a: _ask(a, opts.timeout, args), addresses))
    down = [r for r in answers if isinstance(r, str)]  # why, naming the worker
    if opts.json:
        print(json.dumps([{"address": a, "down": True, "error": r} if isinstance(r, str)
                          else _as_json(r) for a, r in zip(addresses, answers)], indent=2))
    else:
        for a, r in zip(addresses, answers):
            if isinstance(r, str):
                print(f"{a}  down: {r}")
            else:
                _print_worker(r)
    if down:
        raise JaxdistError(f"{len(down)} of {len(addresses)} workers did not answer: "
                           + "; ".join(down))
    return 0


def _ask(address: str, timeout: float, args: dict[str, Any]) -> pb.InfoReply | str:
    """The worker's ``Info``, or why it did not answer (one line)."""
    from jaxdist.core.transport.client import WorkerClient  # noqa: PLC0415 - gRPC only here

    client = None
    try:
        client = WorkerClient(address, timeout=timeout, **args)
        client.wait_ready(timeout)
        return client.info()
    except JaxdistError as exc:
        why = (str(exc).splitlines() or [type(exc).__name__])[0]
        return why if address in why else f"{address}: {why}"
    finally:
        if client is not None:
            client.close()


def _print_worker(r: pb.InfoReply) -> None:
    """One worker's block of the table."""
    print(f"{r.address}  device={r.default_device}  jax={r.versions.jax} "
          f"jaxlib={r.versions.jaxlib} spec={r.versions.spec}  "
          f"uptime={fmt_duration(r.uptime_s)}")
    memory = memory_line(r)
    if memory is not None:
        print(f"  memory: {memory}")
    bound = (f" of {fmt_bytes(r.artifact_cache_max_bytes)}" if r.artifact_cache_max_bytes
             else ", no bound")
    print(f"  sessions: {r.sessions}/{r.max_sessions}; artifacts cached: {len(r.artifacts)} "
          f"({fmt_bytes(r.artifact_cache_bytes)}{bound}); data port: {r.data_port or 'off'}"
          + (f"; uploads in progress: {fmt_bytes(r.upload_bytes)}" if r.upload_bytes else "")
          + (f"; frames being received: {fmt_bytes(r.inflight_bytes)}"
             if r.inflight_bytes else "")
          + f"; streams open: {r.streams}")
    k = r.kernels
    if k.version:
        threads = k.threads or f"auto ({k.cpus} CPUs)" if k.cpus else k.threads or "auto"
        isa = f", dot products {k.isa}" if k.isa else ""
        print(f"  cpu kernels: {k.version}{isa}, threads {threads}; "
              f"types {', '.join(k.types)}")
    else:
        print(f"  cpu kernels: none ({k.unavailable_reason or 'not advertised'})")
    if r.stages:
        stages = sorted(r.stages, key=lambda x: (x.pipeline_id, x.stage_index))
        w = max(8, *(len(st.pipeline_id) for st in stages))
        m = max(5, *(len(st.model) for st in stages))
        print(f"  {'pipeline':<{w}} {'stage':>5}  {'model':<{m}}  {'artifact':<20} "
              f"{'weights':>10} {'packed':>10} {'sessions':>8}  {'route':<5}  device")
        for st in stages:
            dequantized = (f"  (dequantized: {', '.join(st.dequantized_types)})"
                           if st.dequantized_types else "")
            print(f"  {st.pipeline_id:<{w}} {st.stage_index:>5}  {st.model:<{m}}  "
                  f"{st.artifact_digest[:19]:<20} {fmt_bytes(st.weight_bytes):>10} "
                  f"{fmt_bytes(st.packed_bytes):>10} {st.sessions:>8}  "
                  f"{st.route or '?':<5}  {st.device}"
                  f"{dequantized}")
    else:
        print("  no stages loaded")
    for ld in r.loading:  # LoadStage calls under way
        step = f" {ld.buckets_done + 1}/{ld.buckets}" if ld.phase == "compile" and \
            ld.buckets else ""
        left = "; its caller left, it will be discarded" if ld.abandoned else ""
        print(f"  loading {ld.stage_id}: {ld.phase}{step} for {fmt_duration(ld.phase_seconds)}"
              f" ({fmt_duration(ld.seconds)} in all){left}")


def memory_line(reply: pb.InfoReply) -> str | None:
    """The memory of a worker's device, in words (``None`` when it is unknown).

    A device with memory of its own (``memory_source`` ``"device"``: a GPU or TPU) shows what
    this worker's process holds on it, so that the workers sharing one GPU each show their
    part; a cpu shows the host's RAM.

    Args:
        reply: the worker's ``InfoReply``.
    """
    mem = next((d for d in reply.devices if f"{d.platform}:{d.index}" == reply.default_device),
               reply.devices[0] if reply.devices else None)
    if mem is None or not mem.memory_total:
        return None
    rss = f"worker RSS {fmt_bytes(reply.rss_bytes)}"
    if mem.memory_source == "device":
        return (f"{fmt_bytes(mem.memory_used)} held on {mem.platform}:{mem.index} (weights, KV "
                f"caches, executables) of its allocator's {fmt_bytes(mem.memory_total)}; {rss}")
    return f"{fmt_bytes(mem.memory_free)} free of {fmt_bytes(mem.memory_total)}; {rss}"


def fmt_duration(seconds: float) -> str:
    """``3725`` -> ``"1h02m05s"``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
