"""Device directives: parse ``auto`` / ``cpu`` / ``cuda:1`` and resolve them to a ``jax.Device``.

A directive names a platform and optionally an index: ``auto``, ``cpu``, ``cuda``, ``rocm``,
``tpu``, ``metal``, each platform optionally followed by ``:N`` (``cuda:1``). Parsing is
case-insensitive and ignores surrounding whitespace. A directive that the machine cannot honour
is an error, never a silent fallback to another device.

Decisions worth knowing:

* ``gpu`` is refused, not mapped to ``cuda``: jax uses ``gpu`` for both CUDA and ROCm, and artifacts
  are lowered separately for ``cuda`` and ``rocm``, so the directive must say which one.
* ``auto`` picks the first platform present in the order tpu, cuda, rocm, cpu, and the first device
  of that platform. It never picks ``metal``: jax-metal can only run artifacts exported as portable
  (lowered for cpu with ``DisabledSafetyCheck.platform()``), so using it must be asked for by name.
* The index ``N`` in ``cuda:N`` is the position among this process's local devices of that platform,
  in the order jax lists them (by device id). It is not the global device id of a multi-host run.

How jax names platforms (jax 0.10): a CUDA or ROCm device reports ``device.platform == "gpu"``; the
vendor is told apart by ``device.client.platform_version``, which contains ``cuda`` or ``rocm``
(this is how ``jax._src.test_util.is_cuda/is_rocm`` decide). The backends are registered in
``jax._src.xla_bridge`` as ``cuda`` / ``rocm``; jax-metal registers ``METAL``.
:func:`device_platform` hides all that and returns one of cpu, cuda, rocm, tpu, metal.

Example:
    >>> resolve_device("cpu").platform
    'cpu'
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from typing import Any

import jax

from jaxdist.core.errors import DeviceError

__all__ = [
    "PLATFORMS",
    "AUTO_PREFERENCE",
    "DeviceDirective",
    "parse_directive",
    "device_platform",
    "available_devices",
    "resolve_device",
    "describe_device",
]

logger = logging.getLogger(__name__)

PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu", "metal")
"""Platforms a directive can name, in jaxdist's (and jax.export's) spelling."""

AUTO_PREFERENCE: tuple[str, ...] = ("tpu", "cuda", "rocm", "cpu")
"""The order in which ``auto`` looks for a platform. ``metal`` is deliberately absent."""

# Backend names as jax registers them; tried one by one so that an absent plugin never crashes.
_JAX_BACKENDS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu", "METAL")

_DIRECTIVE_RE = re.compile(r"^(auto|cpu|cuda|rocm|tpu|metal)(?::([0-9]+))?$", re.ASCII)

_VALID_FORMS = "auto, cpu, cuda, rocm, tpu, metal, or a platform with an index such as cuda:1"


@dataclasses.dataclass(frozen=True)
class DeviceDirective:
    """A parsed device directive.

    Attributes:
        platform: ``"auto"`` or one of :data:`PLATFORMS`.
        index: position among the local devices of ``platform``; ``None`` means the first one.
            Always ``None`` for ``auto``.

    Example:
        >>> from jaxdist import DeviceDirective
        >>> d = DeviceDirective("cuda", 1)
        >>> str(d), d.platform, d.index
        ('cuda:1', 'cuda', 1)
    """

    platform: str
    index: int | None = None

    def __post_init__(self) -> None:
        if self.platform != "auto" and self.platform not in PLATFORMS:
            raise DeviceError(
                f"device directive platform {self.platform!r} is not known; "
                f"expected one of: {_VALID_FORMS}"
            )
        if self.index is not None:
            if self.platform == "auto":
                raise DeviceError(
                    f"device directive 'auto:{self.index}' is malformed: auto takes no index; "
                    f"expected one of: {_VALID_FORMS}"
                )
            if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
                raise DeviceError(
                    f"device directive index {self.index!r} for {self.platform!r} is invalid: "
                    "expected a non-negative integer"
                )

    def __str__(self) -> str:
        return self.platform if self.index is None else f"{self.platform}:{self.index}"


def parse_directive(text: str) -> DeviceDirective:
    """Parse a device directive such as ``"auto"``, ``"cpu"`` or ``"cuda:1"``.

    Args:
        text: the directive; case-insensitive, surrounding whitespace is ignored.

    Returns:
        The parsed :class:`DeviceDirective`.

    Raises:
        DeviceError: the text is not a valid directive. ``gpu`` is refused as ambiguous.

    Example:
        >>> from jaxdist import parse_directive
        >>> parse_directive(" CUDA:1 ")
        DeviceDirective(platform='cuda', index=1)
        >>> parse_directive("auto")
        DeviceDirective(platform='auto', index=None)
    """
    if not isinstance(text, str):
        raise DeviceError(
            f"device directive must be a string, got {type(text).__name__}; "
            f"expected one of: {_VALID_FORMS}"
        )
    norm = text.strip().lower()
    if norm == "gpu" or norm.startswith("gpu:"):
        raise DeviceError(
            f"device directive {text!r} is ambiguous: jax calls both CUDA and ROCm devices 'gpu'; "
            f"write cuda{norm[3:]} or rocm{norm[3:]} instead"
        )
    match = _DIRECTIVE_RE.match(norm)
    if match is None:
        raise DeviceError(
            f"device directive {text!r} is malformed; expected one of: {_VALID_FORMS}"
        )
    platform, index = match.group(1), match.group(2)
    if platform == "auto" and index is not None:
        raise DeviceError(
            f"device directive {text!r} is malformed: auto takes no index; "
            f"expected one of: {_VALID_FORMS}"
        )
    return DeviceDirective(platform, None if index is None else int(index))


def device_platform(device: Any) -> str:
    """The jaxdist platform name of a jax device.

    Args:
        device: a ``jax.Device`` (or any object with ``.platform`` and, for GPUs,
            ``.client.platform_version``).

    Returns:
        ``cpu``, ``cuda``, ``rocm``, ``tpu`` or ``metal``. A platform jaxdist does not know (for
        example Intel ``oneapi``, or a ``gpu`` whose vendor cannot be told) is returned lowercased
        as reported; no directive matches it, so it is never selected.
    """
    raw = str(getattr(device, "platform", "")).lower()
    if raw != "gpu":
        return raw
    client = getattr(device, "client", None)
    version = str(getattr(client, "platform_version", "")).lower()
    if "rocm" in version:
        return "rocm"
    if "cuda" in version:
        return "cuda"
    return "gpu"


def _discover() -> tuple[list[Any], dict[str, str]]:
    """Local devices of every backend that initializes, and why the others did not."""
    found: list[Any] = []
    seen: set[int] = set()
    failures: dict[str, str] = {}
    for backend in _JAX_BACKENDS:
        try:
            devices = jax.local_devices(backend=backend)
        except Exception as exc:  # jax raises RuntimeError; plugins may raise anything.
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "Unknown backend" not in message:
                failures[backend.lower()] = message
            logger.debug("jax backend %s is not available: %s", backend, message)
            continue
        for device in devices:
            if id(device) not in seen:
                seen.add(id(device))
                found.append(device)
    return found, failures


def available_devices() -> list[Any]:
    """Local devices of every jax backend that initializes on this machine (cpu is always there)."""
    return _discover()[0]


def _by_platform(devices: Sequence[Any]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = {}
    for device in devices:
        grouped.setdefault(device_platform(device), []).append(device)
    return grouped


def _present(grouped: dict[str, list[Any]]) -> str:
    if not grouped:
        return "no devices"
    parts = []
    for platform, devices in grouped.items():
        for i, device in enumerate(devices):
            parts.append(f"{platform}:{i} ({getattr(device, 'device_kind', '?')})")
    return ", ".join(parts)


def resolve_device(directive: str | DeviceDirective, devices: Sequence[Any] | None = None) -> Any:
    """Resolve a directive to one device of this machine, or fail loudly.

    Args:
        directive: a directive string (see :func:`parse_directive`) or a parsed directive.
        devices: the devices to choose from; defaults to the local devices of every jax backend
            that initializes (:func:`available_devices`). Tests pass fakes here.

    Returns:
        The chosen ``jax.Device``.

    Raises:
        DeviceError: the directive is malformed, its platform is absent, or its index is out of
            range. The message lists the devices actually present.

    Example:
        >>> resolve_device("auto")  # doctest: +SKIP
        CudaDevice(id=0)
    """
    parsed = directive if isinstance(directive, DeviceDirective) else parse_directive(directive)
    failures: dict[str, str] = {}
    if devices is None:
        devices, failures = _discover()
    grouped = _by_platform(devices)
    present = _present(grouped)
    # Only the failures that explain this directive: jax registers a tpu backend even where
    # libtpu is absent, and its failure says nothing about a missing cuda device.
    not_started = "".join(f"; backend {b} failed to initialize: {m}" for b, m in failures.items()
                          if parsed.platform in ("auto", b))

    if parsed.platform == "auto":
        for platform in AUTO_PREFERENCE:
            if grouped.get(platform):
                chosen = grouped[platform][0]
                logger.info("device directive auto resolved to %s:0 (%s)", platform, chosen)
                return chosen
        raise DeviceError(
            f"device directive 'auto' cannot be honoured: none of {', '.join(AUTO_PREFERENCE)} is "
            f"present. Devices present: {present}{not_started}. Name a platform explicitly "
            "(for example metal) or install the jax plugin for this machine's accelerator"
        )

    candidates = grouped.get(parsed.platform, [])
    if not candidates:
        raise DeviceError(
            f"device directive {str(parsed)!r} cannot be honoured: no {parsed.platform} device is "
            f"present. Devices present: {present}{not_started}. Use one of the present devices "
            f"(or 'auto'), or install the jax plugin for {parsed.platform}"
        )
    index = 0 if parsed.index is None else parsed.index
    if index >= len(candidates):
        raise DeviceError(
            f"device directive {str(parsed)!r} cannot be honoured: index {index} is out of range, "
            f"this machine has {len(candidates)} {parsed.platform} device(s) "
            f"({parsed.platform}:0..{parsed.platform}:{len(candidates) - 1}). "
            f"Devices present: {present}{not_started}"
        )
    chosen = candidates[index]
    logger.info("device directive %s resolved to %s", parsed, chosen)
    return chosen


def _host_memory() -> tuple[int | None, int | None]:
    try:
        import psutil
    except ImportError:
        return None, None
    vm = psutil.virtual_memory()
    return int(vm.total), int(vm.available)


def describe_device(device: Any, devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """A JSON-friendly description of a device, for worker status reports and CLIs.

    Args:
        device: the device to describe.
        devices: the list its index is counted in (same rule as :func:`resolve_device`); defaults
            to :func:`available_devices`. Pass the list the device came from when it is not a
            real local device. With it, ``f"{platform}:{index}"`` resolves back to ``device``.

    Returns:
        A dict with ``platform``, ``index`` (``None`` when ``device`` is not in ``devices``),
        ``id`` (jax's device id, not the directive index), ``kind``, and memory in bytes:
        ``memory_total``, ``memory_used``, ``memory_free``, with ``memory_source`` saying where
        they come from: ``"device"`` when ``device.memory_stats()`` reports a limit, ``"host"``
        (RAM via psutil; free = available) for a cpu device without stats, else ``None`` with
        the memory fields ``None``.
    """
    platform = device_platform(device)
    if devices is None:
        devices = available_devices()
    same = _by_platform(devices).get(platform, [])
    index = next((i for i, d in enumerate(same) if d is device), None)

    total: int | None = None
    free: int | None = None
    source: str | None = None
    try:
        stats = device.memory_stats()
    except Exception as exc:  # not every plugin implements memory_stats
        logger.debug("memory_stats() failed on %s: %s", device, exc)
        stats = None
    if stats and stats.get("bytes_limit"):
        total = int(stats["bytes_limit"])
        free, source = total - int(stats.get("bytes_in_use", 0)), "device"
    elif platform == "cpu":
        total, free = _host_memory()
        source = "host" if total is not None else None
    return {
        "platform": platform,
        "index": index,
        "id": getattr(device, "id", None),
        "kind": getattr(device, "device_kind", None),
        "memory_total": total,
        "memory_used": None if total is None or free is None else total - free,
        "memory_free": free,
        "memory_source": source,
    }
