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
- ``formation_s``: from the round's start to matchmaking's formed group (stamped in the
  averager process as the group is handed over; CLOCK_MONOTONIC is shared by both processes),
  so a round's time splits into finding a group and averaging with it. None if none formed.
- Bytes are estimated, not counted: with equal shares each peer sends (g-1)/g of its vector
  to the other reducers and returns (g-1)/g of its reduced part, and receives as much.
- The averager process exits if its owner dies (kill -9), like the DHT process; its "could
  not find a group" error log is demoted to DEBUG because the caller reports that outcome.
- Which round the stage's replicas are in, and how many live, is on the round board
  (dht/round_board.py), read by the averaging loop, not here.

Admission (``start(admission=AveragingAdmission(...))``; off under ``--insecure``). hivemind's
DHT authorizer does not cover the averager's own RPCs (matchmaking and all-reduce parts go
straight over libp2p), so the credential travels in the round's gather metadata and is bound
to the libp2p peer id, which libp2p authenticates (it is the hash of the key that secured the
connection) and the credential certifies:

- Each round's gather carries the node's current credential chain, re-read from its state
  directory every round (renewal is a file replace).
- A leader refuses a join request (``PROTOCOL_VIOLATION``, before any of hivemind's own
  checks) unless its gather holds a chain that verifies against the pinned root for a
  *worker* of *this run and stage* whose peer id is the requester's ``context.remote_id``.
- Before the all-reduce, every member checks every gathered member's credential against that
  member's peer id (a leader that does not check, or lies, is caught here) and refuses to run
  the round if any fails: the outcome is ``rejected``, naming the peer; the buffer is untouched.
  All honest members hold the same gathered data, so they all refuse together.
- A peer on the run's ban list is refused by both checks whatever its credential says:
  the averager process gets the banned set (``start(banned=...)``, read before each round) when
  it changed.
- Parts: hivemind's ``AllReduceRunner.rpc_aggregate_part`` already answers a sender that is
  not in the group's ordered peer ids with ``PROTOCOL_VIOLATION``, and group membership is
  what the two checks above admit; so no part of an unadmitted peer is ever averaged.
