"""``jaxdist status`` against real workers: the table and ``--json`` show uptime and, for every
loaded stage, its pipeline, model and artifact digest; a worker that does not answer is marked
down among the others."""

from __future__ import annotations

import json
import pathlib
import socket

from deploy_utils import cli
from models import mlp

from jaxdist.coordinator.cluster import Cluster
from jaxdist.registry.publish import publish


def test_status_table_and_json(cluster3: Cluster, tmp_path: pathlib.Path) -> None:
    pub = publish(mlp(name="status-mlp"), tmp_path, stages=2, platforms=("cpu",),
                  model_path="mlp.safetensors")
    workers = ",".join(cluster3.addresses[:2])
    with cluster3.deploy_manifest(pub.manifest, registry=pub.registry,
                                  workers=cluster3.addresses[:2]) as pipe:
        table = cli("status", "--workers", workers)
        as_json = cli("status", "--workers", workers, "--json")
    assert table.returncode == 0 and as_json.returncode == 0, table.stderr + as_json.stderr
    replies = json.loads(as_json.stdout)
    assert [r["address"] for r in replies] == cluster3.addresses[:2]
    for k, reply in enumerate(replies):
        assert reply["uptime_s"] > 0 and reply["default_device"] == "cpu:0"
        (stage,) = [s for s in reply["stages"] if s["pipeline_id"] == pipe.pipeline_id]
        assert stage["artifact_digest"] == pub.manifest.digests[k]
        assert stage["model"] == "status-mlp" and stage.get("stage_index", 0) == k
        assert stage["weight_bytes"] == 2 * 32 * 32 * 4  # a number, not proto3 JSON's string
        assert isinstance(reply["rss_bytes"], int)
        assert pub.manifest.digests[k] in reply["artifacts"]
        assert int(reply["artifact_cache_bytes"]) >= len(pub.registry.get(pub.manifest.digests[k]))
        assert int(reply["artifact_cache_max_bytes"]) == 4 << 30  # the worker's default bound
    blocks: dict[str, list[str]] = {}  # worker address -> its lines
    for line in table.stdout.splitlines():
        if not line.startswith(" "):
            current = blocks.setdefault(line.split()[0], [line])
        else:
            current.append(line)
    assert list(blocks) == cluster3.addresses[:2]
    for k, lines in enumerate(blocks.values()):
        assert "uptime=" in lines[0] and "device=cpu:0" in lines[0]
        (kern,) = [line for line in lines if "cpu kernels: " in line]
        info = replies[k]["kernels"]
        assert f"dot products {info['isa']}, threads auto ({info['cpus']} CPUs)" in kern, kern
        (cache,) = [line for line in lines if "artifacts cached: " in line]
        assert " of 4.0 GB); " in cache, cache
        (row,) = [line for line in lines if pipe.pipeline_id in line]
        assert row.split()[1] == str(k) and "status-mlp" in row
        assert pub.manifest.digests[k][:19] in row


def test_error_an_unreachable_worker_is_marked_down_among_the_others(cluster3: Cluster) -> None:
    # A port bound but not listening: connecting to it is refused, and no one else takes it.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
        live = cluster3.addresses[:2]
        workers = ",".join([live[0], dead, live[1]])
        table = cli("status", "--workers", workers, "--timeout", "2")
        as_json = cli("status", "--workers", workers, "--timeout", "2", "--json")
    heads = [line for line in table.stdout.splitlines() if not line.startswith(" ")]
    assert [h.split()[0] for h in heads] == [live[0], dead, live[1]]
    assert "device=cpu:0" in heads[0] and "device=cpu:0" in heads[2]
    why = heads[1].removeprefix(f"{dead}  down: ")
    assert why.startswith(f"worker {dead} is not reachable: "), heads[1]
    replies = json.loads(as_json.stdout)
    assert [r["address"] for r in replies] == [live[0], dead, live[1]]
    assert replies[1] == {"address": dead, "down": True, "error": why}
    assert "down" not in replies[0] and replies[2]["default_device"] == "cpu:0"
    for proc in (table, as_json):
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr.splitlines() == [
            f"jaxdist: error: 1 of 3 workers did not answer: {why}"], proc.stderr
