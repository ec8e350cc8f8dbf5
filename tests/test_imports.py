"""Imports run one way: each side imports the core and never another side, a worker loads
nothing but the core, an offline export no gRPC, the exporters not the generation loop, and
``import jaxdist`` nothing eagerly.

Each check runs in a fresh interpreter, since this test process has imported everything.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

# What each unit may import besides itself (docs/design.md has the picture). The CLI may
# import everything; the proto package is generated code that any unit may use.
SIDES: dict[str, set[str]] = {
    "jaxdist.core": set(),
    "jaxdist.export": {"jaxdist.core"},
    "jaxdist.exporters": {"jaxdist.core", "jaxdist.export"},
    "jaxdist.registry": {"jaxdist.core", "jaxdist.export"},
    "jaxdist.coordinator": {"jaxdist.core", "jaxdist.export", "jaxdist.registry",
                            "jaxdist.launch"},
    "jaxdist.launch": {"jaxdist.core"},
    "jaxdist.worker": {"jaxdist.core"},
    "jaxdist.serving": {"jaxdist.core", "jaxdist.coordinator"},
}
# Everything a worker process must not load.
NOT_IN_A_WORKER = ("jaxdist.coordinator", "jaxdist.registry", "jaxdist.export", "jaxdist.cli",
                   "jaxdist.exporters", "jaxdist.serving")

TESTS = pathlib.Path(__file__).resolve().parent


def _modules_after(code: str) -> set[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=TESTS, timeout=300)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_import_jaxdist_is_lazy() -> None:
    mods = _modules_after("import jaxdist")
    assert _loaded(mods, ("jaxdist",)) == ["jaxdist"]
    mods = _modules_after("import jaxdist\nassert jaxdist.Cluster.__name__ == 'Cluster'")
    assert "jaxdist.coordinator.cluster" in mods


def test_worker_loads_nothing_of_the_coordinator_side() -> None:
    mods = _modules_after("import jaxdist.worker.__main__, jaxdist.worker.server")
    assert _loaded(mods, NOT_IN_A_WORKER) == []
    assert "jaxdist.core.store" in mods  # its artifact cache is the core's store


def test_exporters_do_not_import_the_generation_loop_or_grpc() -> None:
    mods = _modules_after("import jaxdist.exporters.llama, jaxdist.exporters.gpt2, "
                          "jaxdist.exporters.bert")
    assert _loaded(mods, ("jaxdist.coordinator", "jaxdist.registry", "grpc")) == []


def test_offline_export_into_a_registry_imports_no_grpc(tmp_path: pathlib.Path) -> None:
    """publish() traces and stores a model with no worker anywhere: no gRPC is loaded."""
    code = f"""
import numpy as np
from safetensors.numpy import save_file
from models import mlp
from jaxdist.registry.publish import publish
root = {str(tmp_path)!r}
rng = np.random.default_rng(0)
save_file({{f"l{{i}}.w": rng.standard_normal((32, 32)).astype(np.float32) for i in range(4)}},
          root + "/mlp.safetensors")
pub = publish(mlp(), root + "/registry", stages=2, platforms=("cpu",),
              model_path="mlp.safetensors")
assert len(pub.manifest.stages) == 2
"""
    mods = _modules_after(code)
    assert _loaded(mods, ("grpc", "jaxdist.coordinator.cluster", "jaxdist.coordinator.pipeline",
                          "jaxdist.core.transport", "jaxdist.coordinator.spawn")) == []
    assert (tmp_path / "registry").is_dir()


KNOWN_CIRCLES: list[set[str]] = []  # none; a circle found here is a design error to fix

ROOT = TESTS.parent
PACKAGES = {"jaxdist": ROOT / "jaxdist", "jaxdist.worker": ROOT / "worker",
            "jaxdist.exporters": ROOT / "exporters"}


def _project_modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if "proto" in parts:  # generated code
                continue
            mods[".".join([pkg, *parts])] = path
    return mods


def _imports(path: pathlib.Path, module: str, known: set[str]) -> set[str]:
    """Project modules ``path`` imports anywhere in the file (function bodies and
    TYPE_CHECKING blocks included): a lazy import is still a dependency."""
    import ast

    out = set()
    is_pkg = path.name == "__init__.py"
    base = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = node.module or ""
            if node.level:
                up = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                src = ".".join([*up, src] if src else up)
            names = [src] + [f"{src}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                out.add(n)
    return out


def _unit_of(module: str) -> str | None:
    return next((u for u in SIDES if module == u or module.startswith(u + ".")), None)


def test_sides_import_only_the_core_and_what_they_build_on() -> None:
    """Every import statement, lazy and type-only ones included, stays inside the rules of
    ``SIDES``: no side reaches into another, and the core into none."""
    mods = _project_modules()
    known = set(mods)
    wrong = []
    for module, path in mods.items():
        unit = _unit_of(module)
        if unit is None:  # the facade, the CLI, the generated proto
            continue
        for dep in sorted(_imports(path, module, known)):
            dep_unit = _unit_of(dep)
            if dep_unit not in (None, unit, *SIDES[unit]) or dep.startswith("jaxdist.cli"):
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "imports across sides:\n" + "\n".join(wrong)
    assert {_unit_of(m) for m in mods} >= set(SIDES)  # the walk saw every unit


def test_no_import_circles() -> None:
    """The import graph of jaxdist, worker and exporters has no cycle.
    The ``jaxdist`` facade is left out: it imports nothing at run time (names resolve lazily)."""
    mods = _project_modules()
    known = set(mods)
    graph = {m: _imports(p, m, known) - {"jaxdist"} for m, p in mods.items() if m != "jaxdist"}
    # Tarjan's strongly connected components.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    unknown = [sorted(c) for c in circles if c not in KNOWN_CIRCLES]
    assert not unknown, f"import circles: {unknown}"
    assert len(graph) > 50  # the walk saw the project


def test_cli_export_imports_no_grpc(tmp_path: pathlib.Path) -> None:
    """``jaxdist export`` of a (small, quantized) GGUF into a registry: the whole CLI is loaded,
    and still no gRPC, no worker spawner, no coordinator."""
    code = f"""
import ggml_blocks
from jaxdist.cli import main
ggml_blocks.write_llama_gguf({str(tmp_path / "m.gguf")!r}, types={{"attn": "Q4_K", "ffn": "Q8_0"}})
rc = main(["export", "--model", {str(tmp_path / "m.gguf")!r}, "--registry",
           {str(tmp_path / "registry")!r}, "--platforms", "cpu", "--max-seq", "32",
           "--slots", "2", "--buckets", "8"])
assert rc == 0, rc
"""
    mods = _modules_after(code)
    assert _loaded(mods, ("grpc", "jaxdist.coordinator.cluster", "jaxdist.coordinator.pipeline",
                          "jaxdist.core.transport", "jaxdist.coordinator.spawn")) == []
    assert list((tmp_path / "registry" / "manifests").glob("*.json"))
