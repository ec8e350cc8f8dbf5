"""The serving layer: an OpenAI-compatible HTTP server (``app``), its request and response
bodies (``protocol``) and its Prometheus metrics (``metrics``), over the coordinator's engine."""
