"""Workers as Ray actors (jaxdist.launch.ray, Cluster.ray, --ray) on a real local Ray instance.

``ray.init(num_cpus=2)`` in this process: real actors in a real placement group, each running a
real worker process. SmolLM2 on two actor workers (through ``jaxdist generate --ray``, which
joins this instance by its address) gives the tokens of ``--local 2``; a killed actor fails over
to a spare with the tokens of the run with no fault, which are those of a single-process run.
There is no multi-node Ray cluster here, so ``STRICT_SPREAD`` is seen failing to place, never
placing, and GPU bundles only as refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import warnings

import ggml_blocks
import psutil
import pytest
import ray
from ray.util.placement_group import placement_group_table

from jaxdist.cli.common import add_cluster_args, open_cluster
from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.generation import Generator, SamplingParams
from jaxdist.coordinator.inprocess import InProcessPipeline
from jaxdist.core.errors import DeviceError, JaxdistError, TransportError
from jaxdist.exporters.llama import llama_model
from jaxdist.launch.ray import bundle_device

PROMPTS = [[5, 17, 99, 3], [9, 250, 1, 33, 33, 128, 64, 77, 12, 4, 180, 7], [42], [100, 101, 102]]
LENGTHS = [20, 16, 24, 12]
MAX_SLOTS, MAX_SEQ = 4, 64
RAY_STARTS = 5  # attempts at starting the local Ray instance (see ray_instance)
RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")
HALF_CPU = {"CPU": 0.5}  # three workers (two and a spare) fit in the 2 CPUs of this instance


@pytest.fixture(scope="module")
def ray_instance():
    """A local Ray instance of 2 CPUs, no dashboard, a small object store, actors' output kept
    in Ray's log files."""
    # Ray waits 30 s for its GCS server to publish its port, and 30 s for the raylet to
    # register (ray/_private/node.py); with both cores busy either can run out. The first wait
    # has a setting; the second has none, so a start that times out is tried again.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
    for attempt in range(1, RAY_STARTS + 1):
        try:
            ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 << 20,
                     log_to_driver=False, logging_level=logging.WARNING)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for the raylet
            ray.shutdown()
            timed_out = any(text in str(exc) for text in RAY_START_TIMEOUTS)
            if not timed_out or attempt == RAY_STARTS:
                raise
            warnings.warn(f"ray.init, attempt {attempt} of {RAY_STARTS}: {exc}", stacklevel=1)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A small random Llama GGUF (float32 matrices, 4 layers) in a weights root."""
    root = tmp_path_factory.mktemp("ray_gguf")
    ggml_blocks.write_llama_gguf(root / "tiny.gguf", types={}, layers=4, seed=3)
    return root


def _model(root: pathlib.Path):
    model = llama_model("tiny.gguf", roots=[root], max_slots=MAX_SLOTS, max_seq=MAX_SEQ,
                        prefill_buckets=(8,))
    return dataclasses.replace(model, buckets=())


def _generator(pipe: object, model: object) -> Generator:
    return Generator(pipe, input_dtypes={k: v[1] for k, v in model.inputs.items()},
                     max_slots=MAX_SLOTS, max_seq=MAX_SEQ, prefill_buckets=(8,))


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in LENGTHS]


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (waits for it; a zombie has ended)."""
    try:
        proc = psutil.Process(pid)
        proc.wait(timeout=60)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    return True


