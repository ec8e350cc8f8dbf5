"""``jaxdist chat``: a multi-turn conversation with a causal LM across workers, in the terminal.

Each turn renders the whole conversation with the model's chat template and runs it through
the same :class:`~jaxdist.coordinator.engine.Engine` as ``jaxdist serve``, streaming the reply.
As there, special-token text typed in a message (``<|im_end|>``) is tokenized as plain text
(:class:`~jaxdist.coordinator.chat_template.ChatEncoder`): only the template ends turns.
``/reset`` starts over, ``/exit`` (or end of input) leaves. The conversation must fit the KV
cache (``--max-seq``); when it no longer does, the oldest turns are dropped, and it says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from jaxdist.cli.common import ProgressBar, add_cluster_args, check_cluster_args, open_cluster
from jaxdist.cli.generate import add_model_args, manifest_plan, model_plan
from jaxdist.coordinator.chat_template import ChatEncoder
from jaxdist.coordinator.request import SamplingParams
from jaxdist.core.errors import SpecError

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    c = sub.add_parser("chat", help="a multi-turn chat with a causal LM across workers")
    add_cluster_args(c)
    add_model_args(c)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system prompt")
    c.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply")
    c.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    c.add_argument("--top-k", type=int, default=0, help="0 = off")
    c.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(run=run_chat)


def _fit(chat: ChatEncoder, messages: list[dict[str, str]], max_seq: int, room: int
         ) -> tuple[list[int], int]:
    """The prompt ids of the conversation, dropping the oldest turns (never the system prompt
    or the last message) until it leaves ``room`` tokens; and how many messages were dropped."""
    keep = list(messages)
    dropped = 0
    while True:
        ids = chat.encode(keep, add_generation_prompt=True)
        first = 1 if keep and keep[0]["role"] == "system" else 0
        if len(ids) + room <= max_seq or len(keep) - first <= 1:
            return ids, dropped
        del keep[first]
        dropped += 1


def run_chat(opts: argparse.Namespace) -> int:
    from jaxdist.coordinator.engine import Engine  # noqa: PLC0415

    check_cluster_args(opts)  # before the model is read
    plan = manifest_plan(opts) if opts.manifest else model_plan(opts)
    tok = plan.tokenizer
    if tok is None or getattr(tok, "chat_template", None) is None:
        raise SpecError(f"model {plan.name} has no tokenizer with a chat template here; "
                        f"jaxdist chat needs one (use jaxdist generate --prompt-ids)")
    chat = ChatEncoder(tok)
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=opts.temperature,
                            top_k=opts.top_k, top_p=opts.top_p, seed=opts.seed)
    system = [{"role": "system", "content": opts.system}] if opts.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    with open_cluster(opts, plan.roots) as cluster:
        with ProgressBar() as bar:
            pipe = plan.deploy(cluster, bar)
        with Engine.for_model(pipe, plan.lm, tokenizer=tok, max_queue=1) as engine:
            print(f"chatting with {plan.name} on {len(pipe.clients)} workers; /reset starts "
                  f"over, /exit leaves", file=sys.stderr)
            while True:
                if interactive:
                    sys.stderr.write("> ")
                    sys.stderr.flush()
                line = sys.stdin.readline()
                if not line or line.strip() == "/exit":
                    break
                text = line.strip()
                if not text:
                    continue
                if text == "/reset":
                    messages = list(system)
                    print("(conversation reset)", file=sys.stderr)
                    continue
                messages.append({"role": "user", "content": text})
                room = min(opts.max_tokens, plan.lm.max_seq // 2)
                ids, dropped = _fit(chat, messages, plan.lm.max_seq, room)
                if dropped:
                    print(f"(the oldest {dropped} messages no longer fit the KV cache "
                          f"(--max-seq {plan.lm.max_seq}) and are left out)", file=sys.stderr)
                if len(ids) >= plan.lm.max_seq:
                    messages.pop()
                    print(f"(that message alone has {len(ids)} tokens, more than the KV cache "
                          f"holds (--max-seq {plan.lm.max_seq}); not sent)", file=sys.stderr)
                    continue
                limit = dataclasses.replace(params, max_tokens=min(opts.max_tokens,
                                                                   plan.lm.max_seq - len(ids)))
                reply = []
                for delta in engine.submit(ids, limit):
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
                    reply.append(delta.text)
                sys.stdout.write("\n")
                sys.stdout.flush()
                messages.append({"role": "assistant", "content": "".join(reply)})
        pipe.close(unload=plan.unload)
    return 0
