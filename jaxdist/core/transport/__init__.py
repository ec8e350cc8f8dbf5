"""gRPC transport shared by the coordinator and the worker: channels, frames, status codes."""
