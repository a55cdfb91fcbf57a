"""Each member of a completed averaging round attests the others, and hands each member its attestation.

A trainer never sees the background rounds of a stage's replicas, so the rounds a contributor joined
are vouched for by the other members of each round (auth/round_attestations.py). When a round this
worker ran commits (dht/averaging.py `RoundResult`), `RoundAttester` signs, for every other member,
that they completed it together, and delivers it over that member's Stage service
(`DeliverAttestation`), which verifies and keeps it (node/worker/attestations.py).

Design choices:

- **Who is attested**: the round's other members as the group agreed on them (`participants`: the
  libp2p peer ids the averaging admission bound to each member's worker credential, so the peer
  ids their credentials and DHT records carry), each with a positive agreed weight: a member that
  brought nothing to the round (weight 0: a replica still syncing its state) is not attested.
  Only a `committed` round: one alone, failed, rejected or cancelled attests nothing. A committed
  round whose result was not applied (a quorum not met, nothing to change) still counts: the
  members took part in it.
- **In the background, best effort**: the round observer (`AveragingLoop.round_observers`, on the
  event loop) only starts a task; the signatures (one RSA signature per member) run on a thread,
  each delivery is one call under `timeout_s`, and at most `max_pending` rounds are on their way:
  a round beyond that is not attested (counted `failed`). Nothing is sent again; averaging and
  training never wait on any of it.
- **Where a member is**: the endpoint its DHT worker record announces (`stage_records`, the stage's
  live records: the reads the round board makes), read at most every `records_ttl_s`, and again at
  once when a member is not among them (no record: `no_route`).
- **To that member only**: mutual TLS whose target name is the member's credential
  (`worker_server_name(stage, peer)`), as in weight sync, and the run fingerprint in the metadata,
  as every Stage call. One channel per member, reopened when its endpoint or this node's credential
  changes, closed at `close()`; at most `_MAX_CHANNELS` kept.
- **Counted by outcome** (`agora_worker_round_attestation_deliveries_total{outcome}`: kept,
  duplicate, refused with the member's reason, failed, no_route); the first of each outcome other
  than kept is a warning, the rest debug lines.
- Under --insecure there is nothing to sign with: no attester runs (`attest_rounds` is for an
  admitted worker), and a worker without credentials refuses attestations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable, Optional, Protocol, Sequence

import grpc

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.auth.node_state import NodeCredentials
from agora.auth.round_attestations import RoundAttestation, SignedAttestation, attestation_to_json, sign_attestation
from agora.dht.averaging import RoundResult
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.averaging.loop import AveragingLoop
from agora.node.rpc.tls import ChannelFactory, TlsChannels, worker_server_name
from agora.node.worker.worker import StageWorker
from agora.pipeline.fingerprint import RunFingerprint
from agora.protos.attestation_adapter import AttestationDelivery, AttestationStub

__all__ = ["RoundAttester", "attest_rounds", "attested_members"]

logger = logging.getLogger("agora.node.averaging")

_MAX_CHANNELS = 64
_FAILED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                     grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})


class StageRecord(Protocol):
    peer_id: str
    endpoint: str


class RoundAttester:
    """Attests the other members of this worker's committed rounds and delivers the attestations
    (module docstring). Call `on_round` from the event loop; `close()` waits for deliveries in flight."""

    def __init__(self, *, run_id: str, stage: int, credentials: NodeCredentials, channels: ChannelFactory,
                 fingerprint: RunFingerprint, stage_records: Callable[[], Awaitable[Sequence[StageRecord]]],
                 metrics: Optional[WorkerMetrics] = None, timeout_s: float = 5.0, records_ttl_s: float = 10.0,
                 max_pending: int = 8, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.run_id, self.stage, self.credentials, self.channels = run_id, stage, credentials, channels
        self.peer_id = credentials.peer_id
        self._metadata = ((FINGERPRINT_METADATA, fingerprint.text()),)
        self._stage_records, self._metrics = stage_records, metrics
        self.timeout_s, self.records_ttl_s, self.max_pending = timeout_s, records_ttl_s, max_pending
        self._clock, self._wall_clock = clock, wall_clock
        self._endpoints: dict[str, str] = {}
        self._endpoints_read_at = -float("inf")
        self._reading = asyncio.Lock()
        self._channels: dict[str, tuple[str, int, grpc.aio.Channel]] = {}  # peer -> endpoint, generation, channel
        self._tasks: set[asyncio.Task] = set()
        self._closing: set[asyncio.Task] = set()  # channels replaced, closing after their calls
        self._warned: set[str] = set()
        self.outcomes: dict[str, int] = {}
        self._closed = False

    def on_round(self, result: RoundResult, index: int, applied: bool) -> None:
        """A round observer: attest the other members of a committed round in the background."""
        members = attested_members(result, self.peer_id)
        if not members or self._closed:
            return
        if len(self._tasks) >= self.max_pending:
            for _ in members:
                self._outcome("failed", f"round {result.round}: {len(self._tasks)} rounds' attestations are still on "
                                        "their way; this round's are not sent")
            return
        task = asyncio.get_running_loop().create_task(self._attest(result.round, members),
                                                      name=f"attest-round-{result.round}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _attest(self, round_number: int, members: list[str]) -> None:
        try:
            signed = await asyncio.to_thread(self._sign, round_number, members)
        except Exception as error:  # noqa: BLE001 - e.g. an unreadable credential: this round goes unattested
            for _ in members:
                self._outcome("failed", f"round {round_number}: cannot sign: {type(error).__name__}: {error}")
            return
        endpoints = await self._endpoints_of(members)
        await asyncio.gather(*(self._deliver(one, endpoints.get(one.attestation.attested)) for one in signed))

    def _sign(self, round_number: int, members: list[str]) -> list[SignedAttestation]:
        chain, _ = self.credentials.current()  # re-read: the credential is renewed
        completed_at = self._wall_clock()
        return [sign_attestation(RoundAttestation(self.run_id, self.stage, round_number, self.peer_id, member,
                                                  completed_at), self.credentials.key, chain) for member in members]

    async def _endpoints_of(self, members: list[str]) -> dict[str, str]:
        """The members' announced endpoints, read again when one is missing or the last read is stale."""
        async with self._reading:
            stale = self._clock() - self._endpoints_read_at > self.records_ttl_s
            if stale or any(member not in self._endpoints for member in members):
                try:
                    records = await self._stage_records()
                    self._endpoints = {record.peer_id: record.endpoint for record in records}
                    self._endpoints_read_at = self._clock()
                except Exception as error:  # noqa: BLE001 - a DHT hiccup: the last read, or no route
                    logger.debug("attestations: could not read the stage's records: %s", error)
            return dict(self._endpoints)

    async def _deliver(self, signed: SignedAttestation, endpoint: Optional[str]) -> None:
        member = signed.attestation.attested
        if endpoint is None:
            self._outcome("no_route", f"member {member[:16]}.. announces no endpoint in the stage's records")
            return
        text = json.dumps(attestation_to_json(signed), sort_keys=True)
        try:
            channel = self._channel(member, endpoint)
            await AttestationStub(channel).deliver(AttestationDelivery(text), timeout=self.timeout_s,
                                                   metadata=self._metadata)
        except grpc.aio.AioRpcError as error:
            code = error.code()
            outcome = "duplicate" if code == grpc.StatusCode.ALREADY_EXISTS else \
                "failed" if code in _FAILED else "refused"
            self._outcome(outcome, f"member {member[:16]}.. at {endpoint}: {code.name}: {error.details()}")
        except Exception as error:  # noqa: BLE001 - a background delivery must never break the averaging loop
            self._outcome("failed", f"member {member[:16]}.. at {endpoint}: {type(error).__name__}: {error}")
        else:
            self._outcome("kept")

    def _channel(self, member: str, endpoint: str) -> grpc.aio.Channel:
        """The channel to `member` at `endpoint` under this node's current credential (no await: two
        deliveries to one member never open two)."""
        generation = self.channels.generation()
        held = self._channels.get(member)
        if held is not None and held[:2] == (endpoint, generation):
            return held[2]
        stale = [self._channels.pop(member)[2]] if held is not None else []
        if len(self._channels) >= _MAX_CHANNELS:
            stale.append(self._channels.pop(next(iter(self._channels)))[2])
        target = worker_server_name(self.stage, member) if self.channels.secure else None
        channel = self.channels.open(endpoint, target_name=target)
        self._channels[member] = (endpoint, generation, channel)
        for old in stale:  # calls still on it finish first
            closing = asyncio.get_running_loop().create_task(old.close(self.timeout_s))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        return channel

    def _outcome(self, outcome: str, why: str = "") -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if self._metrics is not None:
            self._metrics.attestation_delivered(outcome)
        if outcome == "kept":
            return
        level = logging.DEBUG if outcome in self._warned or outcome == "duplicate" else logging.WARNING
        self._warned.add(outcome)
        logger.log(level, "attestations: attesting a round to %s: %s%s", outcome, why,
                   "" if level == logging.DEBUG else " (further ones are debug lines)")

    async def close(self) -> None:
        """Wait for the deliveries in flight (each bounded by `timeout_s`), then close the channels."""
        self._closed = True
        await asyncio.gather(*self._tasks, *self._closing, return_exceptions=True)
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(channel.close() for _, _, channel in channels.values()), return_exceptions=True)


def attested_members(result: RoundResult, own_peer_id: str) -> list[str]:
    """The members of `result` this worker attests: of a committed round, the others with a positive weight
    (all others when the round reports no weights)."""
    if result.outcome != "committed":
        return []
    weights = result.weights if len(result.weights) == len(result.participants) else (1.0,) * len(result.participants)
    return [peer for peer, weight in zip(result.participants, weights) if peer != own_peer_id and weight > 0]


def attest_rounds(worker: StageWorker, averaging: AveragingLoop, credentials: NodeCredentials,
                  stage_records: Callable[[], Awaitable[Sequence[StageRecord]]],
                  metrics: Optional[WorkerMetrics] = None) -> RoundAttester:
    """An admitted worker's round attestations, both ways: its attester observes `averaging`'s rounds, and
    its own store bounds the rounds it is attested by the loop's schedule (`round_bound`)."""
    attester = RoundAttester(run_id=worker.run_id, stage=worker.stage_index, credentials=credentials,
                             channels=TlsChannels(credentials), fingerprint=worker.fingerprint,
                             stage_records=stage_records, metrics=metrics)
    averaging.round_observers.append(attester.on_round)
    if worker.attestations is not None:
        worker.attestations.rounds = averaging.round_bound
    return attester
