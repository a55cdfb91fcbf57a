"""SliceAverager: the one wrapper around hivemind's averager process, its pipe and its futures.

A worker averages one fixed-size flat float32 vector per round with the replicas of its stage,
through hivemind's ``DecentralizedAverager`` (DHT matchmaking, then the fault-tolerant butterfly
all-reduce of ``AllReduceRunner``: parts streamed to reducers, a silent sender dropped after
``sender_s``, a silent reducer's part kept at local values after ``reducer_s``).

Design choices:

- Blocking API, meant for one background thread (``asyncio.to_thread``): ``average()`` copies
  the caller's vector into the shared buffer, runs one hivemind step, and returns a
  ``RoundResult`` with a *copy* of the average. hivemind's ``StepControl``/``MPFuture`` never
  leave this module; every failure becomes an outcome, never an exception.
- One buffer of one fixed length for the averager's whole life: hivemind groups only peers
  whose tensor schema hash matches, and one flat tensor is written back in a single add (no
  partial writes across tensors).
- Rounds are kept apart by the group key: the round number is written into the group bits
  before every step (hivemind rewrites them after each assembled group, so it is set each
  time). The gathered metadata carries the round too, and a group whose members disagree is
  never applied.
- ``group_size`` (the live replicas the caller knows of) becomes the matchmaking target, so a
  complete group starts at once instead of waiting out ``matchmaking_s``; a smaller group
  still forms when the window closes.
- Outcomes: ``committed`` (an average arrived and is finite), ``alone`` (no group formed:
  hivemind never began an all-reduce), ``failed`` (the all-reduce failed or timed out),
  ``rejected`` (the average is not finite, or members disagree on the round), ``cancelled``.
- ``received_fraction``: the share of the vector whose average arrived (1 - hivemind's failed
  reducer parts / total), read in the averager process and returned with the step's result.
- Bytes are estimated, not counted: with equal shares each peer sends (g-1)/g of its vector
  to the other reducers and returns (g-1)/g of its reduced part, and receives as much.
- The averager process exits if its owner dies (kill -9), like the DHT process; its "could
  not find a group" error log is demoted to DEBUG because the caller reports that outcome.
- ``RoundBoard`` is where replicas of a stage say which round they are starting (a
  ``RoundRecord`` per peer under ``{run}.stage{i}.{method}.rounds``, expiring with the
  matchmaking window), so a replica whose own step count is behind can join the round a
  faster one is waiting in, and how many live replicas there are (the workers' records).
"""

import concurrent.futures
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import MPFuture

from agora.dht.records import Record, RecordError, check_run_id, worker_key
from agora.dht.swarm import SwarmDHT, _exit_when_orphaned

__all__ = [
    "GROUP_BITS",
    "OUTCOMES",
    "RoundBoard",
    "RoundRecord",
    "RoundResult",
    "SliceAverager",
    "estimated_bytes",
    "round_group_bits",
    "rounds_key",
]

logger = logging.getLogger(__name__)

OUTCOMES = ("committed", "alone", "failed", "rejected", "cancelled")
# Bits of the round number in the group key; rounds 2**16 apart never meet in time anyway.
GROUP_BITS = 16
# Extra host-side patience beyond hivemind's own deadlines (matchmaking, then the all-reduce)
# before a step is given up: by then hivemind has finished with the buffer, so the next round's
# copy into it cannot race a late write from this one.
_HOST_GRACE_S = 5.0
# A control request to the averager process (group bits, target size) answers in milliseconds.
_CONTROL_TIMEOUT_S = 10.0


def round_group_bits(round_number: int, bits: int = GROUP_BITS) -> str:
    """hivemind group bits for a round: its number modulo 2**bits, most significant bit first."""
    if round_number < 0:
        raise ValueError(f"round numbers are non-negative, got {round_number}")
    return format(round_number % (1 << bits), f"0{bits}b")


def estimated_bytes(vector_bytes: int, group_size: int) -> int:
    """Bytes one peer sends (and as many it receives) in a butterfly all-reduce with equal shares."""
    if group_size <= 1:
        return 0
    return int(2 * vector_bytes * (group_size - 1) / group_size)