def _jaxdist(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jaxdist.cli", *args], capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.slow
def test_generate_on_ray_actors_matches_local_workers(ray_instance):
    """SmolLM2 across 2 actor workers: token for token what --local 2 generates."""
    args = ("--max-tokens", "16", "--max-seq", "128", "--slots", "1", "--buckets", "16",
            "--prompt", "The capital of France is", "--json")
    local = _jaxdist("generate", "--local", "2", *args)
    assert local.returncode == 0, local.stderr
    on_ray = _jaxdist("generate", "--ray", ray_instance, "--ray-workers", "2", *args)
    assert on_ray.returncode == 0, on_ray.stderr
    want, got = json.loads(local.stdout), json.loads(on_ray.stdout)
    assert got["prompt_ids"] == want["prompt_ids"]
    assert got["tokens"] == want["tokens"] and len(got["tokens"]) == 16
    assert got["text"] == want["text"] and got["text"].startswith(" Paris")
    assert got["stages"] == 2 and len(set(got["workers"])) == 2
    assert "starting 2 workers on Ray" in on_ray.stderr
    # The CLI's actors and group went with it: every group of this instance is removed.
    assert {g["state"] for g in placement_group_table().values()} <= {"REMOVED"}


@pytest.mark.slow  # failover itself is in the fast tier (test_failover.py); this is on Ray
def test_killed_actor_fails_over_to_a_spare_with_identical_tokens(ray_instance, tiny_gguf):
    """ray.kill on the actor holding the last stage, mid-decode: its worker dies with it, the
    stage moves to the spare actor, and every sequence comes out as in the run with no fault
    (tests/test_failover.py kills each stage's worker process). The workers listen on the
    node's IP (loopback=False), as on a cluster of several nodes."""
    model = _model(tiny_gguf)
    with InProcessPipeline(model, weights_roots=[str(tiny_gguf)], stages=2) as pipe:
        reference = [r.tokens for r in _generator(pipe, model).run(PROMPTS, _params())]
    node_ip = ray.nodes()[0]["NodeManagerAddress"]
    with Cluster.ray(2, resources=HALF_CPU, spares=1, loopback=False,
                     weights_roots=[str(tiny_gguf)]) as cluster:
        workers = cluster.ray_workers
        assert [w.address for w in workers] == cluster.addresses + cluster.spares
        assert all(w.address.rpartition(":")[0] == node_ip == w.node_ip for w in workers)
        assert [w.device for w in workers] == ["cpu:0"] * 3
        pipe = cluster.deploy(model, stages=2)
        gen = _generator(pipe, model)
        clean = [r.tokens for r in gen.run(PROMPTS, _params())]
        assert clean == reference

        target = workers[1]
        produced: list[tuple[int, int]] = []
        lock = threading.Lock()

        def on_token(i: int, token: int) -> None:
            with lock:
                produced.append((i, token))
                if len(produced) == 25:  # mid-decode, several sequences active
                    ray.kill(target.actor)

        faulted = gen.run(PROMPTS, _params(), on_token=on_token)
        assert _gone(target.pid), "the killed actor's worker process is still running"
        assert [r.tokens for r in faulted] == clean
        assert [(f.failed, f.spare) for f in pipe.failovers] == [(target.address,
                                                                  workers[2].address)]
        for i, r in enumerate(faulted):  # each token streamed once, in order, despite the replay
            assert [t for j, t in produced if j == i] == r.tokens
        assert [r.tokens for r in gen.run(PROMPTS[:2], _params()[:2])] == clean[:2]


def test_close_leaves_no_actor_group_or_worker(ray_instance):
    with Cluster.ray(2, resources=HALF_CPU, spares=1) as cluster:
        workers = cluster.ray_workers
        group = cluster._ray.placement_group.id.hex()
        assert placement_group_table()[group]["state"] == "CREATED"
        # On one node the workers listen on loopback.
        assert all(w.address.startswith("127.0.0.1:") for w in workers)
        assert [ray.get(w.actor.worker_pid.remote()) for w in workers] == [w.pid for w in workers]
    assert placement_group_table()[group]["state"] == "REMOVED"
    for w in workers:
        assert _gone(w.pid)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(w.actor.worker_pid.remote(), timeout=60)


def test_a_worker_that_dies_takes_its_actor_with_it(ray_instance):
    with Cluster.ray(1, resources=HALF_CPU) as cluster:
        (worker,) = cluster.ray_workers
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.actor.wait_stopped.remote(120), timeout=180)


def test_error_placement_names_the_resources_asked_and_found(ray_instance):
    before = set(placement_group_table())
    with pytest.raises(TransportError) as err:
        Cluster.ray(1, resources={"GPU": 1}, placement_timeout=1)
    text = str(err.value)
    assert "1 worker bundle of {'GPU': 1} (strategy PACK)" in text
    assert "INFEASIBLE" in text and "1 node with CPU 2" in text and "--ray-resources" in text
    with pytest.raises(TransportError, match="STRICT_SPREAD puts each bundle on a node of its "
                                             "own, so it needs 2 nodes"):
        Cluster.ray(2, resources=HALF_CPU, strategy="STRICT_SPREAD", placement_timeout=1)
    new = {g: placement_group_table()[g]["state"] for g in set(placement_group_table()) - before}
    assert len(new) == 2 and set(new.values()) == {"REMOVED"}


