"""``jaxdist registry ls | show REF | gc``: look into an artifact registry and tidy it.

``--registry`` is a directory or any URL fsspec reads (``file://``, ``http://``, ``s3://``...).
``ls`` lists artifacts (digest, size, date, how many manifests use each) and manifests;
``show`` prints an artifact's metadata sidecar or a manifest; ``gc`` deletes the artifacts no
manifest references (``--dry-run`` only lists them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from jaxdist.cli.common import fmt_bytes
from jaxdist.core.errors import ArtifactError, JaxdistError
from jaxdist.registry.local import Registry, open_registry
from jaxdist.registry.manifest import Manifest
from jaxdist.registry.publish import unreferenced

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("registry", help="list, inspect and garbage-collect a registry")
    rsub = r.add_subparsers(dest="registry_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--registry", required=True, metavar="DIR|URL")
        p.add_argument("--json", action="store_true", help="print JSON")

    ls = rsub.add_parser("ls", help="list artifacts and manifests")
    common(ls)
    ls.set_defaults(run=run_ls)
    show = rsub.add_parser("show", help="an artifact's metadata, or a manifest")
    show.add_argument("ref", metavar="DIGEST|NAME",
                      help="artifact digest, manifest digest or name (a unique prefix will do)")
    common(show)
    show.set_defaults(run=run_show)
    gc = rsub.add_parser("gc", help="delete artifacts that no manifest references")
    common(gc)
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted")
    gc.add_argument("--min-age", type=float, default=600.0, metavar="S",
                    help="keep unreferenced artifacts younger than S seconds: an export stores "
                         "its artifacts before its manifest (default %(default)s)")
    gc.set_defaults(run=run_gc)


def _date(mtime: float) -> str:
    if not mtime:
        return "-"
    return datetime.datetime.fromtimestamp(mtime, datetime.timezone.utc).strftime(
        "%Y-%m-%d %H:%M")


def _manifests(store: Registry) -> list[tuple[Any, Manifest | None, str]]:
    out: list[tuple[Any, Manifest | None, str]] = []
    for entry in store.list_manifests():
        try:
            out.append((entry, Manifest.from_json(store.get_manifest(entry.digest),
                                                  source=entry.location), ""))
        except JaxdistError as exc:
            out.append((entry, None, str(exc)))
    return out


def run_ls(opts: argparse.Namespace) -> int:
    store = open_registry(opts.registry)
    artifacts = store.list()
    manifests = _manifests(store)
    refs: dict[str, int] = {}
    for _, m, _ in manifests:
        for d in set(m.digests if m else ()):
            refs[d] = refs.get(d, 0) + 1
    if opts.json:
        print(json.dumps({
            "registry": store.location,
            "artifacts": [{"digest": a.digest, "size": a.size, "mtime": a.mtime,
                           "manifests": refs.get(a.digest, 0)} for a in artifacts],
            "manifests": [{"name": e.name, "digest": e.digest, "size": e.size, "mtime": e.mtime,
                           "location": e.location, "stages": m.digests if m else None,
                           "created": m.created if m else None, "error": err or None}
                          for e, m, err in manifests]}, indent=1))
        return 0
    print(f"registry {store.location}")
    print(f"\nartifacts ({len(artifacts)}, {fmt_bytes(sum(a.size for a in artifacts))})")
    if artifacts:
        print(f"  {'digest':<73} {'size':>9}  {'date (UTC)':<16}  manifests")
        for a in artifacts:
            print(f"  {a.digest:<73} {fmt_bytes(a.size):>9}  {_date(a.mtime):<16}  "
                  f"{refs.get(a.digest, 0)}")
    print(f"\nmanifests ({len(manifests)})")
    if manifests:
        print(f"  {'name':<32} {'digest':<20} {'stages':>6}  {'created (UTC)':<25}  model path")
        for e, m, err in manifests:
            if m is None:
                print(f"  {e.name:<32} {e.digest[:19]:<20} {'?':>6}  unreadable: {err}")
                continue
            print(f"  {e.name:<32} {e.digest[:19]:<20} {len(m.stages):>6}  {m.created:<25}  "
                  f"{m.model.path or '-'}")
    return 0


def _resolve(store: Registry, ref: str) -> tuple[str, str]:
    """``("artifact", digest)`` or ``("manifest", digest)`` for a digest (prefix) or a name."""
    hex_ref = ref.removeprefix("sha256:")
    artifacts = [a.digest for a in store.list()
                 if len(hex_ref) >= 6 and a.digest.removeprefix("sha256:").startswith(hex_ref)]
    try:
        manifest = store.find_manifest(ref).digest
    except ArtifactError:
        manifest = None
    if len(artifacts) > 1 or (artifacts and manifest):
        raise ArtifactError(f"{ref!r} is ambiguous in registry {store.location}; give more "
                            f"digits of the digest")
    if artifacts:
        return "artifact", artifacts[0]
    if manifest:
        return "manifest", manifest
    raise ArtifactError(f"nothing named {ref!r} in registry {store.location}: no artifact "
                        f"digest and no manifest name or digest matches (jaxdist registry ls)",
                        code="NOT_FOUND")


def _tensors(group: list[dict[str, Any]], most: int = 8) -> str:
    def one(t: dict[str, Any]) -> str:
        return f"{t['name']} {t['dtype']}[{', '.join(str(d) for d in t['dims'])}]"

    if len(group) > most:
        return f"{len(group)} tensors: {one(group[0])} .. {one(group[-1])}"
    return ", ".join(one(t) for t in group) or "-"


def run_show(opts: argparse.Namespace) -> int:
    store = open_registry(opts.registry)
    kind, digest = _resolve(store, opts.ref)
    if kind == "manifest":
        data = store.get_manifest(digest)
        Manifest.from_json(data, source=digest)  # refuse to show a manifest we cannot read
        sys.stdout.write(data.decode())
        return 0
    meta = store.meta(digest)
    size = len(store.get(digest))  # also checks the bytes against the digest
    if opts.json:
        print(json.dumps({"digest": digest, "size": size, "meta": meta}, indent=1))
        return 0
    print(f"artifact {digest}  ({fmt_bytes(size)}, verified)")
    if meta is None:
        print("  no metadata sidecar (stored without ArtifactMeta)")
        return 0
    print(f"  platforms:    {', '.join(meta.get('platforms', []))}"
          f"{' (portable)' if meta.get('portable') else ''}")
    print(f"  inputs:       {_tensors(meta.get('inputs', []))}")
    print(f"  outputs:      {_tensors(meta.get('outputs', []))}")
    params = meta.get("params", [])
    print(f"  params:       {len(params)}"
          + (f" ({params[0]['name']} .. {params[-1]['name']})" if params else ""))
    print(f"  state:        {_tensors(meta.get('state', []))}")
    if meta.get("symbolic_constraints"):
        print(f"  constraints:  {', '.join(meta['symbolic_constraints'])}")
    print(f"  versions:     jax {meta.get('jax_version')}, jaxlib {meta.get('jaxlib_version')}, "
          f"StableHLO {meta.get('stablehlo_version')}, serialization "
          f"{meta.get('serialization_version')}, calling convention "
          f"{meta.get('calling_convention_version')}")
    print(f"  custom calls: {', '.join(meta.get('custom_call_targets', [])) or '-'}")
    return 0


def run_gc(opts: argparse.Namespace) -> int:
    store = open_registry(opts.registry)
    if not opts.dry_run and not store.writable:
        raise ArtifactError(f"registry {store.location} is read-only (HTTP): gc it where it is "
                            f"written (its directory), or pass --dry-run to only list")
    garbage, young = unreferenced(store, min_age=opts.min_age)
    if not opts.dry_run:
        for a in garbage:
            store.delete(a.digest)
    if opts.json:
        print(json.dumps({"deleted" if not opts.dry_run else "would_delete":
                          [a.digest for a in garbage], "kept_young": [a.digest for a in young],
                          "bytes": sum(a.size for a in garbage)}))
        return 0
    verb = "would delete" if opts.dry_run else "deleted"
    for a in garbage:
        print(f"{verb} {a.digest} ({fmt_bytes(a.size)})")
    total = fmt_bytes(sum(a.size for a in garbage))
    print(f"{verb} {len(garbage)} unreferenced artifacts ({total})"
          + (f"; kept {len(young)} younger than {opts.min_age:.0f}s (--min-age)" if young else ""))
    return 0
