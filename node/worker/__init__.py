"""The stage worker's gRPC service (worker.py, with per-caller flow control) and the `join` daemon
that assembles a worker node (join.py)."""
