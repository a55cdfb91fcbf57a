"""`WorkerOptions`: how one worker serves, beside the run's config (which all replicas share).

Bounds on what it admits (queues, per-caller shares, rows, concurrent calls, message and stream
sizes), its stash, pinned weight versions and kept graphs, weight-sync downloads, the wire dtype it
sends, where it listens and what it announces, the bound on the output gradients it takes, how
it checks a state it downloads (`state_check`), when its watchdog makes it leave (`watchdog`), and
where it sends traces of the calls it serves (`tracing`).
Light (no torch): the CLI builds its flags from it. A section of the settings schema
(pipeline/schema.py): each option is declared once with its bounds and help, the fields with a
flag are `join`'s options, and a bad value is a `ConfigError` naming `worker.<field>` and the
value (one line, exit 2 from the CLI).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.node.inference.options import InferenceOptions
from agora.node.membership.check_options import StateCheckOptions
from agora.node.rpc.call_slots import DEFAULT_PROBE_CALLS
from agora.node.rpc.server import is_wildcard_host
from agora.node.tracing_options import TracingOptions
from agora.node.worker.watchdog_rules import WatchdogOptions
from agora.pipeline.schema import SECTION, NoneOr, setting

__all__ = ["WorkerOptions", "DEFAULT_PINNED_VERSIONS", "default_per_caller"]

# Earlier weight versions kept by default for backwards whose forward ran on them
# (node/replica/compute.py pins them): a backward spans at most a step and an averaging write or two.
DEFAULT_PINNED_VERSIONS = 2


def default_per_caller(capacity: int) -> int:
    """Three quarters of a pool (at least 1): one caller can keep a worker busy, and a quarter
    stays free for everyone else."""
    return max(1, capacity - capacity // 4)

WIRE_DTYPES = Literal["fp32", "bf16", "fp16", "int8"]


@dataclass(frozen=True, config=SECTION)
class WorkerOptions:
    host: StrictStr = setting("127.0.0.1", "address the gRPC server listens on", flag="--host", min_length=1)
    port: StrictInt = setting(0, "gRPC port (0: pick a free one)", flag="--port", ge=0, lt=65536)
    announce_host: Annotated[StrictStr | None, NoneOr] = setting(
        None, "address peers dial for the gRPC server, when it differs from --host (a proxy, NAT, a public "
        "address); default: --host, or for 0.0.0.0/:: the outbound interface's address", flag="--announce-host")
    synchronous: StrictBool = setting(
        False, "synchronous mode: one replica per stage, step barrier after every global batch", flag="--sync")
    local_batch: StrictInt | None = setting(
        None, "asynchronous mode: step on this replica's own samples, every this many, instead of on the trainers' "
        "completed-batch reports (the default: one step per global batch, shared by the stage's replicas)",
        flag="--local-batch", gt=0)
    max_queue: StrictInt | None = setting(
        None, "Forward/Backward requests held at once before RESOURCE_EXHAUSTED (default: the forward stash's "
        "capacity, the in-flight depth the memory plan sizes; callers get shares of it as credits, sized from "
        "their round trips)", flag="--max-queue", gt=0)
    max_queue_per_caller: StrictInt | None = setting(
        None, "of those, what one caller identity may hold (default: three quarters)", gt=0)
    max_control_queue: StrictInt | None = setting(
        None, "Step and Abort calls admitted and not finished, per-caller limited the same way (default: as many "
        "as max_queue)", gt=0)
    max_rows: StrictInt | None = setting(
        None, "rows a request may carry (default: the run's train.microbatch_size; only raises it)",
        flag="--max-rows", gt=0)
    max_concurrent_rpcs: StrictInt | None = setting(
        None, "calls served at once, RESOURCE_EXHAUSTED beyond; health checks and reflection are not counted here "
        "(max_probe_calls) (default: twice the queues plus 32, room for Info, state downloads and calls refused "
        "at admission)", gt=0)
    max_probe_calls: StrictInt = setting(
        DEFAULT_PROBE_CALLS, "health checks and reflection calls (health Watch streams included) served at once, "
        "in a pool of their own that never takes a training or inference call's place; RESOURCE_EXHAUSTED "
        "beyond, and one caller holds at most half", flag="--max-probe-calls", gt=0)
    stash_capacity: StrictInt = setting(64, "forward inputs kept for Backward", gt=0)
    stash_ttl_s: StrictFloat = setting(600.0, "a stashed input unclaimed this long is dropped", gt=0)
    max_message_bytes: StrictInt = setting(16 * 2**20, "one gRPC message, each way", gt=0)
    max_stream_bytes: StrictInt = setting(
        512 * 2**20, "the codec's frame bound, and how much of a refused stream is read (and dropped) so that its "
        "client sees the status; an admitted stream is held to its request's budget", gt=0)
    stream_chunk_bytes: StrictInt = setting(2**20, "parts a stream is cut into", gt=0)
    stream_timeout_s: StrictFloat = setting(
        30.0, "an admitted stream must be complete this long after its first part (it holds a queue slot)", gt=0)
    wire_dtype: WIRE_DTYPES = setting("fp32", "encoding of the boundary tensors this worker sends (it decodes any)",
                                      flag="--wire-dtype")
    grace_s: StrictFloat = setting(10.0, "seconds in-flight calls get to finish when leaving", ge=0)
    pinned_weights: StrictInt = setting(
        DEFAULT_PINNED_VERSIONS, "earlier weight versions kept so that each backward runs on the weights its "
        "forward used (one copy of the stage's parameters each; 0: recompute on the current weights)",
        flag="--pinned-weights", ge=0)
    max_state_downloads: StrictInt = setting(
        2, "state downloads (a joining replica's weight sync) served at once; 0: gives its state to nobody", ge=0)
    keep_graphs: StrictInt = setting(
        0, "head and body workers keep up to N forward autograd graphs, so a Backward skips recomputing its "
        "forward while the weights are unchanged (memory: the forward's activations each; 0: recompute every "
        "Backward)", flag="--keep-graphs", ge=0)
    gradient_bound_factor: StrictFloat = setting(
        1000.0, "a head or body refuses a Backward whose output gradient reaches beyond this many times the median "
        "largest value of the output gradients it accepted lately (INVALID_ARGUMENT naming output_grad: nothing "
        "applied, the stashed input kept)", gt=1)
    gradient_bound_warmup: StrictInt = setting(
        64, "output gradients a head or body accepts before that bound applies", ge=1)
    serve_only: StrictBool = setting(
        False, "answer inference only, on the weights of --checkpoint: no training, no averaging",
        flag="--serve-only")
    inference: InferenceOptions = setting(default_factory=InferenceOptions)
    state_check: StateCheckOptions = setting(default_factory=StateCheckOptions)
    watchdog: WatchdogOptions = setting(default_factory=WatchdogOptions)
    tracing: TracingOptions = setting(default_factory=TracingOptions)

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

    @model_validator(mode="after")
    def _agree(self) -> "WorkerOptions":
        if self.queue_per_caller > self.queue_capacity:
            raise ValueError(f"max_queue_per_caller: {self.queue_per_caller} is above max_queue={self.queue_capacity}")
        if self.concurrent_rpcs <= self.queue_capacity + self.control_queue:
            raise ValueError(f"max_concurrent_rpcs: {self.concurrent_rpcs} leaves no room beside "
                             f"max_queue={self.queue_capacity} and max_control_queue={self.control_queue} "
                             "(Info and refusals need calls too)")
        if self.stream_chunk_bytes >= self.max_message_bytes:
            raise ValueError(f"stream_chunk_bytes: {self.stream_chunk_bytes} must be below "
                             f"max_message_bytes={self.max_message_bytes}")
        if self.announce_host is not None and is_wildcard_host(self.announce_host):
            raise ValueError(f"announce_host: {self.announce_host!r} means 'every interface', which no peer can "
                             "dial; give the address peers reach this worker on")
        return self
