"""The serving layer: an OpenAI-compatible HTTP server (``app``), its request and response
bodies (``protocol``), its Prometheus metrics (``metrics``) and the bounds it serves HTTP under
(``server``: connections, timeouts, body size, strict HTTP/1.1), over the coordinator's
engine."""
