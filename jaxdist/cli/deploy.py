"""``jaxdist deploy`` and ``jaxdist unload``: load an exported model onto running workers, and
take it off again.

``deploy`` reads a manifest (``jaxdist export`` wrote it), asks each worker whether it holds the
weight files of its stages (an error names the worker and the path before anything is shipped
or compiled), uploads each artifact only to workers that lack it, loads the stages and prints
the pipeline id. Nothing is traced. The stages stay loaded after the command exits: ``jaxdist
status`` lists them, ``jaxdist generate --manifest M --pipeline ID`` runs them, and ``jaxdist
unload --workers ... ID`` frees them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from jaxdist.cli.common import ProgressBar, add_auth_args, client_args_of, cluster_args_of
from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.registry.manifest import open_manifest

__all__ = ["add_parsers"]


def add_manifest_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--manifest", required=required, default=None, metavar="PATH|URL|NAME",
                   help="a manifest file or URL, or a manifest name/digest in --registry")
    p.add_argument("--registry", default=None, metavar="DIR|URL",
                   help="where the artifacts are (default: the registry holding the manifest)")
    p.add_argument("--model-path", default=None, metavar="PATH",
                   help="where the workers hold the model, relative to a weights root or "
                        "absolute (default: the path recorded at export)")


def add_parsers(sub: Any) -> None:
    d = sub.add_parser("deploy", help="load an exported model (a manifest) onto workers")
    add_manifest_args(d, required=True)
    d.add_argument("--workers", required=True, metavar="HOST:PORT,...",
                   help="running workers; stage k goes to worker k mod N")
    d.add_argument("--device", default="auto", help="device directive of every stage "
                   "(default %(default)s)")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    add_auth_args(d)
    d.set_defaults(run=run_deploy)

    u = sub.add_parser("unload", help="unload a deployed pipeline from workers")
    u.add_argument("pipeline_id", help="as printed by jaxdist deploy (see jaxdist status)")
    u.add_argument("--workers", required=True, metavar="HOST:PORT,...")
    u.add_argument("--timeout", type=float, default=10.0)
    add_auth_args(u)
    u.set_defaults(run=run_unload)


def _addresses(text: str) -> list[str]:
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise JaxdistError("--workers expects HOST:PORT[,HOST:PORT...]")
    return addresses


def run_deploy(opts: argparse.Namespace) -> int:
    from jaxdist.coordinator.cluster import Cluster  # noqa: PLC0415 - gRPC only for the verbs that dial
    from jaxdist.coordinator.remote import check_stages_on  # noqa: PLC0415

    manifest, digest, store = open_manifest(opts.manifest, opts.registry)
    t0 = time.perf_counter()
    cluster = Cluster.connect(_addresses(opts.workers), **cluster_args_of(opts))
    try:
        # Before any stage is shipped or compiled: does each worker hold its stages' weights?
        check_stages_on(cluster.clients, manifest.stage_specs(opts.model_path))
        with ProgressBar() as bar:
            pipe = cluster.deploy_manifest(manifest, registry=store, model_path=opts.model_path,
                                           device=opts.device, pin=True,
                                           progress=bar if not opts.json else None)
        wall = time.perf_counter() - t0
        placed = [c.address for c in pipe.clients]
    finally:
        cluster.close()  # leaves the stages loaded: that is the point of this command
    if opts.json:
        print(json.dumps({"pipeline_id": pipe.pipeline_id, "manifest": digest,
                          "model": manifest.model.name, "workers": placed,
                          "digests": manifest.digests, "deploy_s": wall}))
        return 0
    print(pipe.pipeline_id)
    print(f"deployed {manifest.model.name} ({len(placed)} stages on {', '.join(placed)}) in "
          f"{wall:.1f}s; it stays loaded.\n"
          f"  see it:   jaxdist status --workers {opts.workers}\n"
          f"  run it:   jaxdist generate --manifest {opts.manifest} --workers {opts.workers} "
          f"--pipeline {pipe.pipeline_id}\n"
          f"  unload:   jaxdist unload --workers {opts.workers} {pipe.pipeline_id}",
          file=sys.stderr)
    return 0


def run_unload(opts: argparse.Namespace) -> int:
    from jaxdist.core.transport.client import WorkerClient  # noqa: PLC0415

    args = client_args_of(opts)
    unloaded = []
    for address in _addresses(opts.workers):
        client = WorkerClient(address, timeout=opts.timeout, **args)
        try:
            client.wait_ready(opts.timeout)
            if client.unload_stage(opts.pipeline_id):
                unloaded.append(address)
        finally:
            client.close()
    if not unloaded:
        raise SpecError(f"pipeline {opts.pipeline_id!r} is not loaded on {opts.workers} "
                        f"(jaxdist status lists what is)")
    print(f"unloaded {opts.pipeline_id} from {', '.join(unloaded)}")
    return 0
