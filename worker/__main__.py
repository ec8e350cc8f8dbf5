"""``jaxdist-worker`` / ``python -m jaxdist.worker``: the generic worker process.

Prints ``jaxdist-worker listening on HOST:PORT device=PLATFORM:INDEX`` on stdout once it is ready.
SIGTERM (or SIGINT) drains in-flight frames, then exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from jaxdist import config as jd_config
from jaxdist.errors import JaxdistError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jaxdist-worker", description="The generic jaxdist worker: "
                                "runs any stage a coordinator ships to it.")
    p.add_argument("--listen", default="127.0.0.1:50051",
                   help="HOST:PORT to serve on; port 0 picks a free port (default %(default)s)")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda[:N] | rocm[:N] | tpu[:N] | metal (default %(default)s)")
    p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                   help="directory weight URIs may resolve under (repeatable)")
    p.add_argument("--artifact-cache", default=str(jd_config.default_artifact_cache()),
                   metavar="DIR", help="on-disk artifact cache (default %(default)s)")
    p.add_argument("--compilation-cache", default=None, metavar="DIR",
                   help="persistent XLA compilation cache ('off' to disable; default "
                        "$JAXDIST_COMPILATION_CACHE or ~/.cache/jaxdist/xla)")
    p.add_argument("--max-sessions", type=int, default=64,
                   help="resident sessions before LRU eviction (default %(default)s)")
    p.add_argument("--log-level", default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="(default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    logging.basicConfig(level=opts.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported after logging is set up: importing jax is slow and may log.
    from jaxdist.worker.server import create_server
    from jaxdist.worker.servicer import WorkerConfig

    if opts.max_sessions < 1:
        print(f"jaxdist-worker: --max-sessions must be >= 1, got {opts.max_sessions}",
              file=sys.stderr)
        return 2
    cache_dir = opts.compilation_cache
    if cache_dir is None:
        cache_dir = jd_config.default_compilation_cache()
    elif cache_dir.lower() == "off":
        cache_dir = None
    try:
        config = WorkerConfig(weights_roots=opts.weights_root, artifact_cache=opts.artifact_cache,
                              device=opts.device, max_sessions=opts.max_sessions)
        server, servicer, address = create_server(opts.listen, config)
    except JaxdistError as exc:
        print(f"jaxdist-worker: {exc}", file=sys.stderr)
        return 2
    jd_config.configure_compilation_cache(cache_dir, servicer.device.device_kind)
    if not opts.weights_root:
        logging.getLogger("jaxdist.worker").warning(
            "no --weight-root given: every weight URI will be refused")
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"jaxdist-worker listening on {address} device={servicer.device_name}", flush=True)
    stop.wait()
    drained = servicer.drain(timeout=30)
    servicer.hub.shutdown()  # ends the coordinators' subscriptions, so the grace period is short
    server.stop(grace=2).wait()
    servicer.close()
    if not drained:
        logging.getLogger("jaxdist.worker").warning("shut down with frames still in flight")
    return 0


if __name__ == "__main__":
    sys.exit(main())
