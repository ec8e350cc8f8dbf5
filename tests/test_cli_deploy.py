"""``jaxdist export`` / ``deploy`` / ``generate --manifest`` / ``unload`` as a user runs them,
against real workers that hold the model at another path than the exporter. ``deploy`` runs as a
subprocess (its stages must outlive it); the other commands run in-process through
``jaxdist.cli.main``, which is what the console script calls."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
from deploy_utils import assert_one_line_error, cli, jaxdist, serve_directory, write_tiny_llama

from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.export.plugins import load_model

PROMPT = [3, 14, 15, 9, 2, 6]
OPTIONS = {"max_seq": 32, "max_slots": 1, "prefill_buckets": (8,)}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cluster3: Cluster, mlp_root: pathlib.Path
        ) -> dict[str, Any]:
    """A tiny Llama exported from ``here/tiny`` into a registry; two of the shared workers, which
    hold it as ``models/tiny-copy`` under their root; the tokens of the single-process run."""
    tmp = tmp_path_factory.mktemp("cli_deploy")
    write_tiny_llama(tmp / "here" / "tiny")
    (mlp_root / "models").mkdir(exist_ok=True)
    shutil.copytree(tmp / "here" / "tiny", mlp_root / "models" / "tiny-copy", dirs_exist_ok=True)
    proc = cli("export", "--model", str(tmp / "here" / "tiny"), "--registry",
                   str(tmp / "reg"), "--stages", "2", "--platforms", "cpu", "--max-seq", "32",
                   "--slots", "1", "--buckets", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    exported = json.loads(proc.stdout)
    loaded = load_model("tiny", roots=[str(tmp / "here")], **OPTIONS)
    with InProcessPipeline(loaded.model, weights_roots=[str(tmp / "here")]) as pipe:
        gen = Generator(pipe, input_dtypes={k: v[1] for k, v in loaded.model.inputs.items()},
                        max_slots=1, max_seq=32, prefill_buckets=(8,), eos_ids=())
        (ref,) = gen.run([PROMPT], SamplingParams(max_tokens=8))
    return {"tmp": tmp, "exported": exported, "want": ref.tokens,
            "workers": ",".join(cluster3.addresses[:2])}


def test_export(env: dict[str, Any]) -> None:
    out = env["exported"]
    manifest = pathlib.Path(out["manifest"])
    assert manifest.parent == env["tmp"] / "reg" / "manifests"
    assert manifest.name == f"tiny-{out['digest'][7:]}.json"
    doc = json.loads(manifest.read_text())
    assert doc["model"]["kind"] == "causal-lm" and doc["model"]["path"] == "tiny"
    assert doc["model"]["exported_from"] == str(env["tmp"] / "here" / "tiny")
    assert doc["model"]["options"]["prefill_buckets"] == [8]
    assert [s["digest"] for s in out["stages"]] == [s["artifact_digest"] for s in doc["stages"]]
    assert all(u.startswith("safetensors://{model}#") for u in doc["weights"])


def test_deploy_status_generate_unload(env: dict[str, Any]) -> None:
    workers, manifest = env["workers"], env["exported"]["manifest"]
    proc = jaxdist("deploy", "--manifest", manifest, "--workers", workers, "--model-path",
                   "models/tiny-copy")
    assert proc.returncode == 0, proc.stderr
    pipeline_id = proc.stdout.strip()
    assert pipeline_id.startswith("tiny-")
    assert f"jaxdist unload --workers {workers} {pipeline_id}" in proc.stderr
    # The deploy command has exited; its stages are still loaded.
    status = cli("status", "--workers", workers, "--json")
    assert status.returncode == 0, status.stderr
    loaded = [(s["pipeline_id"], s["artifact_digest"]) for w in json.loads(status.stdout)
              for s in w.get("stages", [])]
    digests = [s["digest"] for s in env["exported"]["stages"]]
    assert [d for p, d in loaded if p == pipeline_id] == digests
    table = cli("status", "--workers", workers).stdout
    assert pipeline_id in table and digests[1][:19] in table
    # Run the loaded stages: no tokenizer anywhere, so prompt ids.
    gen = cli("generate", "--manifest", manifest, "--workers", workers, "--pipeline",
                  pipeline_id, "--model-path", "models/tiny-copy", "--prompt-ids",
                  ",".join(map(str, PROMPT)), "--max-tokens", "8", "--json")
    assert gen.returncode == 0, gen.stderr
    assert json.loads(gen.stdout)["tokens"] == env["want"]
    unload = cli("unload", "--workers", workers, pipeline_id)
    assert unload.returncode == 0, unload.stderr
    after = json.loads(cli("status", "--workers", workers, "--json").stdout)
    assert not [s for w in after for s in w.get("stages", []) if s["pipeline_id"] == pipeline_id]
    assert_one_line_error(cli("unload", "--workers", workers, pipeline_id),
                          f"pipeline '{pipeline_id}' is not loaded on")


def test_generate_manifest_from_http_registry(env: dict[str, Any]) -> None:
    reg = env["tmp"] / "reg"
    name = pathlib.Path(env["exported"]["manifest"]).name
    with serve_directory(reg.parent) as base:
        proc = cli("generate", "--manifest", "tiny", "--registry", f"{base}/reg",
                       "--workers", env["workers"], "--model-path", "models/tiny-copy",
                       "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8",
                       "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["tokens"] == env["want"] and out["text"] is None
    assert name.startswith("tiny-")


def test_generate_manifest_local_workers(env: dict[str, Any]) -> None:
    # --local: the model is found where it was exported from; workers are spawned on its dir.
    proc = cli("generate", "--manifest", env["exported"]["manifest"], "--local", "1",
                   "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == env["want"]


def test_error_deploy_missing_manifest(env: dict[str, Any]) -> None:
    assert_one_line_error(cli("deploy", "--manifest", str(env["tmp"] / "nope.json"),
                                  "--workers", env["workers"]), "no such file")


def test_error_deploy_wrong_model_path(env: dict[str, Any]) -> None:
    """The workers do not hold the model at the exported path "tiny": deploy asks them first,
    so the error names the first worker and the path before any stage is shipped or
    compiled (the progress would show a stage "starting...")."""
    proc = jaxdist("deploy", "--manifest", env["exported"]["manifest"], "--workers",
                   env["workers"])  # a subprocess: its progress lines are in its stderr
    assert_one_line_error(proc, f"worker {env['workers'].split(',')[0]}: ")
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # no progress at all
    assert "DescribeWeights" in proc.stderr and "LoadStage" not in proc.stderr
    assert "The workers read the model at 'tiny' (relative to their --weights-root)" \
        in proc.stderr


def test_error_generate_manifest_local_without_model(env: dict[str, Any],
                                                     tmp_path: pathlib.Path) -> None:
    doc = json.loads(pathlib.Path(env["exported"]["manifest"]).read_text())
    doc["model"]["exported_from"] = "/nonexistent/tiny"
    moved = tmp_path / "m.json"
    moved.write_text(json.dumps(doc))
    proc = cli("generate", "--manifest", str(moved), "--registry", str(env["tmp"] / "reg"),
                   "--local", "1", "--prompt-ids", "1")
    assert_one_line_error(proc, "--local workers read the model from this machine")


def test_error_export_to_http_registry(env: dict[str, Any]) -> None:
    with serve_directory(env["tmp"]) as base:
        proc = cli("export", "--model", str(env["tmp"] / "here" / "tiny"), "--registry",
                   f"{base}/reg", "--platforms", "cpu")
    assert_one_line_error(proc, "is read-only")
