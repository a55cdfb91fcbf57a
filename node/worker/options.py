"""`WorkerOptions`: how one worker serves, beside the run's config (which all replicas share).

Bounds on what it admits (queues, per-caller shares, rows, concurrent calls, message and stream
sizes), its stash, pinned weight versions and kept graphs, weight-sync downloads, the wire dtype it
sends, where it listens and what it announces. `validate` names the field and the value of any
option that cannot work, as a `ConfigError` (one line, exit 2 from the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass

from agora.node.inference.service import InferenceOptions
from agora.node.rpc.server import is_wildcard_host
from agora.node.worker.bounds import default_per_caller
from agora.node.worker.compute import DEFAULT_PINNED_VERSIONS
from agora.pipeline.codec import FLOAT_DTYPES
from agora.pipeline.config import ConfigError

__all__ = ["WorkerOptions"]


@dataclass(frozen=True)
class WorkerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port; `StageWorker.port` reports the real one
    # What peers dial, when it differs from `host` (a proxy, NAT, a wildcard bind); see `address`.
    announce_host: str | None = None
    synchronous: bool = False  # step only on the Step barrier
    # Asynchronous mode: None steps on the trainers' completed-batch reports (the stage's shared
    # epoch); a number steps on this replica's own samples instead, every that many.
    local_batch: int | None = None
    # Forward/Backward requests admitted but not finished; None: the stash's capacity, the in-flight
    # depth the memory plan sized this worker for (node/worker/flow.py shares it out as credits).
    max_queue: int | None = None
    # Of those, what one caller identity may hold; None: three quarters (node/worker/bounds.py).
    max_queue_per_caller: int | None = None
    # Step and Abort calls admitted but not finished (their own pool, per-caller limited the same
    # way); None: as many as max_queue.
    max_control_queue: int | None = None
    # Rows a request may carry; None: the run's train.microbatch_size (a larger value raises it).
    max_rows: int | None = None
    # Calls served at once (grpc answers RESOURCE_EXHAUSTED beyond); None: twice the queues plus 32,
    # room for Info, health checks and refused calls being drained.
    max_concurrent_rpcs: int | None = None
    stash_capacity: int = 64  # forward inputs kept for Backward
    stash_ttl_s: float = 600.0
    max_message_bytes: int = 16 * 2**20  # one gRPC message, each way
    # The codec's frame bound, and how much of a refused stream is read (and dropped) so that its client
    # sees the status; an admitted stream is held to its request's budget from the geometry (bounds.py).
    max_stream_bytes: int = 512 * 2**20
    stream_chunk_bytes: int = 2**20
    # An admitted stream must be complete this long after its first part (it holds a queue slot).
    stream_timeout_s: float = 30.0
    wire_dtype: str = "fp32"  # what this worker sends; it decodes any dtype
    grace_s: float = 10.0
    # Earlier weight versions kept so a backward runs on its forward's weights (node/worker/compute.py);
    # each costs one copy of the stage's trainable parameters. 0: recompute on the current weights.
    pinned_weights: int = DEFAULT_PINNED_VERSIONS
    # State downloads (weight sync of a joining replica, node/worker/state_transfer.py) served at once;
    # 0: this worker gives its state to nobody.
    max_state_downloads: int = 2
    # Head/body forward graphs kept so that Backward skips the recompute (node/worker/kept_graphs.py);
    # each costs the forward's activations. 0: recompute every Backward.
    keep_graphs: int = 0
    # Inference only (join --serve-only): no training call is served; and the sessions' bounds.
    serve_only: bool = False
    inference: InferenceOptions = InferenceOptions()

    @property
    def queue_capacity(self) -> int:
        """Forward/Backward requests held at once: `max_queue`, or the stash's capacity."""
        return self.stash_capacity if self.max_queue is None else self.max_queue

    @property
    def queue_per_caller(self) -> int:
        if self.max_queue_per_caller is not None:
            return self.max_queue_per_caller
        return default_per_caller(self.queue_capacity)

    @property
    def control_queue(self) -> int:
        return self.queue_capacity if self.max_control_queue is None else self.max_control_queue

    @property
    def concurrent_rpcs(self) -> int:
        if self.max_concurrent_rpcs is not None:
            return self.max_concurrent_rpcs
        return 2 * (self.queue_capacity + self.control_queue) + 32

    def validate(self) -> "WorkerOptions":
        for name in ("stash_capacity", "max_message_bytes", "max_stream_bytes", "stream_chunk_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"worker.{name}: must be positive, got {getattr(self, name)}")
        for name in ("max_queue", "max_queue_per_caller", "max_control_queue", "max_rows", "max_concurrent_rpcs"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"worker.{name}: must be positive, got {getattr(self, name)}")
        if self.queue_per_caller > self.queue_capacity:
            raise ConfigError(f"worker.max_queue_per_caller: {self.queue_per_caller} is above "
                              f"max_queue={self.queue_capacity}")
        if self.concurrent_rpcs <= self.queue_capacity + self.control_queue:
            raise ConfigError(f"worker.max_concurrent_rpcs: {self.concurrent_rpcs} leaves no room beside "
                              f"max_queue={self.queue_capacity} and max_control_queue={self.control_queue} "
                              "(Info, health checks and refusals need calls too)")
        if self.pinned_weights < 0:
            raise ConfigError(f"worker.pinned_weights: must be >= 0, got {self.pinned_weights}")
        if self.max_state_downloads < 0:
            raise ConfigError(f"worker.max_state_downloads: must be >= 0, got {self.max_state_downloads}")
        if self.keep_graphs < 0:
            raise ConfigError(f"worker.keep_graphs: must be >= 0, got {self.keep_graphs}")
        if self.stream_timeout_s <= 0:
            raise ConfigError(f"worker.stream_timeout_s: must be positive, got {self.stream_timeout_s}")
        if self.stash_ttl_s <= 0 or self.grace_s < 0:
            raise ConfigError("worker.stash_ttl_s/grace_s: must be positive / non-negative")
        if self.local_batch is not None and self.local_batch <= 0:
            raise ConfigError(f"worker.local_batch: must be positive, got {self.local_batch}")
        if self.stream_chunk_bytes >= self.max_message_bytes:
            raise ConfigError("worker.stream_chunk_bytes: must be below max_message_bytes")
        if self.wire_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"worker.wire_dtype: expected one of {', '.join(FLOAT_DTYPES)}, got {self.wire_dtype!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"worker.port: must be in 0..65535, got {self.port}")
        if self.announce_host is not None and is_wildcard_host(self.announce_host):
            raise ConfigError(f"worker.announce_host: {self.announce_host!r} means 'every interface', which no peer "
                              "can dial; give the address peers reach this worker on")
        return self