@dataclass(frozen=True)
class RoundResult:
    outcome: str
    round: int
    averaged: Optional[torch.Tensor]  # a copy of the average, only when committed
    participants: tuple[str, ...] = ()  # peer ids of the group, self included
    weights: tuple[float, ...] = ()  # their weights, same order
    received_fraction: float = 0.0
    duration_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    error: Optional[str] = None

    @property
    def group_size(self) -> int:
        return len(self.participants)


class SliceAverager:
    """Averages one flat float32 vector of ``size`` elements per round. Create with ``start``."""

    def __init__(self, process: "_AveragerProcess", *, size: int, matchmaking_s: float, request_s: float,
                 round_s: float):
        self._process = process
        self.size = size
        self.matchmaking_s = matchmaking_s
        self.request_s = request_s
        self.round_s = round_s
        self._round_lock = threading.Lock()  # one round at a time; hivemind would queue a second
        self._current: Optional[MPFuture] = None
        self._closed = False

    @classmethod
    def start(cls, dht: hivemind.DHT, *, prefix: str, size: int, matchmaking_s: float, request_s: float,
              sender_s: float, reducer_s: float, round_s: float, part_size_bytes: int,
              startup_timeout: float = 30.0) -> "SliceAverager":
        """Start the averager process on an already running DHT.

        Call from the main thread before starting gRPC servers or torch thread pools: hivemind
        forks. ``prefix`` names the group keys and must differ between stages and methods.
        """
        if size <= 0:
            raise ValueError(f"the averaged vector needs at least one element, got {size}")
        if "." in prefix or not prefix:
            raise ValueError(f"prefix must be non-empty and contain no '.', got {prefix!r}")
        process = _AveragerProcess(
            [torch.zeros(size, dtype=torch.float32)], dht, start=False, prefix=prefix,
            min_group_size=2, min_matchmaking_time=matchmaking_s, request_timeout=request_s,
            allreduce_timeout=round_s, sender_timeout=sender_s, reducer_timeout=reducer_s,
            part_size_bytes=part_size_bytes, allow_state_sharing=False, initial_group_bits=round_group_bits(0),
        )
        # hivemind ignores SIGINT in the *calling* process before forking (so the child ignores
        # Ctrl-C and is shut down by its owner); give the owner its handler back afterwards.
        previous = signal.getsignal(signal.SIGINT)
        try:
            process.run_in_background(await_ready=True, timeout=startup_timeout)
        except BaseException:
            _stop(process)
            raise
        finally:
            signal.signal(signal.SIGINT, previous)
        return cls(process, size=size, matchmaking_s=matchmaking_s, request_s=request_s, round_s=round_s)

    @property
    def peer_id(self) -> str:
        return str(self._process.peer_id)

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    def average(self, values: torch.Tensor, *, round_number: int, weight: float, group_size: Optional[int] = None,
                metadata: Optional[Mapping[str, Any]] = None) -> RoundResult:
        """One round: average ``values`` with the peers of the same round. Blocking; never raises
        for a round that went wrong (see the outcomes in the module docstring)."""
        if values.shape != (self.size,):
            raise ValueError(f"expected a flat vector of {self.size} values, got shape {tuple(values.shape)}")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        started = time.monotonic()
        gather = {"round": int(round_number), "weight": float(weight), **(metadata or {})}
        with self._round_lock:
            if not self.alive:
                return RoundResult("failed", round_number, None, error="the averager process is not running")
            try:
                self._process.set_group_bits(round_group_bits(round_number), wait=False).result(_CONTROL_TIMEOUT_S)
                self._process.set_target_group_size(group_size if group_size and group_size > 1 else None)
                with self._process.get_tensors() as (buffer,):
                    buffer.copy_(values)
                step = self._process.step(gather=gather, weight=float(weight), wait=False, allow_retries=False,
                                          timeout=self.matchmaking_s + self.request_s)
            except Exception as error:  # the averager process is gone or broken
                return RoundResult("failed", round_number, None, duration_s=time.monotonic() - started,
                                   error=f"could not start the round: {type(error).__name__}: {error}")
            self._current = step
            try:
                return self._finish(step, round_number, started)
            finally:
                self._current = None

    def _finish(self, step: Any, round_number: int, started: float) -> RoundResult:
        patience = self.matchmaking_s + self.request_s + self.round_s + _HOST_GRACE_S
        try:
            reply = step.result(timeout=patience)
        except concurrent.futures.CancelledError:
            return RoundResult("cancelled", round_number, None, duration_s=time.monotonic() - started)
        except concurrent.futures.TimeoutError:
            step.cancel()
            return RoundResult("failed", round_number, None, duration_s=time.monotonic() - started,
                               error=f"no result within {patience:g} s")
        except BaseException as error:
            # hivemind reports both "no group" and a failed all-reduce as an exception; whether an
            # all-reduce ever began (a flag in the step's shared memory) tells them apart.
            outcome = "failed" if step.began_allreduce else "alone"
            return RoundResult(outcome, round_number, None, duration_s=time.monotonic() - started,
                               error=None if outcome == "alone" else f"{type(error).__name__}: {error}")
        if not (isinstance(reply, dict) and "gathered" in reply):  # the hook did not run (another hivemind)
            reply = {"gathered": reply if isinstance(reply, dict) else {}}
        gathered = reply["gathered"] or {}
        peers = tuple(str(peer) for peer in gathered)
        rounds = {data.get("round") if isinstance(data, dict) else None for data in gathered.values()}
        weights = tuple(float(data.get("weight", 0.0)) if isinstance(data, dict) else 0.0
                        for data in gathered.values())
        received = float(reply.get("received_fraction", 1.0))
        with self._process.get_tensors() as (buffer,):
            averaged = buffer.clone()
        common = dict(participants=peers, weights=weights, received_fraction=received,
                      duration_s=time.monotonic() - started)
        sent = estimated_bytes(averaged.numel() * averaged.element_size(), len(peers))
        if rounds != {round_number}:
            return RoundResult("rejected", round_number, None, **common, bytes_sent=sent, bytes_received=sent,
                               error=f"group members disagree on the round: {sorted(map(str, rounds))}")
        if not torch.isfinite(averaged).all():
            return RoundResult("rejected", round_number, None, **common, bytes_sent=sent, bytes_received=sent,
                               error="the average is not finite (all weights zero, or a peer sent NaN/Inf)")
        return RoundResult("committed", round_number, averaged, **common, bytes_sent=sent, bytes_received=sent)

    def cancel(self) -> None:
        """Abandon the round in flight, if any (safe from any thread); ``average`` returns ``cancelled``."""
        step = self._current
        if step is not None and not step.done():
            step.cancel()

    def shutdown(self) -> None:
        """Stop the averager process. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.cancel()
        _stop(self._process)

    def __enter__(self) -> "SliceAverager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def rounds_key(run_id: str, stage: int, method: str) -> str:
    """Where the replicas of one stage announce the rounds they start (one subkey per peer)."""
    base = worker_key(run_id, stage).rsplit(".", 1)[0]  # "{run}.stage{i}", validated there
    if not method.isidentifier():
        raise RecordError(f"method: expected an identifier, got {method!r:.40}")
    return f"{base}.{method}.rounds"


@dataclass(frozen=True)
class RoundRecord(Record):
    """A replica is starting averaging round ``round`` of its stage (``started_at``: DHT time), or,
    with ``closed``, has left it (its result is in, or it gave up): nobody should join it now."""

    KIND: ClassVar[str] = "round"

    peer_id: str
    run_id: str
    stage: int
    round: int
    started_at: float
    closed: bool = False

    def check(self) -> None:
        if not self.peer_id:
            raise RecordError("round.peer_id: empty")
        check_run_id(self.run_id)
        if self.stage < 0 or self.round < 0 or self.started_at < 0:
            raise RecordError("round.stage/round/started_at: must be >= 0")


class RoundBoard:
    """The stage's round announcements and replica count, over a ``SwarmDHT`` (async API)."""

    def __init__(self, swarm: SwarmDHT, *, run_id: str, stage: int, method: str, ttl: float):
        self._swarm = swarm
        self.run_id, self.stage = run_id, stage
        self.key = rounds_key(run_id, stage, method)
        self.ttl = ttl

    async def announce(self, round_number: int) -> None:
        """Tell the stage this replica is starting ``round_number`` (best effort)."""
        record = RoundRecord(peer_id=self._swarm.peer_id, run_id=self.run_id, stage=self.stage,
                             round=round_number, started_at=self._swarm.clock())
        await self._swarm.store_async(self.key, record, self.ttl, subkey=record.peer_id)

    async def close(self, round_number: int) -> None:
        """Tell the stage this replica has left ``round_number`` (best effort). The record replaces
        the announcement (same subkey, later expiry), so a replica that skipped the round does not
        join it after the others are gone and wait out the matchmaking window alone."""
        record = RoundRecord(peer_id=self._swarm.peer_id, run_id=self.run_id, stage=self.stage,
                             round=round_number, started_at=self._swarm.clock(), closed=True)
        await self._swarm.store_async(self.key, record, self.ttl, subkey=record.peer_id)

    async def announced_round(self) -> Optional[int]:
        """The latest round another replica announced and has not left, if any."""
        entries = await self._swarm.get_entries_async(self.key, RoundRecord)
        rounds = [stored.record.round for subkey, stored in entries.items()
                  if subkey == stored.record.peer_id != self._swarm.peer_id and stored.record.stage == self.stage
                  and not stored.record.closed]
        return max(rounds, default=None)

    async def replicas(self) -> int:
        """Live replicas of the stage, this one included (even before its first announce lands)."""
        records = await self._swarm.live_workers_async(self.run_id, self.stage)
        return 1 + sum(1 for w in records if w.peer_id != self._swarm.peer_id and w.phase != "leaving")