- Refusals are counted in the averager process; ``SliceAverager.refusals()`` reads them.
"""

import concurrent.futures
import logging
import math
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional

import hivemind
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import as_aiter, azip

from agora.dht.averaging_admission import CREDENTIAL_FIELD, AdmissionGate, AveragingAdmission
from agora.dht.robust import DeviationHistory, RobustAggregation
from agora.pipeline.codec import all_finite
from agora.dht.robust_allreduce import AgreedGroup, RobustAllReduceRunner, agreed_group
from agora.dht.keys import AVERAGING_GROUP_BITS
from agora.dht.dht_process import begin_forked_process

__all__ = [
    "GROUP_BITS",
    "OUTCOMES",
    "RoundResult",
    "SliceAverager",
    "estimated_bytes",
    "round_group_bits",
]

logger = logging.getLogger(__name__)

OUTCOMES = ("committed", "alone", "failed", "rejected", "cancelled")
# Bits of the round number in the group key (keys.py says why so few).
GROUP_BITS = AVERAGING_GROUP_BITS
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
    # From the round's start to its group being formed (matchmaking); None when no group formed.
    formation_s: Optional[float] = None
    bytes_sent: int = 0
    bytes_received: int = 0
    error: Optional[str] = None
    # Contributions this peer's reducer rejected or pulled in, and averages it dropped, by reason
    # (dht/robust.py REASONS); only reasons that occurred.
    rejections: Mapping[str, int] = field(default_factory=dict)
    # Coordinates this peer's reducer moved to the edge of their band, or its guard to the move bound.
    clipped_coordinates: int = 0

    @property
    def rejected(self) -> int:
        """Contributions rejected or clipped, and averages dropped (weight 0 for syncing is not one)."""
        return sum(n for reason, n in self.rejections.items() if reason != "syncing")

    @property
    def group_size(self) -> int:
        return len(self.participants)


class SliceAverager:
    """Averages one flat float32 vector of ``size`` elements per round. Create with ``start``."""

    def __init__(self, process: "_AveragerProcess", *, size: int, matchmaking_s: float, request_s: float,
                 round_s: float, admission: Optional[AveragingAdmission] = None,
                 banned: Callable[[], Iterable[str]] = frozenset):
        self._process = process
        self.admission = admission
        self.size = size
        self.matchmaking_s = matchmaking_s
        self.request_s = request_s
        self.round_s = round_s
        self._round_lock = threading.Lock()  # one round at a time; hivemind would queue a second
        self._current: Optional[MPFuture] = None
        self._closed = False
        self._banned_source = banned
        self._banned: frozenset[str] = frozenset()  # as the averager process last got it

    @classmethod
    def start(cls, dht: hivemind.DHT, *, prefix: str, size: int, matchmaking_s: float, request_s: float,
              sender_s: float, reducer_s: float, round_s: float, part_size_bytes: int,
              admission: Optional[AveragingAdmission] = None, robust: RobustAggregation = RobustAggregation(),
              banned: Callable[[], Iterable[str]] = frozenset, startup_timeout: float = 30.0) -> "SliceAverager":
        """Start the averager process on an already running DHT.

        Call from the main thread before starting gRPC servers or torch thread pools: hivemind
        forks. ``prefix`` names the group keys and must differ between stages and methods.
        ``admission`` turns on the credential checks of the module docstring (None: ``--insecure``);
        ``robust`` is how this peer reduces its parts and judges the averages it gets back
        (dht/robust.py); ``banned`` gives the run's banned peers (``SwarmDHT.bans``), refused as
        members whatever their credential.
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
            admission=admission, robust=robust,
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
        return cls(process, size=size, matchmaking_s=matchmaking_s, request_s=request_s, round_s=round_s,
                   admission=admission, banned=banned)

    @property
    def peer_id(self) -> str:
        return str(self._process.peer_id)

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    def average(self, values: torch.Tensor, *, round_number: int, weight: float, group_size: Optional[int] = None,
                metadata: Optional[Mapping[str, Any]] = None, credential: Optional[bytes] = None) -> RoundResult:
        """One round: average ``values`` with the peers of the same round. Blocking; never raises
        for a round that went wrong (see the outcomes in the module docstring).

        ``credential`` is the chain sent to the group; by default, with admission, the one in the
        node's state directory now."""
        if values.shape != (self.size,):
            raise ValueError(f"expected a flat vector of {self.size} values, got shape {tuple(values.shape)}")
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"weight must be finite and >= 0, got {weight}")
        started = time.monotonic()
        gather = {"round": int(round_number), "weight": float(weight), **(metadata or {})}
        if credential is None and self.admission is not None:
            try:
                credential = self.admission.current_credential()
            except OSError as error:
                return RoundResult("failed", round_number, None, error=f"no credential to send: {error}")
        if credential is not None:
            gather[CREDENTIAL_FIELD] = bytes(credential)
        with self._round_lock:
            if not self.alive:
                return RoundResult("failed", round_number, None, error="the averager process is not running")
            try:
                self._process.set_group_bits(round_group_bits(round_number), wait=False).result(_CONTROL_TIMEOUT_S)
                self._process.set_target_group_size(group_size if group_size and group_size > 1 else None)
                banned = frozenset(self._banned_source())
                if banned != self._banned:
                    self._process.set_banned(banned)
                    self._banned = banned
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
        formation = reply["formed_at"] - started if "formed_at" in reply else None
        if reply.get("refused"):  # a member without a valid credential, or nobody with weight: no all-reduce ran
            return RoundResult("rejected", round_number, None, participants=tuple(reply.get("peers", ())),
                               duration_s=time.monotonic() - started, formation_s=formation, error=reply["refused"])
        gathered = reply["gathered"] or {}
        peers = tuple(str(peer) for peer in gathered)
        rounds = {data.get("round") if isinstance(data, dict) else None for data in gathered.values()}
        weights = tuple(float(w) for w in reply["weights"]) if "weights" in reply else tuple(
            float(data.get("weight", 0.0)) if isinstance(data, dict) else 0.0 for data in gathered.values())
        received = float(reply.get("received_fraction", 1.0))
        rejections = {str(reason): int(n) for reason, n in (reply.get("rejections") or {}).items() if n}
        with self._process.get_tensors() as (buffer,):
            averaged = buffer.clone()
        common = dict(participants=peers, weights=weights, received_fraction=received,
                      duration_s=time.monotonic() - started, formation_s=formation, rejections=rejections,
                      clipped_coordinates=int(reply.get("clipped_coordinates", 0)))
        sent = estimated_bytes(averaged.numel() * averaged.element_size(), len(peers))
        if rounds != {round_number}:
            return RoundResult("rejected", round_number, None, **common, bytes_sent=sent, bytes_received=sent,
                               error=f"group members disagree on the round: {sorted(map(str, rounds))}")
        if not all_finite(averaged):
            return RoundResult("rejected", round_number, None, **common, bytes_sent=sent, bytes_received=sent,
                               error="the average is not finite (all weights zero, or a peer sent NaN/Inf)")
        return RoundResult("committed", round_number, averaged, **common, bytes_sent=sent, bytes_received=sent)

    def refusals(self) -> dict[str, int]:
        """Credential refusals so far: ``join`` (requests this node refused as a leader) and
        ``group`` (assembled groups it refused to average with)."""
        if not self.alive:
            return {}
        return self._process.refusals()

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