def test_error_bad_bundle_and_strategy():
    with pytest.raises(TransportError, match=r"resources \{'GPU': 0\}: expected a bundle of "
                                             r"positive amounts"):
        Cluster.ray(1, resources={"GPU": 0})
    with pytest.raises(TransportError, match="strategy 'SPREADED': expected one of PACK, "
                                             "STRICT_SPREAD"):
        Cluster.ray(1, strategy="SPREADED")


def test_device_follows_the_bundle_and_ray_numbers_its_accelerators_from_zero():
    assert bundle_device({"GPU": 1}, None) == "cuda"
    assert bundle_device({"TPU": 4}, None) == "tpu"
    assert bundle_device({"CPU": 4}, None) == "cpu"
    assert bundle_device({"GPU": 2, "CPU": 8}, "cuda:1") == "cuda:1"
    assert bundle_device({"GPU": 1}, "rocm") == "rocm"
    with pytest.raises(DeviceError, match=r"device 'cuda:1': each Ray worker holds the bundle "
                                          r"\{'GPU': 1\}, so it sees 1 GPU device .*"
                                          r"CUDA_VISIBLE_DEVICES.*expected cuda or cuda:0$"):
        bundle_device({"GPU": 1}, "cuda:1")
    with pytest.raises(DeviceError, match="sees 0 GPU devices .* ask for GPU in resources"):
        bundle_device({"CPU": 2}, "cuda")


def _opts(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("argv, text", [
    (("--ray", "--local", "2"), "give either --ray or --local, not both"),
    (("--ray", "auto", "--workers", "h:50051"), "give either --ray or --workers, not both"),
    (("--ray-workers", "2"), "--ray-workers 2: it is the number of workers to start on Ray"),
    (("--ray", "--ray-workers", "0"), "--ray-workers 0: expected a number of workers >= 1"),
    (("--ray", "--ray-resources", "GPU"), "--ray-resources: 'GPU' is not NAME=AMOUNT"),
    (("--ray", "--spares", "h:1"), "--spares 'h:1': with --ray, give a number of spare"),
])
def test_error_ray_flags(argv, text):
    with pytest.raises(JaxdistError) as err, open_cluster(_opts(*argv), []):
        pass
    assert text in str(err.value)


def test_ray_flags_parse():
    opts = _opts("--ray", "--ray-workers", "3", "--ray-resources", "GPU=1,CPU=4")
    assert (opts.ray, opts.ray_workers, opts.ray_resources) == ("", 3, "GPU=1,CPU=4")
    assert _opts("--ray", "10.0.0.1:6379").ray == "10.0.0.1:6379" and _opts().ray is None


def test_error_without_ray_installed_says_what_to_install():
    """``ray`` made unimportable in a fresh interpreter: one line, naming the extra."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from jaxdist.cli import main\n"
            "sys.exit(main(['generate', '--ray', '--prompt-ids', '1', '--max-tokens', '1', "
            "'--max-seq', '32', '--slots', '1', '--buckets', '8']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxdist: error: Ray is not installed"), proc.stderr
    assert last.endswith("pip install 'jaxdist[ray]'") and "Traceback" not in proc.stderr


def test_ray_is_imported_only_to_start_workers_on_it():
    """Neither the library, the CLI, the cluster nor a worker loads Ray; jaxdist.launch.ray
    imports it when it starts workers."""
    code = ("import json, sys\n"
            "import jaxdist, jaxdist.cli, jaxdist.coordinator.cluster, jaxdist.launch.ray\n"
            "import jaxdist.worker.__main__, jaxdist.worker.server\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'ray')))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=True)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_worker_dies_with_its_actor_process_without_ray_cleaning_up(tmp_path):
    """PR_SET_PDEATHSIG alone ties the worker to its actor: a WorkerActor in a plain process
    (no Ray, so nothing of Ray's clean-up runs) starts a worker; SIGKILL that process, and the
    kernel kills the worker."""
    code = ("import sys\n"
            "from jaxdist.launch.process import worker_args\n"
            "from jaxdist.launch.ray import WorkerActor\n"
            "reply = WorkerActor().start(worker_args('127.0.0.1:0', artifact_cache=sys.argv[1]),"
            " {}, 120)\n"
            "print(reply.get('pid', reply), flush=True)\n"
            "sys.stdin.read()\n")  # holds the actor (and so the worker) until it is killed
    host = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = host.stdout.readline().strip()
        assert line.isdigit(), line
        worker = psutil.Process(int(line))
        assert worker.ppid() == host.pid and "jaxdist.worker" in worker.cmdline()
    finally:
        host.kill()
        host.wait()
    assert _gone(worker.pid), "the worker outlived its actor's process"