class _AveragerProcess(DecentralizedAverager):
    """hivemind's averager with three additions, each a thin hook around hivemind's own code:
    an orphan watch, the received fraction in the step's result, and a settable group target."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._owner_pid = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        threading.Thread(target=_exit_when_orphaned, args=(self._owner_pid,), name="agora-owner-watch",
                         daemon=True).start()
        logging.getLogger("hivemind.averaging.averager").addFilter(_demote_no_group)
        self._received_fractions: dict[bytes, float] = {}
        super().run()

    def set_target_group_size(self, size: Optional[int]) -> None:
        """Assemble a group as soon as it has ``size`` members (None: when the window closes)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size, future=future)))
        future.result(_CONTROL_TIMEOUT_S)

    async def _set_target_group_size(self, size: Optional[int], future: MPFuture) -> None:
        try:
            self._matchmaking.target_group_size = size
            future.set_result(None)
        except Exception as error:
            if not future.done():
                future.set_exception(error)

    async def _run_allreduce_inplace_(self, tensors: Any, group_info: Any, group_id: Optional[bytes] = None,
                                      **kwargs: Any) -> None:
        try:
            await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        finally:
            key = group_info.group_id if group_id is None else group_id
            registered = self._running_groups.get(key)
            if registered is not None and registered.done() and not registered.cancelled():
                container = registered.result().tensor_part_container
                self._received_fractions[key] = 1.0 - container.failed_size / max(1, container.total_size)

    async def _aggregate_with_group(self, group_info: Any, **kwargs: Any) -> dict:
        try:
            gathered = await super()._aggregate_with_group(group_info, **kwargs)
            received = self._received_fractions.get(group_info.group_id, 1.0)
        finally:
            self._received_fractions.pop(group_info.group_id, None)
        return {"gathered": gathered, "received_fraction": received}


def _demote_no_group(record: logging.LogRecord) -> bool:
    # Runs in the averager process. A round without partners is an outcome the caller logs.
    if record.levelno >= logging.ERROR and "could not find a group" in record.getMessage():
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


def _stop(process: DecentralizedAverager) -> None:
    if process.pid is None:
        return  # never started
    try:
        if process.is_alive():
            process.shutdown()
    finally:
        if process.is_alive():
            process.terminate()
        process.join(timeout=5)
