"""Weight sync, the donor's side: a member replica serves its stage's whole state to a joiner.

What travels is what a checkpoint holds (node/replica/checkpoints.py's `snapshot_stage`): the
stage's parameters, the optimizer (Adam moments, its step count, the sample count), and the
averaging loop's state, as one byte stream (pipeline/state_wire.py), through the Stage service's
`DownloadState` (protos/state_adapter.py). The RNG state is not sent: a replica's random stream
is its own, and a copy would correlate two replicas' draws. Nor are the work keys a checkpoint
keeps (node/replica/work_ledger.py): they say what this replica applied, not what the joiner did.

Design choices (hivemind issues #445 and #653: joiners time out on donors that are averaging,
because hivemind serves the state from the averager process, under the lock its all-reduce
holds, so a download waits for the round and then for the chunk timeout, donor after donor):
- The snapshot is one job on the compute thread, in FIFO order with training (a clone at a step
  boundary, as a checkpoint's), and everything after it runs off that thread: the stream is served
  from the clone by the gRPC server on the event loop. An averaging round in progress never
  blocks it (rounds run in their own thread and process; their applies are short compute jobs
  like any other), and the donor keeps training while the joiner reads.
- Joiners that arrive close together share one snapshot (`reuse_s`); a later one gets a fresh
  one. A snapshot stays `keep_s` after its last download ends, so a dropped transfer resumes
  (snapshot id and offset) instead of starting over; at most `max_snapshots` are held (one clone
  of the stage each, in host memory), and when all are in use a new joiner shares the newest.
- `max_downloads` at once; beyond, RESOURCE_EXHAUSTED (the joiner tries another donor). A write
  that waits more than `write_timeout_s` for the joiner's flow-control window ends the download,
  so a joiner that stops reading does not hold a slot.
- Only a member gives its state (a replica still syncing has not got the stage's yet), and only
  to a worker of the same stage or an operator (`agora-node export`); under --insecure anyone of
  the run (the fingerprint is still checked). The role table (auth/grpc_policy.py) already keeps
  trainers, clients and monitors out.
- The same call, with a sketch size, asks for a sketch of this member's own parameters under the
  caller's seed instead (node/membership/state_check.py): what a joiner compares a state it
  downloaded from another member with. The same callers, the same refusals; one pass over the
  parameters on the compute thread, no snapshot, a few KiB sent; at most `max_downloads` at once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Protocol, Sequence

import grpc
import torch

from agora.dht.records import Phase
from agora.node.membership.state_check import param_group_refusal, sketch_state
from agora.node.rpc.auth_check import Caller, current_caller
from agora.node.replica.compute import StageCompute
from agora.pipeline.checkpoint import StageState, rng_state
from agora.pipeline.state_wire import StateStream, StateWireError
from agora.protos.stage_adapter import StageRefusal
from agora.protos.state_adapter import StateChunk, StateRequest

__all__ = ["StateDonor", "DonorStats", "snapshot_stage", "state_tree", "download_refusal", "apply_state",
           "expected_state_bytes", "state_bytes_bound"]

logger = logging.getLogger("agora.node.worker.state")

# The longest sketch per tensor a member computes for a joiner (StateCheckOptions.sketch_size's bound).
MAX_SKETCH_SIZE = 65536


class _Worker(Protocol):
    """What the donor uses of a StageWorker."""

    stage_index: int
    run_id: str

    @property
    def phase(self) -> str: ...

    def on_compute(self, fn: Callable[[StageCompute], Any]) -> Awaitable[Any]: ...


class _AveragingState(Protocol):
    def state_dict(self, samples_total: int) -> dict: ...


def _host_copy(value: Any) -> Any:
    """`value` with every tensor copied to host memory (on a GPU worker the snapshot must not take a
    second copy of the stage's state in device memory), containers and plain values deep-copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(item) for item in value)
    return copy.deepcopy(value)


def snapshot_stage(compute: StageCompute) -> StageState:
    """(compute thread) A copy of the stage's state at this step boundary in host memory, so training goes
    on while it is written (a checkpoint) or sent (weight sync): parameters, optimizer state with the
    sample count, and this process's RNG state (a checkpoint adds the work keys:
    node/replica/checkpoints.py's `checkpoint_snapshot`)."""
    optimizer = _host_copy(compute.optimizer.state_dict())  # copies the moments
    optimizer["samples_total"] = compute.samples_total
    model = _host_copy(compute.stage.state_dict())
    return StageState(compute.index, model, optimizer, rng=rng_state())


def state_tree(state: StageState, step: int) -> dict:
    """What a snapshot sends: the stage's index and step, parameters, optimizer and averaging state."""
    return {"stage": state.index, "step": step, "model": state.model, "optimizer": state.optimizer,
            "averaging": state.averaging}


def download_refusal(caller: Optional[Caller], stage: int) -> Optional[str]:
    """Why `caller` may not download stage `stage`'s state, or None (pure; see the module docstring)."""
    if caller is None:
        return "no caller identity for this call"
    if caller.anonymous or caller.role == "operator":
        return None
    if caller.role == "worker" and caller.identity is not None and caller.identity.stage == stage:
        return None
    held = "" if caller.identity is None or caller.identity.stage is None else f" of stage {caller.identity.stage}"
    return (f"a {caller.role}{held} may not download stage {stage}'s state: only a worker of that stage "
            "(joining it) or an operator (export)")


def state_bytes_bound(numels: Sequence[int], element_bytes: int = 4) -> int:
    """A bound on the stream of a stage's state whose trainable tensors have `numels` elements: the
    parameters, two Adam moments each, a DiLoCo anchor and momentum (two more copies), and room for
    the manifest and counters."""
    return 5 * element_bytes * sum(numels) + 4 * 2**20 + 4096 * len(numels)


def expected_state_bytes(compute: StageCompute) -> int:
    """(compute thread) `state_bytes_bound` of this replica's stage, its buffers included."""
    buffers = sum(t.numel() * t.element_size() for t in compute.stage.state_dict().values()) - sum(
        p.numel() * p.element_size() for p in compute.optimizer.parameters)
    return state_bytes_bound([p.numel() for p in compute.optimizer.parameters]) + max(0, buffers)


def apply_state(compute: StageCompute, tree: Any) -> int:
    """(compute thread) Take a downloaded state as this replica's own; returns the step it is at.

    The parameters must be exactly this stage's (names, shapes, dtypes), the optimizer state must fit
    them and set nothing but its learning rate unlike this replica's own (betas, eps, weight decay,
    maximize, ...: torch takes them from the state), or nothing is changed (`StateWireError`). Its
    values are checked before, by the downloader (node/membership/state_check.py). The step count
    keeps whichever is later, the donor's or the one this replica reached by counting
    completed-batch reports while it downloaded, so it stays on the stage's epoch."""
    if not isinstance(tree, dict) or tree.get("stage") != compute.index:
        raise StateWireError(f"the state is not stage {compute.index}'s")
    model, optimizer = tree.get("model"), tree.get("optimizer")
    own = compute.stage.state_dict()
    if not isinstance(model, dict) or set(model) != set(own) or any(
            not hasattr(model[k], "shape") or model[k].shape != own[k].shape or model[k].dtype != own[k].dtype
            for k in own):
        raise StateWireError(f"the parameters are not those of stage {compute.index} of this model")
    if not isinstance(optimizer, dict):
        raise StateWireError("the state has no optimizer state")
    groups = param_group_refusal(optimizer, compute.optimizer.optimizer.state_dict()["param_groups"])
    if groups is not None:
        raise StateWireError(groups)
    optimizer = dict(optimizer)
    samples = optimizer.pop("samples_total", 0)
    _check_moments(optimizer, compute)
    before = {name: tensor.clone() for name, tensor in own.items()}
    saved_optimizer = compute.optimizer.state_dict()
    steps = compute.optimizer.steps
    compute.weights_changing()
    try:
        compute.stage.load_state_dict(model)
        compute.optimizer.load_state_dict(optimizer)
    except (RuntimeError, KeyError, ValueError, TypeError) as error:
        compute.stage.load_state_dict(before)
        compute.optimizer.load_state_dict(saved_optimizer)
        raise StateWireError(f"the optimizer state does not fit stage {compute.index}: {error}") from None
    compute.optimizer.steps = max(steps, compute.optimizer.steps)
    compute.samples_total = int(samples) if isinstance(samples, int) and samples >= 0 else 0
    return compute.optimizer.steps


def _check_moments(optimizer: dict, compute: StageCompute) -> None:
    """Every tensor of the Adam state of parameter i has parameter i's shape, or is a scalar step (torch
    numbers parameters across the optimizer's groups, in group order)."""
    inner = optimizer.get("optimizer")
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
            or not isinstance(optimizer.get("steps"), int):
        raise StateWireError("the optimizer state is malformed")
    parameters = [p for group in compute.optimizer.optimizer.param_groups for p in group["params"]]
    for index, entry in inner["state"].items():
        if not isinstance(index, int) or not 0 <= index < len(parameters) or not isinstance(entry, dict):
            raise StateWireError(f"optimizer state entry {index!r} is not one of this stage's parameters")
        for name, value in entry.items():
            if hasattr(value, "shape") and value.dim() and value.shape != parameters[index].shape:
                raise StateWireError(f"optimizer state {name} of parameter {index} has shape {list(value.shape)}, "
                                     f"the parameter {list(parameters[index].shape)}")


@dataclass
class _Snapshot:
    id: str
    step: int
    tree: dict  # what the stream carries (the same tensors, not a copy)
    stream: StateStream
    sha256: str
    taken_at: float
    last_used: float
    downloads: int = 0  # in progress


@dataclass
class DonorStats:
    """What this donor served (read by tests and the worker's stats)."""

    snapshots: int = 0
    downloads: int = 0  # started
    completed: int = 0
    resumed: int = 0  # started at an offset > 0
    refused_busy: int = 0
    bytes_sent: int = 0
    sketches: int = 0  # sketches sent to joiners checking another member's state
    offsets: deque = field(default_factory=lambda: deque(maxlen=64))  # where the latest downloads started


class StateDonor:
    """Serves `DownloadState` for one started worker (see the module docstring)."""

    def __init__(self, worker: _Worker, *, max_downloads: int = 2, chunk_bytes: int = 2**20,
                 reuse_s: float = 30.0, keep_s: float = 120.0, max_snapshots: int = 2,
                 write_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        if max_downloads < 1 or chunk_bytes < 1 or max_snapshots < 1:
            raise ValueError("max_downloads, chunk_bytes and max_snapshots must be positive")
        self.worker = worker
        self.max_downloads, self.chunk_bytes = max_downloads, chunk_bytes
        self.reuse_s, self.keep_s, self.max_snapshots = reuse_s, keep_s, max_snapshots
        self.write_timeout_s = write_timeout_s
        self.averaging: Optional[_AveragingState] = None  # the join daemon sets it once its loop exists
        self.stats = DonorStats()
        self._clock = clock
        self._active = 0
        self._sketching = 0
        self._snapshots: dict[str, _Snapshot] = {}
        self._taking: Optional[asyncio.Lock] = None

    @property
    def snapshots(self) -> list[dict]:
        """The states it holds for downloads now, oldest first (what a joiner receives is one of these)."""
        return [s.tree for s in sorted(self._snapshots.values(), key=lambda s: s.taken_at)]

    async def download_state(self, request: StateRequest, send: Callable[[StateChunk], Awaitable[None]],
                             context: Any) -> None:
        worker = self.worker
        refusal = download_refusal(current_caller(), worker.stage_index)
        if refusal is not None:
            raise StageRefusal(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if request.run_id != worker.run_id or request.stage != worker.stage_index:
            raise StageRefusal(grpc.StatusCode.INVALID_ARGUMENT,
                               f"this worker hosts stage {worker.stage_index} of run {worker.run_id!r}, the request "
                               f"names stage {request.stage} of run {request.run_id!r}")
        if worker.phase != Phase.MEMBER:
            raise StageRefusal(grpc.StatusCode.FAILED_PRECONDITION,
                               f"this replica is in phase {worker.phase}, not a member: its state is not the "
                               "stage's; download from a member")
        if request.sketch_size:
            await self._send_sketch(request, send)
            return
        if self._active >= self.max_downloads:
            self.stats.refused_busy += 1
            raise StageRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this donor serves {self.max_downloads} state downloads at once; try another "
                               "replica of the stage, or again later")
        self._active += 1
        try:
            snapshot = await self._snapshot_for(request)
            snapshot.downloads += 1
            try:
                await self._send(snapshot, request.offset, send)
            finally:
                snapshot.downloads -= 1
                snapshot.last_used = self._clock()
        finally:
            self._active -= 1

    async def _send_sketch(self, request: StateRequest, send: Callable[[StateChunk], Awaitable[None]]) -> None:
        """A second member's part in checking another's state: its own parameters' sketch under the
        joiner's seed (node/membership/state_check.py), one pass on the compute thread, a few KiB."""
        if request.sketch_size > MAX_SKETCH_SIZE:
            raise StageRefusal(grpc.StatusCode.INVALID_ARGUMENT,
                               f"sketch_size {request.sketch_size} is above {MAX_SKETCH_SIZE}")
        if self._sketching >= self.max_downloads:
            self.stats.refused_busy += 1
            raise StageRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this member computes {self.max_downloads} sketches at once; ask another member")
        self._sketching += 1
        try:
            sketch = await self.worker.on_compute(lambda compute: sketch_state(
                compute.stage.state_dict(), request.sketch_seed, request.sketch_size, compute.optimizer.steps))
        finally:
            self._sketching -= 1
        stream = StateStream(sketch.tree())
        await self._stream(stream, 0, "", stream.sha256(), sketch.step, send)
        self.stats.sketches += 1

    async def _send(self, snapshot: _Snapshot, offset: int, send: Callable[[StateChunk], Awaitable[None]]) -> None:
        stream = snapshot.stream
        if not 0 <= offset <= stream.total_bytes:
            raise StageRefusal(grpc.StatusCode.OUT_OF_RANGE,
                               f"offset {offset} is beyond snapshot {snapshot.id}'s {stream.total_bytes} bytes")
        self.stats.downloads += 1
        self.stats.offsets.append(offset)
        if offset:
            self.stats.resumed += 1
        logger.info("state download of stage %d step %d (snapshot %s, %d bytes) from offset %d",
                    self.worker.stage_index, snapshot.step, snapshot.id, stream.total_bytes, offset)
        await self._stream(stream, offset, snapshot.id, snapshot.sha256, snapshot.step, send)
        self.stats.completed += 1

    async def _stream(self, stream: StateStream, offset: int, snapshot_id: str, sha256: str, step: int,
                      send: Callable[[StateChunk], Awaitable[None]]) -> None:
        while offset < stream.total_bytes:
            data = stream.read(offset, self.chunk_bytes)
            chunk = StateChunk(snapshot_id=snapshot_id, offset=offset, data=data, total_bytes=stream.total_bytes,
                               sha256=sha256, step=step)
            try:
                await asyncio.wait_for(send(chunk), self.write_timeout_s)
            except asyncio.TimeoutError:
                raise StageRefusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the joiner read nothing for {self.write_timeout_s:g} s; resume with snapshot "
                                   f"{snapshot_id} at offset {offset}") from None
            offset += len(data)
            self.stats.bytes_sent += len(data)

    async def _snapshot_for(self, request: StateRequest) -> _Snapshot:
        now = self._clock()
        self._forget_idle(now)
        if request.snapshot_id:
            snapshot = self._snapshots.get(request.snapshot_id)
            if snapshot is None:
                raise StageRefusal(grpc.StatusCode.NOT_FOUND,
                                   f"snapshot {request.snapshot_id[:64]!r} is no longer held here (a donor keeps one "
                                   f"{self.keep_s:g} s after its last download); start again without it")
            return snapshot
        if self._taking is None:
            self._taking = asyncio.Lock()
        async with self._taking:  # joiners arriving together share the snapshot the first one takes
            newest = max(self._snapshots.values(), key=lambda s: s.taken_at, default=None)
            if newest is not None and (self._clock() - newest.taken_at <= self.reuse_s
                                       or not self._room_for_another()):
                return newest
            return await self._take()

    def _room_for_another(self) -> bool:
        idle = [s for s in self._snapshots.values() if s.downloads == 0]
        if len(self._snapshots) < self.max_snapshots:
            return True
        if not idle:
            return False
        del self._snapshots[min(idle, key=lambda s: s.last_used).id]
        return True

    def _forget_idle(self, now: float) -> None:
        for snapshot in list(self._snapshots.values()):
            if snapshot.downloads == 0 and now - snapshot.last_used > self.keep_s:
                del self._snapshots[snapshot.id]

    async def _take(self) -> _Snapshot:
        state = await self.worker.on_compute(snapshot_stage)  # one clone, at a step boundary
        samples = int(state.optimizer.get("samples_total", 0))
        if self.averaging is not None:
            state.averaging = self.averaging.state_dict(samples)
        step = int(state.optimizer["steps"])
        tree = state_tree(state, step)
        stream = await asyncio.to_thread(StateStream, tree)
        digest = await asyncio.to_thread(stream.sha256)
        now = self._clock()
        snapshot = _Snapshot(secrets.token_hex(8), step, tree, stream, digest, now, now)
        self._snapshots[snapshot.id] = snapshot
        self.stats.snapshots += 1
        logger.info("stage %d: state snapshot %s at step %d (%d bytes) for weight sync", self.worker.stage_index,
                    snapshot.id, step, stream.total_bytes)
        return snapshot
