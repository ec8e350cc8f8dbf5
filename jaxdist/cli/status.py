"""``jaxdist status``: what each worker runs, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from google.protobuf.json_format import MessageToDict

from jaxdist.cli.common import fmt_bytes
from jaxdist.errors import JaxdistError
from jaxdist.transport.client import WorkerClient

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    status = sub.add_parser("status", help="show what each worker runs")
    status.add_argument("--workers", required=True, help="comma-separated HOST:PORT")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(run=run)


def run(opts: argparse.Namespace) -> int:
    addresses = [a.strip() for a in opts.workers.split(",") if a.strip()]
    if not addresses:
        raise JaxdistError("status needs --workers HOST:PORT[,HOST:PORT...]")
    replies = []
    for a in addresses:
        c = WorkerClient(a, timeout=opts.timeout)
        try:
            c.wait_ready(opts.timeout)
            replies.append(c.info())
        finally:
            c.close()
    if opts.json:
        print(json.dumps([MessageToDict(r, preserving_proto_field_name=True) for r in replies],
                         indent=2))
        return 0
    for r in replies:
        mem = r.devices[0] if r.devices else None
        print(f"{r.address}  device={r.default_device}  jax={r.versions.jax} "
              f"jaxlib={r.versions.jaxlib} spec={r.versions.spec}  uptime={r.uptime_s:.0f}s")
        if mem is not None and mem.memory_total:
            print(f"  memory: {fmt_bytes(mem.memory_free)} free of {fmt_bytes(mem.memory_total)};"
                  f" worker RSS {fmt_bytes(r.rss_bytes)}")
        print(f"  sessions: {r.sessions}/{r.max_sessions}; artifacts cached: {len(r.artifacts)}")
        if r.stages:
            print(f"  {'stage':<28} {'digest':<20} {'weights':>10} {'sessions':>8}")
            for s in r.stages:
                print(f"  {s.stage_id:<28} {s.artifact_digest[:19]:<20} "
                      f"{fmt_bytes(s.weight_bytes):>10} {s.sessions:>8}")
    return 0


