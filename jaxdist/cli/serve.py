"""``jaxdist serve``: an OpenAI-compatible HTTP server over a model deployed on workers.

The HTTP server comes up first and answers ``/health`` with 503 while the model is deployed
(the workers compile for tens of seconds); it prints ``jaxdist: ready`` on stderr and answers
200 once the model serves. If the deploy fails (a worker that does not answer, say), it prints
the error and exits 1. SIGINT or SIGTERM stops it: requests in flight end, the stages are
unloaded and local workers stopped. During the deploy it stops at once, an export or a compile
included (:meth:`~jaxdist.coordinator.cluster.Cluster.interrupt`), and exits 130 naming what it
stopped (``jaxdist: interrupted while exporting stage 0``).

The HTTP server raises its open-file limit and bounds connections, their time and request
bodies (``--max-body-bytes``; :mod:`jaxdist.serving.server`), on strict HTTP/1.1 (h11).

Needs the ``serve`` extra (``pip install 'jaxdist[serve]'``: FastAPI, uvicorn,
prometheus-client); workers do not.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist.cli.common import (
    ProgressBar,
    add_cluster_args,
    check_cluster_args,
    open_cluster,
    parse_size,
)
from jaxdist.cli.generate import (
    Plan,
    add_model_args,
    deploy_traced,
    encoder_inputs,
    load_for,
    manifest_plan,
)
from jaxdist.core.errors import JaxdistError, SpecError

__all__ = ["add_parser"]

log = logging.getLogger(__name__)

API_KEY_ENV = "JAXDIST_API_KEY"


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a model over the OpenAI HTTP API (completions, "
                                     "chat, embeddings) with Prometheus metrics")
    add_cluster_args(s)
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "%(default)s; 0.0.0.0 listens on every interface)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default %(default)s; 0 "
                   "picks a free one, printed when listening)")
    s.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 (repeatable; also "
                        f"${API_KEY_ENV}, comma-separated); /health and /metrics stay open")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the model's file name)")
    s.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="requests that may wait for a KV slot; more get 503 with Retry-After "
                        "(default %(default)s)")
    s.add_argument("--max-body-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="the largest request body; a larger one gets 413, a declared one "
                        "before it is read (default: what the longest prompt --max-seq allows "
                        "needs as JSON, 1 MiB + 96 bytes per position; SIZE is bytes, or 512K, "
                        "16M, 1GiB ...)")
    s.add_argument("--keep-session", type=float, default=60.0, metavar="SECONDS",
                   help="how long the workers keep the KV memory of an idle server for the "
                        "next request, which then does not wait for it to be allocated "
                        "(default %(default)s; 0 frees it with the last request)")
    s.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="let special-token text in chat messages (e.g. '<|im_end|>') become "
                        "the model's control tokens, so a client can close its turn or open a "
                        "system turn; by default it is tokenized as plain text, and only the "
                        "chat template writes control tokens. Only for trusted clients")
    s.set_defaults(run=run_serve)


def _api_keys(opts: argparse.Namespace) -> list[str]:
    keys = list(opts.api_key)
    keys += [k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()]
    for k in keys:
        if not k or any(c.isspace() for c in k):
            raise SpecError("--api-key: a key must be non-empty and hold no whitespace")
    return keys


def _need_serve_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecError(f"jaxdist serve needs {', '.join(missing)}: pip install "
                        f"'jaxdist[serve]'")


class _Loader(threading.Thread):
    """Deploys the model while the HTTP server already answers, then holds the cluster open
    until the server stops."""

    def __init__(self, opts: argparse.Namespace, plan: Plan | None, loaded: Any,
                 roots: list[str], state: Any) -> None:
        super().__init__(name="jaxdist-serve-loader", daemon=True)
        self.opts, self.plan, self.loaded, self.roots, self.state = opts, plan, loaded, roots, state
        self.stop = threading.Event()
        self.failed = threading.Event()  # the model could not be deployed: the server stops
        self.error: BaseException | None = None
        self.cluster: Any = None  # once open

    def interrupt(self) -> None:
        """The server stops: a deploy under way is cancelled (Cluster.interrupt), compiles
        included; a deployed model is closed and unloaded."""
        self.stop.set()
        if self.cluster is not None:
            self.cluster.interrupt()

    def run(self) -> None:
        from jaxdist.coordinator.engine import Engine  # noqa: PLC0415
        from jaxdist.serving.app import Served  # noqa: PLC0415
        from jaxdist.serving.metrics import PipelineCollector  # noqa: PLC0415

        try:
            with open_cluster(self.opts, self.roots) as cluster, ProgressBar() as progress:
                self.cluster = cluster
                if self.stop.is_set():  # stopped while the workers started
                    cluster.interrupt()
                if self.plan is not None:
                    pipe = self.plan.deploy(cluster, progress)
                    engine = Engine.for_model(pipe, self.plan.lm, tokenizer=self.plan.tokenizer,
                                              max_queue=self.opts.max_queue,
                                              observer=self.state.metrics,
                                              keep_session_s=self.opts.keep_session,
                                              vocab_size=self.plan.vocab)
                    self.state.metrics.watch_engine(engine)
                    served = Served(self.state.name, "causal-lm", self.plan.tokenizer,
                                    engine=engine, max_seq=self.plan.lm.max_seq,
                                    broken=lambda: pipe.broken,
                                    special_tokens_in_content=(
                                        self.opts.allow_special_tokens_in_content))
                else:
                    pipe = deploy_traced(self.opts, self.loaded.model)(cluster, progress)
                    engine = None
                    served = Served(self.state.name, "encoder", self.loaded.tokenizer,
                                    embed=_embedder(pipe, self.loaded), broken=lambda: pipe.broken)
                def info(address: str) -> Any:  # the clients change when a spare steps in
                    live = [c for c in cluster.clients + cluster.spare_clients
                            if c.address == address]
                    return live[0].info(timeout=1.0) if live else None

                self.state.metrics.registry.register(PipelineCollector(
                    self.state.name, lambda: pipe, info,
                    recomputed=lambda: engine.recomputed if engine is not None else 0,
                    round_trips=self.state.metrics.round_trips))
                progress.close()
                self.state.serve(served)
                print(f"jaxdist: ready: {self.state.name} on {len(pipe.clients)} workers",
                      file=sys.stderr, flush=True)
                self.stop.wait()
                if engine is not None:
                    engine.close()
                pipe.close(unload=self.plan.unload if self.plan is not None else True)
        except KeyboardInterrupt as exc:  # interrupted deploy: run_serve raises it again
            self.error = exc
        except BaseException as exc:  # noqa: BLE001 - shown by /health and on stderr
            self.error = exc
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.state.fail(first)
            self.failed.set()
            print(f"jaxdist: error: {first}", file=sys.stderr, flush=True)


def _embedder(pipe: Any, loaded: Any) -> Any:
    buckets = tuple(loaded.options.get("buckets", ()))

    def embed(rows: Sequence[Sequence[int]]) -> np.ndarray:
        ids, mask = encoder_inputs(rows, buckets)
        return np.asarray(pipe.call(input_ids=ids, attention_mask=mask)["embedding"], np.float32)

    return embed


def run_serve(opts: argparse.Namespace) -> int:
    _need_serve_extra()
    import uvicorn  # noqa: PLC0415

    from jaxdist.core.openfiles import raise_fd_limit  # noqa: PLC0415
    from jaxdist.serving.app import ServerState, create_app  # noqa: PLC0415
    from jaxdist.serving.server import (  # noqa: PLC0415
        HTTPLimits,
        default_max_body_bytes,
        server_config,
        server_connection_limit,
    )

    keys = _api_keys(opts)
    if opts.port < 0 or opts.port > 65535:
        raise SpecError(f"--port: expected 0..65535, found {opts.port}")
    if not opts.keep_session >= 0:  # also refuses nan
        raise SpecError(f"--keep-session: expected seconds >= 0, found {opts.keep_session}")
    if opts.max_body_bytes is not None and opts.max_body_bytes < 1:
        raise SpecError(f"--max-body-bytes: expected a size >= 1, found {opts.max_body_bytes}")
    check_cluster_args(opts)  # before the model is read and the HTTP server starts
    plan: Plan | None = None
    loaded: Any = None
    if opts.manifest:
        plan = manifest_plan(opts)
        name, roots = plan.name, plan.roots
    else:
        name, roots, loaded = load_for(opts)
        if loaded.causal_lm is not None:
            plan = Plan(name, roots, loaded.tokenizer, loaded.causal_lm,
                        deploy_traced(opts, loaded.model),
                        vocab=getattr(loaded.model.meta.get("config"), "vocab", None))
        elif loaded.kind != "encoder":
            raise SpecError(f"model {name} is a {loaded.kind}; jaxdist serve runs causal LMs "
                            f"and encoders")
    state = ServerState(opts.served_model_name or name, api_keys=keys)
    loader = _Loader(opts, plan, loaded, roots, state)
    raise_fd_limit()  # before the connection cap is sized from it
    max_seq = plan.lm.max_seq if plan is not None else opts.max_seq
    limits = HTTPLimits(max_body_bytes=opts.max_body_bytes or default_max_body_bytes(max_seq),
                        max_connections=server_connection_limit())
    log.info("HTTP limits: %s", limits)
    config = server_config(create_app(state), host=opts.host, port=opts.port, limits=limits)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: say where, then deploy the model behind it
                port = self.servers[0].sockets[0].getsockname()[1]
                print(f"jaxdist: listening on http://{opts.host}:{port}/v1 (model "
                      f"{state.name}; /health is 503 until it is deployed)", file=sys.stderr,
                      flush=True)
                loader.start()

    # uvicorn shuts down on SIGINT/SIGTERM, then raises the signal again for the handler that
    # was there before it: a no-op here, so the workers are stopped below and the exit is 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = Server(config)

    def stop_on_failure() -> None:  # a server that can never serve exits (status 1)
        if loader.failed.wait() and not loader.stop.is_set():
            server.should_exit = True

    threading.Thread(target=stop_on_failure, daemon=True).start()
    server.run()  # until SIGINT or SIGTERM, or a failed deploy
    if state.ready.is_set():  # a deploy cut short says what it stopped instead
        print("jaxdist: stopping: unloading the model", file=sys.stderr, flush=True)
    loader.interrupt()
    if loader.is_alive():
        loader.join(timeout=120)
    if loader.error is not None and not isinstance(loader.error, JaxdistError):
        raise loader.error
    return 1 if loader.error is not None else 0