class _AveragerProcess(DecentralizedAverager):
    """hivemind's averager with four additions, each a thin hook around hivemind's own code:
    an orphan watch, the received fraction in the step's result, a settable group target, and
    the credential checks of the module docstring."""

    def __init__(self, *args: Any, admission: Optional[AveragingAdmission] = None,
                 robust: RobustAggregation = RobustAggregation(), **kwargs: Any) -> None:
        self._owner_pid = os.getpid()
        self._admission = admission
        self._robust = robust
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        begin_forked_process(self._owner_pid)
        logging.getLogger("hivemind.averaging.averager").addFilter(_demote_no_group)
        logging.getLogger("hivemind.averaging.partition").addFilter(_demote_partial)
        self._agreed: dict[bytes, AgreedGroup] = {}  # by group id, while its all-reduce runs
        self._round_reports: dict[bytes, dict] = {}
        self._history = DeviationHistory(self._robust)
        self._gate = None if self._admission is None else AdmissionGate(self._admission)
        self._refusals: Counter[str] = Counter()
        super().run()

    def refusals(self) -> dict[str, int]:
        future = MPFuture()
        self._outer_pipe.send(("_get_refusals", [], dict(future=future)))
        return future.result(_CONTROL_TIMEOUT_S)

    async def _get_refusals(self, future: MPFuture) -> None:
        future.set_result(dict(self._refusals))

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest, context: P2PContext
                             ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if self._gate is not None:
            problem = self._gate.problem(request.gather, str(context.remote_id))
            if problem is not None:
                self._refusals["join"] += 1
                self._gate.warn(f"refused a join request from {context.remote_id}: {problem}")
                yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
                return
        async for response in super().rpc_join_group(request, context):
            yield response

    def set_banned(self, banned: frozenset[str]) -> None:
        """Refuse these peers as members from now on (the run's ban list)."""
        future = MPFuture()
        self._outer_pipe.send(("_set_banned", [], dict(banned=frozenset(banned), future=future)))
        future.result(_CONTROL_TIMEOUT_S)

    async def _set_banned(self, banned: frozenset[str], future: MPFuture) -> None:
        if self._gate is not None:
            self._gate.banned = banned
        future.set_result(None)

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
        """hivemind's in-place all-reduce, run by ``RobustAllReduceRunner`` (dht/robust_allreduce.py)."""
        key = group_info.group_id if group_id is None else group_id
        registered = self._running_groups[key]
        try:
            runner = RobustAllReduceRunner(
                agreed=self._agreed[group_info.group_id], policy=self._robust, history=self._history, p2p=self._p2p,
                servicer_type=type(self), prefix=self.prefix, tensors=tensors, group_id=key,
                ordered_peer_ids=group_info.peer_ids, **kwargs)
        except BaseException:
            registered.cancel()  # parts already waiting for this group end now
            raise
        registered.set_result(runner)
        try:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update)
        finally:
            container = runner.tensor_part_container
            self._round_reports[group_info.group_id] = {
                "received_fraction": 1.0 - container.failed_size / max(1, container.total_size),
                "rejections": dict(runner.counts), "clipped_coordinates": runner.clipped_coordinates}

    async def _aggregate_with_group(self, group_info: Any, **kwargs: Any) -> dict:
        # Matchmaking has just formed the group. CLOCK_MONOTONIC is system-wide, so the owner
        # subtracts its own start of the round from this.
        formed_at = time.monotonic()
        if self._gate is not None:
            for peer_id, data in zip(group_info.peer_ids, group_info.gathered):
                problem = self._gate.problem(data, str(peer_id))
                if problem is not None:
                    self._refusals["group"] += 1
                    refused = f"group member {peer_id} refused: {problem}"
                    self._gate.warn(refused)
                    return self._refuse(group_info, refused, formed_at)
        agreed = agreed_group(group_info, self._robust)
        if not any(weight > 0 for weight in agreed.weights.values()):
            return self._refuse(group_info, "every member has weight 0 (all are syncing or idle)", formed_at)
        self._agreed[group_info.group_id] = agreed
        try:
            gathered = await super()._aggregate_with_group(agreed.group_info, **kwargs)
            report = self._round_reports.get(group_info.group_id, {})
        finally:
            self._agreed.pop(group_info.group_id, None)
            self._round_reports.pop(group_info.group_id, None)
        return {"gathered": gathered, "received_fraction": report.get("received_fraction", 1.0),
                "rejections": report.get("rejections", {}),
                "clipped_coordinates": report.get("clipped_coordinates", 0), "formed_at": formed_at,
                "weights": [agreed.weights[peer] for peer in group_info.peer_ids]}

    def _refuse(self, group_info: Any, reason: str, formed_at: float) -> dict:
        """End a group without running its all-reduce: every honest member refuses alike."""
        registered = self._running_groups.get(group_info.group_id)
        if registered is not None and not registered.done():
            registered.cancel()  # parts already waiting for this group end now
        return {"gathered": {}, "refused": reason, "peers": [str(p) for p in group_info.peer_ids],
                "formed_at": formed_at}


def _demote_no_group(record: logging.LogRecord) -> bool:
    # Runs in the averager process. A round without partners is an outcome the caller logs.
    if record.levelno >= logging.ERROR and "could not find a group" in record.getMessage():
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


def _demote_partial(record: logging.LogRecord) -> bool:
    # Runs in the averager process. A part dropped by a guard, or a reducer that failed, is in the
    # round's received fraction and its milestone line; hivemind's own line would say it again.
    if record.levelno == logging.WARNING and "received" in record.getMessage():
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
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
