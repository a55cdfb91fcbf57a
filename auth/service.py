"""The authorizer's gRPC service (`agora.v1.Authorizer`): admission, preflight, renewal, trainers' reports,
clean leaves.

One object serves the whole service, since every handler reads and changes the same state (the
challenge book, the buckets, the slots, the admitted nodes) on one loop without locks. It is
assembled here from its parts, one module per concept, each a class of handlers over that state:

    auth/service.py     the state, the run's description, challenges, the preflight's streams
    auth/joining.py     Join: the checks, the floors, the dial-back, the slot, the credential
    auth/join_check.py  CheckJoin, a Join's dry run (beside the node's side of it)
    auth/renewal.py     Renew and Leave: a credential holder's calls, and how one is authenticated
    auth/reports.py     Report: trainers' reports of flagged workers (beside the bar and the ban)

Design choices:

- gRPC over TLS under the run's root (auth/authorizer_tls.py): a joining node has no credential
  to present, and needs none, but every status it gets (a refusal, a ban) comes from us. Nothing
  secret crosses the wire: the node's private key never leaves it (it signs our single-use
  challenge to prove it holds the key; the credential certifies only its public key), and the
  node checks every reply against the root it pinned: the root PEM must hash to the pinned
  fingerprint, the credential chain must verify against that root with the node's own public
  key, and the run description (config, bootstrap peers) must carry a valid signature by the
  issuing CA that signed the credential (auth/admission.py does all three).
- The port serves ``max_concurrent_rpcs`` calls at once; newcomers' calls that wait (preflight
  streams, Joins) may hold three quarters of them, and as many per network as the settings say,
  so a port full of slow newcomers still serves renewals.
- The preflight is measured on our clock, never self-reported (auth/preflight.py), per
  challenge, one measurement at a time; Join reads the records. A join challenge is bound to the
  address that asked for it; the preflight and the Join must come from there.
- Newcomers and admitted nodes draw on separate capacity. Join challenges come from a book capped
  in all and per caller network, behind token buckets per address and per network (auth/limits.py).
  Renewal challenges are MACed nonces that need no book (auth/challenges.py), behind buckets of
  their own; a renewal needs a live credential of this run, a proof with its key, and no ban.
  So no flood of newcomers, from however many addresses, can make an admitted node's renewal fail.
- Reachability: before admitting a worker we connect to the host:port it announced and expect the
  challenge's dial token back (its listener, see auth/admission.py), on a public address unless the
  run is local (auth/dialback.py). A refusal tells the node only that the address is unreachable
  and what to open; the log says why (refused, timed out, not public, another service answers).
- Outcomes the node can act on are replies (admitted / queued / refused with the floor or field
  and the measured value); protocol faults are statuses: INVALID_ARGUMENT (malformed),
  UNAUTHENTICATED (bad proof, expired credential), PERMISSION_DENIED (wrong caller, operator
  role, banned renewal, a report from no trainer), NOT_FOUND (a report about no admitted worker),
  FAILED_PRECONDITION (unknown or used challenge, preflight not run), RESOURCE_EXHAUSTED (rate
  limit, with ``retry-after`` trailing metadata).
- Cheap checks come before expensive work: nothing signs, transfers, dials or writes for a call
  that has not passed every check that costs less. In order:
    GetChallenge  role (format); rate (join: address and network buckets; renewal: its own
                  buckets); join: the book's room, in all and for the caller's network.
    preflight     the first message; the challenge (open, this caller's, this kind, none running);
                  then the transfer (auth/preflight.py).
    Join          role and key size (format); the challenge (consumed); the key rule (RSA-2048,
                  exponent 65537); the proof of possession (one RSA verification); ban, run
                  fingerprint, stage, announce, hardware, the preflight's figures and the floors
                  (all in memory); then the dial-back (workers); the slot; then the two RSA
                  signatures and the log write.
    Renew         size (format); the nonce (a MAC); the chain (cached X.509 verification), the key
                  rule, the role; the proof; ban; the peer's renewal bucket; then one RSA signature
                  and the log write.
    CheckJoin     as Join up to the dial-back (the floors judged, not refused on, so every verdict is
                  answered); then the stage a Join would get and a sample of its members; then, with members
                  to show, one RSA signature (a probe credential, auth/join_check.py); no slot or write.
    Leave         as Renew up to the ban (any role, for the caller itself only: the request names no
                  one else); then the slot's release and the log's delete.
    Report        the report's bounds; then as Renew up to the ban, the role a trainer's; the
                  trainer's report bucket; the worker (admitted or banned); then the report's write,
                  the bar and, past it, the ban (auth/reports.py).
- Blocking work runs on worker threads (``asyncio.to_thread``): the RSA signatures of an admission
  or a renewal (a few hundred microseconds each, and a key generation when the issuing CA
  rotates) and every write of the admission log. Verifications stay on the loop: a signature's
  costs some 30 microseconds, a chain's some 200 the first time and nothing once cached, about
  what the hop to a thread and back costs.
- Decisions live in auth/policy.py; the service's modules do I/O and bookkeeping. One asyncio loop, no
  locks: every handler's state change happens between awaits, and a worker's slot is held before
  the first await of its admission.
- A worker's slot frees when its credential expires, when it is banned, or at once when it leaves
  cleanly (Leave): the stage it held can take a newcomer without waiting out the credential.
- Admitted nodes are kept in ``admitted.sqlite`` beside the CA (auth/admitted.py), so a restarted
  authorizer keeps its slots and ``agora-node authorizer list`` shows them; trainers' reports of
  flagged workers in a table beside them (auth/reports.py: the bar, and what a trainer can do).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import secrets
import sqlite3
import time
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Optional, Sequence

import grpc

from agora.auth.admitted import AdmissionLog, AdmittedNode
from agora.auth.authority import RunAuthority
from agora.auth.challenges import ChallengeBook, ChallengeError, RenewalChallenges
from agora.auth.credentials import Clock, CredentialVerifier
from agora.auth.dialback import dial_back
from agora.auth.join_check import JoinCheckService
from agora.auth.joining import JoinService, check_role
from agora.auth.limits import CallerLimits, CallSlots, TokenBuckets, address_key
from agora.auth.policy import ContributorSlots, LinkMeasurement
from agora.auth.preflight import PreflightMeter
from agora.auth.renewal import RenewalService
from agora.auth.reports import ReportDesk, ReportService
from agora.auth.settings import AuthorizerSettings
from agora.auth.status import Status, answers, caller_address
from agora.pipeline.fingerprint import RunFingerprint
from agora.protos.authorizer_adapter import (DOWNLOAD_CHUNK_BYTES, Challenge, ChallengeRequest, LatencyProbe, Payload,
                                             RunDescription, RunRequest, StageMember, TransferControl,
                                             UploadReceipt)
from agora.protos.serving import drain

__all__ = ["AuthorizerService"]

logger = logging.getLogger(__name__)  # the authorizer's log: its parts write to it by this name

_SWEEP_EVERY = 256


class AuthorizerService(JoinService, JoinCheckService, RenewalService, ReportService):
    """Implements protos/authorizer_adapter.AuthorizerHandler for one run: the state every handler
    shares is built here; the handlers of each call are its bases'."""

    def __init__(self, authority: RunAuthority, settings: AuthorizerSettings, *, run_config: Mapping[str, Any],
                 fingerprint: RunFingerprint, initial_peers: tuple[str, ...] = (),
                 stage_throughput: Optional[Callable[[], Mapping[int, float] | Awaitable[Mapping[int, float]]]] = None,
                 stage_members: Optional[Callable[[int], Sequence[StageMember]
                                                  | Awaitable[Sequence[StageMember]]]] = None,
                 clock: Clock = time.time, timer: Clock = time.perf_counter,
                 random_bytes: Callable[[int], bytes] = secrets.token_bytes,
                 dial: Optional[Callable[[str, int, bytes, float], Awaitable[Optional[str]]]] = None,
                 on_refused: Callable[[str], None] = lambda field: None,
                 on_report: Callable[[str], None] = lambda outcome: None,
                 on_leave: Callable[[str], None] = lambda outcome: None,
                 on_join_check: Callable[[str], None] = lambda outcome: None):
        self.authority = authority
        self.settings = settings
        self.config_json = json.dumps(dict(run_config), sort_keys=True)
        self.fingerprint = fingerprint
        self.initial_peers = tuple(initial_peers)
        self._stage_throughput = stage_throughput or self._workers_per_stage
        self._stage_members = stage_members or self._admitted_members  # a dry run's sample (auth/join_check.py)
        self._clock, self._timer = clock, timer
        self._dial = dial or functools.partial(dial_back, local_network=self.settings.local_network)
        self._on_refused = on_refused  # counts refusals by field (node/authorizer.py: a metric)
        self._on_report = on_report  # counts reports: accepted, banned, or the status that refused them
        self._on_leave = on_leave  # counts leaves: freed (a worker's slot), left (no slot), or the refusing status
        self._on_join_check = on_join_check  # counts Joins' dry runs: reachable, unreachable, or refused
        self._verifier = CredentialVerifier(authority.root_pem, authority.run_id, clock=clock)
        s = self.settings
        self._challenges = ChallengeBook(s.challenge_ttl_s, random_bytes=random_bytes, capacity=s.max_challenges,
                                         per_network=s.challenges_per_network)
        self._join_limits = CallerLimits(address_rate_per_s=s.join_rate_per_s, address_burst=s.join_burst,
                                         network_rate_per_s=s.network_join_rate_per_s,
                                         network_burst=s.network_join_burst)
        # Renewals draw on capacity of their own: nonces that need no book, and their own buckets.
        self._renewal_challenges = RenewalChallenges(s.challenge_ttl_s, random_bytes=random_bytes)
        self._renewal_limits = TokenBuckets(s.renew_rate_per_s, s.renew_burst)  # per caller address
        self._renewing_peers = TokenBuckets(s.renew_rate_per_s, s.renew_burst)  # per peer id, after its proof
        self._reporting_peers = TokenBuckets(s.renew_rate_per_s, s.renew_burst)  # per trainer, after its proof
        self._newcomer_calls = CallSlots(per_network=s.max_calls_per_network, total=s.newcomer_calls)
        self._preflight = PreflightMeter(self._challenges, clock=clock, timer=timer,
                                         download_block=random_bytes(DOWNLOAD_CHUNK_BYTES))
        self._slots = ContributorSlots(settings.max_workers, stale_s=3 * settings.queue_retry_after_s + 10)
        self._measured: dict[str, tuple[str, LinkMeasurement, float]] = {}  # peer -> (caller, link, at)
        self._records = 0
        now = clock()
        self._log = AdmissionLog(authority.directory, now=now)
        self._report_desk = ReportDesk(authority, self.settings.report_bar)
        self._admitted: dict[str, AdmittedNode] = {}
        for node in self._log.live(now):
            if not authority.is_banned(node.peer_id):
                self._admitted[node.peer_id] = node
                if node.role == "worker":
                    self._slots.hold(node.peer_id, node.expires_at)

    def close(self) -> None:
        """Close the admission and report logs (the service answers no more calls after this)."""
        self._log.close()
        self._report_desk.close()

    # ---- bookkeeping

    def admitted(self) -> list[AdmittedNode]:
        now = self._clock()
        return [node for node in self._admitted.values() if node.expires_at > now]

    def _workers_per_stage(self) -> Mapping[int, float]:
        return Counter(node.stage for node in self.admitted() if node.role == "worker")

    def _admitted_members(self, stage: int) -> list[StageMember]:
        """The admitted workers of ``stage`` at the addresses they announced (their compute unknown here)."""
        return [StageMember(node.address, peer_id=node.peer_id) for node in self.admitted()
                if node.role == "worker" and node.stage == stage]

    async def _record(self, node: AdmittedNode) -> None:
        """Keep ``node`` (an admission, or a renewal's new expiry) in memory and in the admission log."""
        self._records += 1
        if self._records % _SWEEP_EVERY == 0:  # drop the expired ones from memory now and then
            now = self._clock()
            self._admitted = {peer: kept for peer, kept in self._admitted.items() if kept.expires_at > now}
        self._admitted[node.peer_id] = node
        try:
            await asyncio.to_thread(self._log.record, node)
        except sqlite3.Error as error:  # the admission stands; only the record of it is lost
            logger.warning("authorizer: could not write %s to %s (%s)", node.peer_id[:16], self._log.path, error)

    def _forget(self, peer_id: str) -> None:
        """A banned peer: its slot frees now, and `list` stops showing it (it filters banned peers)."""
        self._slots.release(peer_id)
        self._admitted.pop(peer_id, None)

    def _refresh_slots(self, now: float) -> None:
        """Free the slots of expired and banned workers."""
        self._slots.expire(now)
        for peer in [p for p in self._slots.admitted if self.authority.is_banned(p)]:
            self._forget(peer)

    # ---- run and challenges

    @answers
    async def get_run(self, request: RunRequest, context: Any) -> RunDescription:
        return RunDescription(run_id=self.authority.run_id, config_json=self.config_json,
                              fingerprint=self.fingerprint.text(), root_pem=self.authority.root_pem)

    @answers
    async def get_challenge(self, request: ChallengeRequest, context: Any) -> Challenge:
        caller, now = caller_address(context.peer()), self._clock()
        check_role(request.role, self.settings.join_roles, request.renewal)
        if request.renewal:
            return self._renewal_challenge(caller, now)
        limited = self._join_limits.acquire(caller, now)
        if limited is not None:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, limited.message("join attempts"),
                         retry_after_s=limited.retry_after_s)
        preflight = request.role == "worker" and self._fresh_link(request.peer_id, caller, now) is None
        s = self.settings
        state = self._challenges.issue(caller, request.role, now,
                                       latency_probes=s.latency_probes if preflight else 0,
                                       download_bytes=s.preflight_bytes if preflight else 0,
                                       upload_bytes=s.preflight_bytes if preflight else 0)
        return Challenge(nonce=state.nonce, dial_token=state.dial_token, expires_in_s=s.challenge_ttl_s,
                         latency_probes=state.latency_probes, download_bytes=state.download_bytes,
                         upload_bytes=state.upload_bytes)

    def _renewal_challenge(self, caller: str, now: float) -> Challenge:
        address = address_key(caller)
        wait = self._renewal_limits.acquire(address, now)
        if wait > 0:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limit: too many renewal challenges from "
                                                             f"{address}; retry after {wait:.1f} s", retry_after_s=wait)
        return Challenge(nonce=self._renewal_challenges.issue(now), dial_token=b"",
                         expires_in_s=self.settings.challenge_ttl_s)

    def _fresh_link(self, peer_id: str, caller: str, now: float) -> Optional[LinkMeasurement]:
        for peer in [p for p, (_, _, at) in self._measured.items() if now - at > self.settings.measurement_ttl_s]:
            del self._measured[peer]
        entry = self._measured.get(peer_id)
        return entry[1] if entry is not None and entry[0] == caller else None

    @contextlib.contextmanager
    def _newcomer(self, caller: str) -> Iterator[None]:
        """Hold one of the newcomers' call slots (preflight streams and Joins, the calls that wait)."""
        full = self._newcomer_calls.enter(caller)
        if full is not None:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"busy: {full}; retry after 1 s", retry_after_s=1.0)
        try:
            yield
        finally:
            self._newcomer_calls.leave(caller)

    # ---- preflight (auth/preflight.py)

    @answers
    async def measure_latency(self, probes: AsyncIterator[LatencyProbe],
                              send: Callable[[LatencyProbe], Awaitable[None]], context: Any) -> None:
        caller = caller_address(context.peer())
        with self._newcomer(caller):
            await self._preflight.latency(probes, send, caller)

    @answers
    async def measure_download(self, controls: AsyncIterator[TransferControl],
                               send: Callable[[Payload], Awaitable[None]], context: Any) -> None:
        caller = caller_address(context.peer())
        with self._newcomer(caller):
            await self._preflight.download(controls, send, caller)

    @answers
    async def measure_upload(self, chunks: AsyncIterator[Payload], context: Any) -> UploadReceipt:
        caller = caller_address(context.peer())
        try:
            with self._newcomer(caller):
                return await self._preflight.upload(chunks, caller)
        except (Status, ChallengeError):
            # Refused while the newcomer may still be writing: the rest is read and dropped first, or its
            # grpc client reports INTERNAL instead of this status (protos/serving.py `drain`).
            await drain(chunks, max_bytes=self.settings.preflight_bytes, size=lambda chunk: len(chunk.data))
            raise
