"""The authorizer's gRPC service (`agora.v1.Authorizer`): admission, preflight, renewal, trainers' reports,
clean leaves.

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
                  answered); then the stage a Join would get; no slot, signature or write.
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
- Decisions live in auth/policy.py; this module does I/O and bookkeeping. One asyncio loop, no
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
import dataclasses
import functools
import inspect
import json
import logging
import secrets
import sqlite3
import time
from collections import Counter
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, Mapping, Optional

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.admitted import AdmissionLog, AdmittedNode
from agora.auth.authority import RunAuthority
from agora.auth.challenges import ChallengeBook, ChallengeError, ChallengeState, RenewalChallenges
from agora.auth.credentials import (CLOCK_SKEW_S, Clock, CredentialError, CredentialVerifier, Identity,
                                    issue_credential, load_chain)
from agora.auth.dialback import dial_back
from agora.auth.keys import node_key_problem, peer_id_of
from agora.auth.limits import CallerLimits, CallSlots, TokenBuckets, address_key
from agora.auth.policy import (ContributorSlots, LinkMeasurement, Refusal, assign_stage, check_announce, check_floors,
                               proof_is_valid, run_payload, sign_proof)
from agora.auth.preflight import PreflightMeter
from agora.auth.reports import ReportDesk, report_problem
from agora.auth.settings import JOIN_ROLES, AuthorizerSettings
from agora.auth.status import Status, answers, caller_address
from agora.pipeline.fingerprint import FingerprintMismatch, RunFingerprint
from agora.protos.authorizer_adapter import (DOWNLOAD_CHUNK_BYTES, Admitted, Challenge, ChallengeRequest,
                                             JoinCheck, JoinReply, JoinRequest, LatencyProbe, Payload, Queued,
                                             RenewReply, LeaveReceipt, LeaveRequest, RenewRequest, ReportReceipt,
                                             RunDescription, RunFloors, RunRequest,
                                             TransferControl, UploadReceipt, WorkerReport, signed_payload)
from agora.protos.authorizer_adapter import Refused as RefusedReply

__all__ = ["AuthorizerService"]

logger = logging.getLogger(__name__)

_MAX_KEY_PEM, _MAX_CHAIN_PEM = 4096, 16384
_SWEEP_EVERY = 256


class AuthorizerService:
    """Implements protos/authorizer_adapter.AuthorizerHandler for one run."""

    def __init__(self, authority: RunAuthority, settings: AuthorizerSettings, *, run_config: Mapping[str, Any],
                 fingerprint: RunFingerprint, initial_peers: tuple[str, ...] = (),
                 stage_throughput: Optional[Callable[[], Mapping[int, float] | Awaitable[Mapping[int, float]]]] = None,
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
        _check_role(request.role, self.settings.join_roles, request.renewal)
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
        with self._newcomer(caller):
            return await self._preflight.upload(chunks, caller)

    # ---- join

    @answers
    async def join(self, request: JoinRequest, context: Any) -> JoinReply:
        caller = caller_address(context.peer())
        with self._newcomer(caller):
            return await self._join(request, caller)

    async def _join(self, request: JoinRequest, caller: str) -> JoinReply:
        now = self._clock()
        public_key, peer_id, state = self._proven(request, caller, now)
        outcome = await self._decide(request, state, peer_id, caller, now)
        if isinstance(outcome, JoinReply):
            return outcome
        stage, link = outcome
        return JoinReply(admitted=await self._admit(request, public_key, peer_id, stage, caller, link))

    def _proven(self, request: JoinRequest, caller: str, now: float) -> tuple[rsa.RSAPublicKey, str, ChallengeState]:
        """The key, peer id and (consumed) challenge of a Join or its dry run, once its format, its
        challenge and its proof of possession passed."""
        _check_role(request.role, self.settings.join_roles, False)
        if len(request.public_key_pem) > _MAX_KEY_PEM:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: longer than {_MAX_KEY_PEM} bytes")
        state = self._challenges.consume(request.nonce, caller, now)
        if request.role != state.role:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT,
                         f"role: the challenge was requested for a {state.role or 'node without role'}")
        public_key = _public_key(request.public_key_pem)
        if not proof_is_valid(public_key, signed_payload(request), request.signature):
            raise Status(grpc.StatusCode.UNAUTHENTICATED,
                         "proof of possession failed: the signature does not verify with public_key_pem")
        return public_key, peer_id_of(public_key), state

    def _refused(self, request: JoinRequest, peer_id: str, caller: str, refusal: Refusal,
                 detail: str = "") -> JoinReply:
        self._on_refused(refusal.field)
        logger.info("authorizer: refused %s %s from %s: %s", request.role, peer_id[:16], caller,
                    detail or refusal.reason, extra={"milestone": "admission_refused", "fields": {
                        "role": request.role, "peer_id": peer_id, "caller": caller, "field": refusal.field,
                        **({"detail": detail} if detail else {})}})
        return JoinReply(refused=RefusedReply(reason=refusal.reason, field=refusal.field))

    def _vet(self, request: JoinRequest, peer_id: str) -> Optional[Refusal]:
        """The checks a Join passes before its measurements (all in memory): ban, run fingerprint,
        and a worker's stage, announced address and hardware report."""
        ban = self.authority.is_banned(peer_id)
        if ban is not None:
            self._forget(peer_id)
            return Refusal("banned", f"banned: {ban.reason or 'by the operator'}")
        try:
            self.fingerprint.check(request.fingerprint)
        except FingerprintMismatch as mismatch:
            return Refusal(f"fingerprint.{mismatch.field}", str(mismatch))
        except ValueError as error:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"fingerprint: {error}") from None
        if request.role != "worker":
            if request.stage is not None:
                raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"stage: a {request.role} hosts no stage")
            return None
        if request.stage is not None and not 0 <= request.stage < self.fingerprint.stages:
            refusal = assign_stage(self.fingerprint.stages, {}, request.stage)
            assert isinstance(refusal, Refusal)
            return refusal
        announce = check_announce(request.announce_host, request.announce_port)
        if announce is not None:
            return announce
        if request.hardware is None:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, "hardware: a worker must report its hardware")
        return None

    async def _unreachable(self, request: JoinRequest, state: ChallengeState) -> Optional[tuple[Refusal, str]]:
        """Dial the worker back at its announced address: None when its listener answered with the
        challenge's token, else the refusal (the same words whatever went wrong, so that nobody maps
        what listens where) and, for the operator's log only, why."""
        address = _host_port(request.announce_host, request.announce_port)
        problem = await self._dial(request.announce_host, request.announce_port, state.dial_token,
                                   self.settings.dialback_timeout_s)
        if problem is None:
            return None
        return Refusal("reachability", (
            f"reachability: {address} is unreachable from the authorizer: open TCP port {request.announce_port} "
            f"on {request.announce_host} to the internet / forward it from your router to this machine, or "
            f"pass --announce-host with your public address")), f"dial-back to {address}: {problem}"

    async def _decide(self, request: JoinRequest, state: ChallengeState, peer_id: str, caller: str,
                      now: float) -> JoinReply | tuple[Optional[int], Optional[LinkMeasurement]]:
        """Refuse or queue (a reply), or the stage and link of an admission."""
        refusal = self._vet(request, peer_id)
        if refusal is not None:
            return self._refused(request, peer_id, caller, refusal)
        if request.role != "worker":
            return None, None
        link = self._link(state, peer_id, caller, now)
        below = check_floors(self.settings.floors, request.hardware, link)
        if below is not None:
            return self._refused(request, peer_id, caller, below)
        unreachable = await self._unreachable(request, state)
        if unreachable is not None:  # the node learns only that it is unreachable; the operator's log says why
            return self._refused(request, peer_id, caller, *unreachable)
        throughput = await self._throughput()
        # No await from here to the admission: the slot taken is the slot counted.
        now = self._clock()
        self._refresh_slots(now)
        position = self._slots.request(peer_id, now)
        if position > 0:
            logger.info("authorizer: queued worker %s at position %d", peer_id[:16], position)
            return JoinReply(queued=Queued(position=position, retry_after_s=self.settings.queue_retry_after_s))
        stage = assign_stage(self.fingerprint.stages, throughput, request.stage)
        assert isinstance(stage, int)  # the requested stage was range-checked above
        return stage, link

    def _link(self, state: ChallengeState, peer_id: str, caller: str, now: float) -> LinkMeasurement:
        """This challenge's measurements, or a queued node's recent ones."""
        if state.latency_probes == 0:
            link = self._fresh_link(peer_id, caller, now)
            if link is None:
                raise Status(grpc.StatusCode.FAILED_PRECONDITION, "preflight: no recent measurements for this node; "
                                                                  "request a new challenge and run its preflight")
            return link
        link = state.link()
        if link is None:
            raise Status(grpc.StatusCode.FAILED_PRECONDITION, "preflight: run the challenge's latency, download and "
                                                              "upload measurements before Join")
        for what, (count, _), expected in (("download", state.download, state.download_bytes),
                                           ("upload", state.upload, state.upload_bytes)):
            if count < expected:
                raise Status(grpc.StatusCode.FAILED_PRECONDITION,
                             f"preflight: {what} carried {count} of the challenge's {expected} bytes")
        self._measured[peer_id] = (caller, link, now)
        return link

    async def _throughput(self) -> Mapping[int, float]:
        value = self._stage_throughput()
        return await value if inspect.isawaitable(value) else value

    def _credential(self, public_key: rsa.RSAPublicKey, role: str, stage: Optional[int], now: float,
                    *, describe_run: bool) -> tuple[bytes, float, bytes]:
        """A credential chain, its expiry and (``describe_run``) the issuing CA's signature over the run
        description. Blocking (one or two RSA signatures; a new issuing CA key at rotation): it runs on
        a worker thread, so the loop serves other calls meanwhile."""
        lifetime = self.settings.credential_lifetime_s
        issuer = self.authority.issuing()
        chain = issue_credential(issuer, public_key, run_id=self.authority.run_id, role=role, stage=stage, now=now,
                                 lifetime_s=lifetime)
        signature = b"" if not describe_run else sign_proof(
            issuer.key, run_payload(self.authority.run_id, self.config_json, self.initial_peers, chain))
        return chain, min(now + lifetime, issuer.not_after), signature

    async def _admit(self, request: JoinRequest, public_key: rsa.RSAPublicKey, peer_id: str, stage: Optional[int],
                     caller: str, link: Optional[LinkMeasurement]) -> Admitted:
        now = self._clock()
        worker = request.role == "worker"
        if worker:  # taken before the first await below: the slot _decide counted is this one
            self._slots.hold(peer_id, now + self.settings.credential_lifetime_s)
        try:
            chain, expires_at, signature = await asyncio.to_thread(self._credential, public_key, request.role, stage,
                                                                   now, describe_run=True)
        except BaseException:
            if worker:
                self._slots.release(peer_id)
            raise
        if worker:
            self._slots.hold(peer_id, expires_at)
        address = _host_port(request.announce_host, request.announce_port) if worker else caller
        await self._record(AdmittedNode(
            peer_id=peer_id, role=request.role, stage=stage, address=address,
            device=request.hardware.device if request.hardware else "", admitted_at=now, expires_at=expires_at,
            **({} if link is None else {"rtt_ms": round(link.rtt_ms, 3), "upload_mbit": round(link.upload_mbit, 1),
                                        "download_mbit": round(link.download_mbit, 1)})))
        logger.info("authorizer: admitted %s%s %s at %s", request.role, "" if stage is None else f" stage {stage}",
                    peer_id[:16], address)
        return Admitted(credential_pem=chain, root_pem=self.authority.root_pem, run_id=self.authority.run_id,
                        role=request.role, stage=stage, lifetime_s=expires_at - now, config_json=self.config_json,
                        initial_peers=self.initial_peers, run_signature=signature)

    # ---- a Join's dry run

    @answers
    async def check_join(self, request: JoinRequest, context: Any) -> JoinCheck:
        """What a worker's Join would find, without the Join (`agora-node doctor`): the checks before
        the measurements, the preflight's figures and the run's floors, the dial-back, the stage it
        would be assigned, and our clock. It admits nobody, signs nothing, writes nothing and takes no
        slot, nor a place in the queue.

        Cost and bounds: exactly a Join's up to its admission. It spends a join challenge (the
        address and network buckets, the book's room in all and per network), its preflight (the
        same transfers, one at a time), a newcomer's call slot, one RSA verification (the proof of
        possession) and at most one dial-back of ``dialback_timeout_s``, to an address
        ``dialback_allowed`` accepts, answered in the same words whatever went wrong. So it dials
        no more often, nor anywhere else, than Joins already may, and tells no more about what
        listens there: no free port scanner."""
        caller = caller_address(context.peer())
        with self._newcomer(caller):
            return await self._check_join(request, caller)

    async def _check_join(self, request: JoinRequest, caller: str) -> JoinCheck:
        now = self._clock()
        if request.role != "worker":
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, "role: only a worker's Join has floors and a dial-back "
                                                           "to check")
        _, peer_id, state = self._proven(request, caller, now)
        refusal = self._vet(request, peer_id)
        if refusal is not None:
            verdict = JoinCheck(refused=RefusedReply(reason=refusal.reason, field=refusal.field))
            unreachable, stage = None, None
        else:
            link = self._link(state, peer_id, caller, now)
            unreachable = await self._unreachable(request, state)
            stage = assign_stage(self.fingerprint.stages, await self._throughput(), request.stage)
            verdict = JoinCheck(rtt_ms=link.rtt_ms, download_mbit=link.download_mbit, upload_mbit=link.upload_mbit,
                                floors=RunFloors(**dataclasses.asdict(self.settings.floors)),
                                unreachable=unreachable[0].reason if unreachable else "", stage=stage)
        self._on_join_check("refused" if refusal else "unreachable" if unreachable else "reachable")
        logger.info("authorizer: checked a join of %s from %s (dry run)", peer_id[:16], caller, extra={
            "milestone": "join_checked", "fields": {
                "peer_id": peer_id, "caller": caller, "refused": refusal.field if refusal else "",
                "reachable": unreachable is None, **({"detail": unreachable[1]} if unreachable else {})}})
        return dataclasses.replace(verdict, server_time=self._clock(), tolerated_skew_s=CLOCK_SKEW_S)

    # ---- renewal

    @answers
    async def renew(self, request: RenewRequest, context: Any) -> RenewReply:
        now = self._clock()
        identity, public_key = self._authenticated(request, now, roles=JOIN_ROLES, denied=(
            "an operator credential is not renewed: mint a new one with `agora-node authorizer issue`"))
        wait = self._renewing_peers.acquire(identity.peer_id, now)
        if wait > 0:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limit: {identity.peer_id[:16]}... renewed too "
                                                             f"often; retry after {wait:.1f} s", retry_after_s=wait)
        chain, expires_at, _ = await asyncio.to_thread(self._credential, public_key, identity.role, identity.stage,
                                                       now, describe_run=False)
        if identity.peer_id in self._slots.admitted:
            self._slots.hold(identity.peer_id, expires_at)
        known = self._admitted.get(identity.peer_id)
        if known is not None:
            await self._record(replace(known, expires_at=expires_at))
        logger.debug("authorizer: renewed %s", identity.describe())
        return RenewReply(credential_pem=chain, lifetime_s=expires_at - now)

    def _authenticated(self, request: RenewRequest | WorkerReport | LeaveRequest, now: float, *, roles: tuple[str, ...],
                       denied: str) -> tuple[Identity, rsa.RSAPublicKey]:
        """Who sent ``request``: a live credential of this run in a role of ``roles`` (else PERMISSION_DENIED
        with ``denied``, formatted with the role), whose key signed the request over a renewal challenge (spent
        here), and not banned. Cheap checks first: size, the nonce's MAC, the (cached) chain, then the proof."""
        if len(request.credential_pem) > _MAX_CHAIN_PEM:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"credential_pem: longer than {_MAX_CHAIN_PEM} bytes")
        self._renewal_challenges.check(request.nonce, now)
        try:
            identity = self._verifier.verify(request.credential_pem)
        except CredentialError as error:
            code = grpc.StatusCode.INVALID_ARGUMENT if error.reason == "malformed" else grpc.StatusCode.UNAUTHENTICATED
            hint = ": join again" if error.reason == "expired" else ""
            raise Status(code, f"{error}{hint}") from None
        public_key = load_chain(request.credential_pem)[0].public_key()
        problem = node_key_problem(public_key)
        if problem is not None:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"credential_pem: its key: {problem}")
        if identity.role not in roles:
            raise Status(grpc.StatusCode.PERMISSION_DENIED, denied.format(role=identity.role))
        if not proof_is_valid(public_key, signed_payload(request), request.signature):
            raise Status(grpc.StatusCode.UNAUTHENTICATED,
                         "proof of possession failed: the signature does not verify with the credential's key")
        self._renewal_challenges.spend(request.nonce, now)
        ban = self.authority.is_banned(identity.peer_id)
        if ban is not None:
            self._forget(identity.peer_id)
            raise Status(grpc.StatusCode.PERMISSION_DENIED, f"banned: {ban.reason or 'by the operator'}")
        return identity, public_key

    # ---- clean leaves

    @answers
    async def leave(self, request: LeaveRequest, context: Any) -> LeaveReceipt:
        caller = caller_address(context.peer())
        try:
            identity, _ = self._authenticated(request, self._clock(), roles=JOIN_ROLES, denied=(
                "an operator credential holds no slot: nothing to leave"))
        except (Status, ChallengeError) as error:
            self._on_leave(error.code.name.lower() if isinstance(error, Status) else f"challenge_{error.kind}")
            raise
        freed = identity.peer_id in self._slots.admitted
        self._forget(identity.peer_id)
        try:
            await asyncio.to_thread(self._log.forget, identity.peer_id)
        except sqlite3.Error as error:  # the slot is free now; a restart would hold it until expiry
            logger.warning("authorizer: could not delete %s from %s (%s)", identity.peer_id[:16], self._log.path, error)
        self._on_leave("freed" if freed else "left")
        logger.info("authorizer: %s left (%s)%s", identity.describe(), request.reason[:200] or "no reason given",
                    ", its slot is free" if freed else "", extra={"milestone": "node_left", "fields": {
                        "peer_id": identity.peer_id, "role": identity.role, "caller": caller, "freed": freed,
                        "reason": request.reason[:200]}})
        return LeaveReceipt(freed=freed)

    # ---- trainers' reports of flagged workers (auth/reports.py)

    @answers
    async def report(self, request: WorkerReport, context: Any) -> ReportReceipt:
        caller = caller_address(context.peer())
        try:
            receipt, banned_now = await self._report(request, caller)
        except (Status, ChallengeError) as error:
            outcome = error.code.name.lower() if isinstance(error, Status) else f"challenge_{error.kind}"
            self._on_report(outcome)
            logger.info("authorizer: refused a report about %s from %s: %s", request.peer_id[:16], caller, error,
                        extra={"milestone": "report_refused", "fields": {
                            "peer_id": request.peer_id[:128], "caller": caller, "outcome": outcome}})
            raise
        self._on_report("banned" if banned_now else "accepted")
        return receipt

    async def _report(self, request: WorkerReport, caller: str) -> tuple[ReportReceipt, bool]:
        """The receipt, and whether this report banned the worker. Cheap checks first: bounds, then the
        reporter (a renewal's), its rate, and the worker (in memory); then the write and the bar."""
        now = self._clock()
        problem = report_problem(request, self.fingerprint.stages)
        if problem is not None:
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, problem)
        reporter, _ = self._authenticated(request, now, roles=("trainer",), denied=(
            "role: only a trainer reports workers; this is a {role} credential"))
        wait = self._reporting_peers.acquire(reporter.peer_id, now)
        if wait > 0:
            raise Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limit: {reporter.peer_id[:16]}... reported too "
                                                             f"often; retry after {wait:.1f} s", retry_after_s=wait)
        subject = self._admitted.get(request.peer_id)
        admitted_worker = subject is not None and subject.role == "worker" and subject.expires_at > now
        receipt, banned_now = await self._report_desk.take(request, reporter.peer_id, caller, now,
                                                           admitted_worker=admitted_worker)
        if banned_now:
            self._forget(request.peer_id)
        return receipt, banned_now

def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_role(role: str, join_roles: tuple[str, ...], renewal: bool) -> None:
    if role in JOIN_ROLES and role not in join_roles and not renewal:
        raise Status(grpc.StatusCode.PERMISSION_DENIED,
                     f"role: this run admits {role}s with a credential from its operator only (`agora-node authorizer "
                     f"issue --role {role}`); it admits {', '.join(join_roles)} nodes that join by themselves")
    if role == "operator":
        raise Status(grpc.StatusCode.PERMISSION_DENIED, "role: operator credentials are minted offline with "
                                                        "`agora-node authorizer issue`, never through Join")
    if role not in JOIN_ROLES:
        raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"role: expected one of {', '.join(JOIN_ROLES)}, "
                                                       f"got {role[:40]!r}")


def _public_key(pem: bytes) -> rsa.RSAPublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as error:
        raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: not a PEM public key ({error})") from None
    problem = node_key_problem(key)
    if problem is not None:
        raise Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: {problem}")
    return key
