"""The authorizer's gRPC service (`agora.v1.Authorizer`): admission, preflight, renewal.

Design choices:

- Plaintext gRPC. A joining node has no credential to present, and nothing secret crosses the
  wire: the node's private key never leaves it (it signs our single-use challenge to prove it
  holds the key; the credential certifies only its public key). The node pinned the root's
  fingerprint out of band, so it checks every reply: the root PEM must hash to the pinned
  fingerprint, the credential chain must verify against that root with the node's own public
  key, and the run description (config, bootstrap peers) must carry a valid signature by the
  issuing CA that signed the credential (auth/admission.py does all three). A man in the middle
  can refuse service, never admit anyone or change what an admitted node is told.
- The preflight is measured here, on our clock, never self-reported: the latency probes, the
  download (first byte sent to acknowledgement received) and the upload (opening message to last
  byte) are timed per challenge, and Join reads those records. A challenge is bound to the
  address that asked for it; the preflight and the Join must come from there.
- Reachability: before admitting a worker we connect to the host:port it announced and expect the
  challenge's dial token back (its listener, see auth/admission.py). Refusals say which address
  failed and what to open. The dial-back runs only after a valid proof of possession, within the
  caller's rate limit, and only reads one line (it sends nothing), so it is a poor tool for
  probing third parties.
- Outcomes the node can act on are replies (admitted / queued / refused with the floor or field
  and the measured value); protocol faults are statuses: INVALID_ARGUMENT (malformed),
  UNAUTHENTICATED (bad proof, expired credential), PERMISSION_DENIED (wrong caller, operator
  role, banned renewal), FAILED_PRECONDITION (unknown or used challenge, preflight not run),
  RESOURCE_EXHAUSTED (rate limit, with ``retry-after`` trailing metadata).
- Decisions live in auth/policy.py; this module does I/O and bookkeeping. One asyncio loop, no
  locks: every handler's state change happens between awaits.
- Admitted workers are kept in ``admitted.json`` beside the CA, so a restarted authorizer keeps
  its slots and ``agora-node authorizer list`` shows them.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import secrets
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Optional

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.admitted import ADMITTED_FILE, AdmittedNode, read_admitted
from agora.auth.authority import DEFAULT_CREDENTIAL_LIFETIME_S, RunAuthority
from agora.auth.challenges import ChallengeBook, ChallengeError, ChallengeState
from agora.auth.credentials import Clock, CredentialError, CredentialVerifier, issue_credential, load_chain
from agora.auth.keys import node_key_problem, peer_id_of, write_private_file
from agora.auth.dialback import dial_back
from agora.auth.limits import JoinRateLimiter
from agora.auth.policy import (ContributorSlots, Floors, LinkMeasurement, Refusal, assign_stage, check_announce,
                               check_floors, proof_is_valid, run_payload, sign_proof, upload_mbit)
from agora.pipeline.fingerprint import FingerprintMismatch, RunFingerprint
from agora.protos.authorizer_adapter import (DOWNLOAD_CHUNK_BYTES, Admitted, Challenge, ChallengeRequest,
                                             JoinReply, JoinRequest, LatencyProbe, Payload, Queued, RenewReply,
                                             RenewRequest, RunDescription, RunRequest, TransferControl,
                                             UploadReceipt, signed_payload)
from agora.protos.authorizer_adapter import Refused as RefusedReply

__all__ = ["AuthorizerSettings", "AuthorizerService", "JOIN_ROLES", "caller_address"]

logger = logging.getLogger(__name__)

JOIN_ROLES = ("worker", "trainer", "monitor", "client")  # operator credentials are minted offline only
_MAX_KEY_PEM, _MAX_CHAIN_PEM = 4096, 16384


@dataclass(frozen=True)
class AuthorizerSettings:
    floors: Floors = Floors()
    max_workers: Optional[int] = None  # None: no cap
    credential_lifetime_s: float = DEFAULT_CREDENTIAL_LIFETIME_S
    challenge_ttl_s: float = 60.0
    latency_probes: int = 5
    download_bytes: int = 8 << 20
    upload_bytes: int = 8 << 20
    join_rate_per_s: float = 0.5
    join_burst: int = 10
    dialback_timeout_s: float = 3.0
    queue_retry_after_s: float = 5.0
    measurement_ttl_s: float = 600.0  # a queued node's preflight stays valid this long
    # Roles a node may join as by itself; the others only with a credential the operator mints
    # (`authorizer issue`), which renews as usual. A trainer chooses the data and the targets of
    # the gradients it sends, so an open run may keep trainers to its operator's machines.
    join_roles: tuple[str, ...] = JOIN_ROLES

    def validate(self) -> "AuthorizerSettings":
        self.floors.validate()
        if self.credential_lifetime_s < 5:
            raise ValueError(f"--credential-lifetime: at least 5 s, got {self.credential_lifetime_s}")
        if self.latency_probes < 1 or self.download_bytes < 1 or self.upload_bytes < 1:
            raise ValueError("--preflight-bytes / latency probes: expected positive values")
        if self.max_workers is not None and self.max_workers < 1:
            raise ValueError(f"--max-workers: expected at least 1, got {self.max_workers}")
        if not (self.join_rate_per_s > 0 and self.join_burst >= 1):
            raise ValueError(f"--join-rate/--join-burst: expected a positive rate and a burst of at least 1, got "
                             f"{self.join_rate_per_s}, {self.join_burst}")
        if not (self.queue_retry_after_s > 0 and self.challenge_ttl_s > 0 and self.dialback_timeout_s > 0):
            raise ValueError("--queue-retry-after: expected a positive number of seconds")
        unknown = [role for role in self.join_roles if role not in JOIN_ROLES]
        if unknown or not self.join_roles:
            raise ValueError(f"--join-roles: expected some of {', '.join(JOIN_ROLES)}, got {', '.join(self.join_roles)}")
        return self



class _Status(Exception):
    """A gRPC status to answer with (raised anywhere below a handler)."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: Optional[float] = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


_CHALLENGE_STATUS = {"unknown": grpc.StatusCode.FAILED_PRECONDITION, "wrong_caller": grpc.StatusCode.PERMISSION_DENIED,
                     "full": grpc.StatusCode.RESOURCE_EXHAUSTED}


def _answers(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Turn `_Status` (and policy's ChallengeError) into the call's status."""
    async def wrapped(self: "AuthorizerService", *args: Any) -> Any:
        context = args[-1]
        try:
            return await handler(self, *args)
        except ChallengeError as error:
            status = _Status(_CHALLENGE_STATUS[error.kind], str(error))
        except _Status as error:
            status = error
        metadata = () if status.retry_after_s is None else (("retry-after", f"{status.retry_after_s:.1f}"),)
        logger.debug("authorizer: %s to %s: %s", status.code.name, context.peer(), status.message)
        await context.abort(status.code, status.message, trailing_metadata=metadata)
    wrapped.__name__, wrapped.__doc__ = handler.__name__, handler.__doc__
    return wrapped


def caller_address(peer: str) -> str:
    """The IP address in a grpc peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5")."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer



class AuthorizerService:
    """Implements protos/authorizer_adapter.AuthorizerHandler for one run."""

    def __init__(self, authority: RunAuthority, settings: AuthorizerSettings, *, run_config: Mapping[str, Any],
                 fingerprint: RunFingerprint, initial_peers: tuple[str, ...] = (),
                 stage_throughput: Optional[Callable[[], Mapping[int, float] | Awaitable[Mapping[int, float]]]] = None,
                 clock: Clock = time.time, timer: Clock = time.perf_counter,
                 random_bytes: Callable[[int], bytes] = secrets.token_bytes,
                 dial: Callable[[str, int, bytes, float], Awaitable[Optional[str]]] = dial_back):
        self.authority = authority
        self.settings = settings.validate()
        self.config_json = json.dumps(dict(run_config), sort_keys=True)
        self.fingerprint = fingerprint
        self.initial_peers = tuple(initial_peers)
        self._stage_throughput = stage_throughput or self._workers_per_stage
        self._clock, self._timer, self._dial = clock, timer, dial
        self._verifier = CredentialVerifier(authority.root_pem, authority.run_id, clock=clock)
        self._challenges = ChallengeBook(settings.challenge_ttl_s, random_bytes=random_bytes)
        self._limiter = JoinRateLimiter(settings.join_rate_per_s, settings.join_burst)
        self._slots = ContributorSlots(settings.max_workers, stale_s=3 * settings.queue_retry_after_s + 10)
        self._measured: dict[str, tuple[str, LinkMeasurement, float]] = {}  # peer -> (caller, link, at)
        self._download_block = random_bytes(DOWNLOAD_CHUNK_BYTES)  # incompressible
        self._admitted: dict[str, AdmittedNode] = {}
        now = clock()
        for node in read_admitted(authority.directory):
            if node.expires_at > now:
                self._admitted[node.peer_id] = node
                if node.role == "worker":
                    self._slots.hold(node.peer_id, node.expires_at)

    # ---- bookkeeping

    def admitted(self) -> list[AdmittedNode]:
        now = self._clock()
        return [node for node in self._admitted.values() if node.expires_at > now]

    def _workers_per_stage(self) -> Mapping[int, float]:
        return Counter(node.stage for node in self.admitted() if node.role == "worker")

    def _persist(self) -> None:
        now = self._clock()
        self._admitted = {peer: node for peer, node in self._admitted.items() if node.expires_at > now}
        entries = [asdict(node) for node in self._admitted.values()]
        write_private_file(self.authority.directory / ADMITTED_FILE, json.dumps(entries, indent=1).encode(),
                           mode=0o644)

    def _forget(self, peer_id: str) -> None:
        """A banned peer: its slot frees now, and `list` stops showing it."""
        self._slots.release(peer_id)
        if self._admitted.pop(peer_id, None) is not None:
            self._persist()

    def _refresh_slots(self, now: float) -> None:
        """Free the slots of expired and banned workers."""
        self._slots.expire(now)
        for peer in [p for p in self._slots.admitted if self.authority.is_banned(p)]:
            self._forget(peer)

    # ---- run and challenges

    @_answers
    async def get_run(self, request: RunRequest, context: Any) -> RunDescription:
        return RunDescription(run_id=self.authority.run_id, config_json=self.config_json,
                              fingerprint=self.fingerprint.text(), root_pem=self.authority.root_pem)

    @_answers
    async def get_challenge(self, request: ChallengeRequest, context: Any) -> Challenge:
        caller, now = caller_address(context.peer()), self._clock()
        wait = self._limiter.acquire(caller, now)
        if wait > 0:
            raise _Status(grpc.StatusCode.RESOURCE_EXHAUSTED, f"rate limit: too many join attempts from {caller}; "
                                                               f"retry after {wait:.1f} s", retry_after_s=wait)
        _check_role(request.role, self.settings.join_roles, request.renewal)
        preflight = request.role == "worker" and not request.renewal and self._fresh_link(request.peer_id, caller,
                                                                                           now) is None
        s = self.settings
        state = self._challenges.issue(caller, request.role, request.renewal, now,
                                       latency_probes=s.latency_probes if preflight else 0,
                                       download_bytes=s.download_bytes if preflight else 0,
                                       upload_bytes=s.upload_bytes if preflight else 0)
        return Challenge(nonce=state.nonce, dial_token=state.dial_token, expires_in_s=s.challenge_ttl_s,
                         latency_probes=state.latency_probes, download_bytes=state.download_bytes,
                         upload_bytes=state.upload_bytes)

    def _fresh_link(self, peer_id: str, caller: str, now: float) -> Optional[LinkMeasurement]:
        for peer in [p for p, (_, _, at) in self._measured.items() if now - at > self.settings.measurement_ttl_s]:
            del self._measured[peer]
        entry = self._measured.get(peer_id)
        return entry[1] if entry is not None and entry[0] == caller else None

    async def _open(self, stream: AsyncIterator[Any], context: Any, what: str, kind: str) -> ChallengeState:
        """The challenge a preflight stream names in its first message; each kind runs once."""
        try:
            first = await asyncio.wait_for(anext(stream, None), self.settings.challenge_ttl_s)
        except asyncio.TimeoutError:
            first = None
        if first is None:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: the stream must open with the challenge nonce")
        state = self._challenges.peek(first.nonce, caller_address(context.peer()), self._clock())
        size = {"latency": state.latency_probes, "download": state.download_bytes, "upload": state.upload_bytes}[kind]
        done = {"latency": bool(state.rtts_s), "download": state.download is not None,
                "upload": state.upload is not None}[kind]
        if size == 0 or done:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{what}: {'already measured' if done else 'not part of'} this challenge")
        return state

    # ---- preflight, timed here

    async def _within(self, state: ChallengeState, awaitable: Awaitable[Any], what: str) -> Any:
        """Await one step of a preflight stream, bounded by the challenge's expiry."""
        try:
            return await asyncio.wait_for(awaitable, max(1e-3, state.expires_at - self._clock()))
        except asyncio.TimeoutError:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{what}: not finished before the challenge expired") from None

    @_answers
    async def measure_latency(self, probes: AsyncIterator[LatencyProbe],
                              send: Callable[[LatencyProbe], Awaitable[None]], context: Any) -> None:
        state = await self._open(probes, context, "latency", "latency")
        samples = []
        for sequence in range(state.latency_probes):
            start = self._timer()
            await self._within(state, send(LatencyProbe(sequence=sequence)), "latency")
            echo = await self._within(state, anext(probes, None), "latency")
            if echo is None or echo.sequence != sequence:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"latency: expected the echo of probe {sequence}")
            samples.append(self._timer() - start)
        state.rtts_s = samples

    @_answers
    async def measure_download(self, controls: AsyncIterator[TransferControl],
                               send: Callable[[Payload], Awaitable[None]], context: Any) -> None:
        state = await self._open(controls, context, "download", "download")
        start, sent = self._timer(), 0
        while sent < state.download_bytes:
            piece = self._download_block[:min(DOWNLOAD_CHUNK_BYTES, state.download_bytes - sent)]
            sent += len(piece)
            await self._within(state, send(Payload(data=piece, last=sent == state.download_bytes)), "download")
        ack = await self._within(state, anext(controls, None), "download")
        elapsed = self._timer() - start
        if ack is None:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "download: the stream ended without an acknowledgement")
        state.download = (min(ack.received_bytes, sent), elapsed)

    @_answers
    async def measure_upload(self, chunks: AsyncIterator[Payload], context: Any) -> UploadReceipt:
        state = await self._open(chunks, context, "upload", "upload")
        start, received = self._timer(), 0
        while (chunk := await self._within(state, anext(chunks, None), "upload")) is not None:
            received += len(chunk.data)
            if received > state.upload_bytes:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT,
                              f"upload: more than the challenge's {state.upload_bytes} bytes")
        elapsed = self._timer() - start
        state.upload = (received, elapsed)
        return UploadReceipt(received_bytes=received, mbit_per_s=upload_mbit(received, elapsed))

    # ---- join

    @_answers
    async def join(self, request: JoinRequest, context: Any) -> JoinReply:
        caller, now = caller_address(context.peer()), self._clock()
        state = self._challenges.consume(request.nonce, caller, now)
        if state.renewal:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, "challenge: issued for a renewal, not a join")
        _check_role(request.role, self.settings.join_roles, state.renewal)
        if request.role != state.role:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT,
                          f"role: the challenge was requested for a {state.role or 'node without role'}")
        public_key = _public_key(request.public_key_pem)
        if not proof_is_valid(public_key, signed_payload(request), request.signature):
            raise _Status(grpc.StatusCode.UNAUTHENTICATED,
                          "proof of possession failed: the signature does not verify with public_key_pem")
        peer_id = peer_id_of(public_key)
        outcome = await self._decide(request, state, peer_id, caller, now)
        if isinstance(outcome, JoinReply):
            return outcome
        stage, link = outcome
        return JoinReply(admitted=self._admit(request, public_key, peer_id, stage, caller, link, self._clock()))

    async def _decide(self, request: JoinRequest, state: ChallengeState, peer_id: str, caller: str,
                      now: float) -> JoinReply | tuple[Optional[int], Optional[LinkMeasurement]]:
        """Refuse or queue (a reply), or the stage and link of an admission."""
        def refused(refusal: Refusal) -> JoinReply:
            logger.info("authorizer: refused %s %s from %s: %s", request.role, peer_id[:16], caller, refusal.reason)
            return JoinReply(refused=RefusedReply(reason=refusal.reason, field=refusal.field))

        ban = self.authority.is_banned(peer_id)
        if ban is not None:
            self._forget(peer_id)
            return refused(Refusal("banned", f"banned: {ban.reason or 'by the operator'}"))
        try:
            self.fingerprint.check(request.fingerprint)
        except FingerprintMismatch as mismatch:
            return refused(Refusal(f"fingerprint.{mismatch.field}", str(mismatch)))
        except ValueError as error:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"fingerprint: {error}") from None
        if request.role != "worker":
            if request.stage is not None:
                raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"stage: a {request.role} hosts no stage")
            return None, None
        if request.stage is not None and not 0 <= request.stage < self.fingerprint.stages:
            return refused(assign_stage(self.fingerprint.stages, {}, request.stage))
        announce = check_announce(request.announce_host, request.announce_port)
        if announce is not None:
            return refused(announce)
        if request.hardware is None:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, "hardware: a worker must report its hardware")
        link = self._link(state, peer_id, caller, now)
        below = check_floors(self.settings.floors, request.hardware, link)
        if below is not None:
            return refused(below)
        address = _host_port(request.announce_host, request.announce_port)
        problem = await self._dial(request.announce_host, request.announce_port, state.dial_token,
                                   self.settings.dialback_timeout_s)
        if problem is not None:
            return refused(Refusal("reachability", (
                f"reachability: the authorizer could not reach {address} ({problem}): open TCP port "
                f"{request.announce_port} on {request.announce_host} to the internet / forward it from your router "
                f"to this machine, or pass --announce-host with your public address")))
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
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION, "preflight: no recent measurements for this node; "
                                                                   "request a new challenge and run its preflight")
            return link
        link = state.link()
        if link is None:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, "preflight: run the challenge's latency, download and "
                                                               "upload measurements before Join")
        for what, (count, _), expected in (("download", state.download, state.download_bytes),
                                           ("upload", state.upload, state.upload_bytes)):
            if count < expected:
                raise _Status(grpc.StatusCode.FAILED_PRECONDITION,
                              f"preflight: {what} carried {count} of the challenge's {expected} bytes")
        self._measured[peer_id] = (caller, link, now)
        return link

    async def _throughput(self) -> Mapping[int, float]:
        value = self._stage_throughput()
        return await value if inspect.isawaitable(value) else value

    def _admit(self, request: JoinRequest, public_key: rsa.RSAPublicKey, peer_id: str, stage: Optional[int],
               caller: str, link: Optional[LinkMeasurement], now: float) -> Admitted:
        lifetime = self.settings.credential_lifetime_s
        issuer = self.authority.issuing()
        chain = issue_credential(issuer, public_key, run_id=self.authority.run_id, role=request.role, stage=stage,
                                 now=now, lifetime_s=lifetime)
        expires_at = min(now + lifetime, issuer.not_after)
        signature = sign_proof(issuer.key, run_payload(self.authority.run_id, self.config_json, self.initial_peers,
                                                       chain))
        address = _host_port(request.announce_host, request.announce_port) if request.role == "worker" else caller
        self._admitted[peer_id] = AdmittedNode(
            peer_id=peer_id, role=request.role, stage=stage, address=address,
            device=request.hardware.device if request.hardware else "", admitted_at=now, expires_at=expires_at,
            **({} if link is None else {"rtt_ms": round(link.rtt_ms, 3), "upload_mbit": round(link.upload_mbit, 1),
                                        "download_mbit": round(link.download_mbit, 1)}))
        if request.role == "worker":
            self._slots.hold(peer_id, expires_at)
        self._persist()
        logger.info("authorizer: admitted %s%s %s at %s", request.role, "" if stage is None else f" stage {stage}",
                    peer_id[:16], address)
        return Admitted(credential_pem=chain, root_pem=self.authority.root_pem, run_id=self.authority.run_id,
                        role=request.role, stage=stage, lifetime_s=expires_at - now, config_json=self.config_json,
                        initial_peers=self.initial_peers, run_signature=signature)

    # ---- renewal

    @_answers
    async def renew(self, request: RenewRequest, context: Any) -> RenewReply:
        caller, now = caller_address(context.peer()), self._clock()
        state = self._challenges.consume(request.nonce, caller, now)
        if not state.renewal:
            raise _Status(grpc.StatusCode.FAILED_PRECONDITION, "challenge: issued for a join, not a renewal")
        if len(request.credential_pem) > _MAX_CHAIN_PEM:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"credential_pem: longer than {_MAX_CHAIN_PEM} bytes")
        try:
            identity = self._verifier.verify(request.credential_pem)
        except CredentialError as error:
            code = grpc.StatusCode.INVALID_ARGUMENT if error.reason == "malformed" else grpc.StatusCode.UNAUTHENTICATED
            hint = ": join again" if error.reason == "expired" else ""
            raise _Status(code, f"{error}{hint}") from None
        public_key = load_chain(request.credential_pem)[0].public_key()
        problem = node_key_problem(public_key)
        if problem is not None:
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"credential_pem: its key: {problem}")
        if not proof_is_valid(public_key, signed_payload(request), request.signature):
            raise _Status(grpc.StatusCode.UNAUTHENTICATED,
                          "proof of possession failed: the signature does not verify with the credential's key")
        ban = self.authority.is_banned(identity.peer_id)
        if ban is not None:
            self._forget(identity.peer_id)
            raise _Status(grpc.StatusCode.PERMISSION_DENIED, f"banned: {ban.reason or 'by the operator'}")
        if identity.role not in JOIN_ROLES:
            raise _Status(grpc.StatusCode.PERMISSION_DENIED, "an operator credential is not renewed: mint a new one "
                                                             "with `agora-node authorizer issue`")
        issuer = self.authority.issuing()
        lifetime = self.settings.credential_lifetime_s
        chain = issue_credential(issuer, public_key, run_id=self.authority.run_id, role=identity.role,
                                 stage=identity.stage, now=now, lifetime_s=lifetime)
        expires_at = min(now + lifetime, issuer.not_after)
        if identity.peer_id in self._slots.admitted:
            self._slots.hold(identity.peer_id, expires_at)
        known = self._admitted.get(identity.peer_id)
        if known is not None:
            self._admitted[identity.peer_id] = replace(known, expires_at=expires_at)
            self._persist()
        logger.debug("authorizer: renewed %s", identity.describe())
        return RenewReply(credential_pem=chain, lifetime_s=expires_at - now)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_role(role: str, join_roles: tuple[str, ...], renewal: bool) -> None:
    if role in JOIN_ROLES and role not in join_roles and not renewal:
        raise _Status(grpc.StatusCode.PERMISSION_DENIED,
                      f"role: this run admits {role}s with a credential from its operator only (`agora-node authorizer "
                      f"issue --role {role}`); it admits {', '.join(join_roles)} nodes that join by themselves")
    if role == "operator":
        raise _Status(grpc.StatusCode.PERMISSION_DENIED, "role: operator credentials are minted offline with "
                                                         "`agora-node authorizer issue`, never through Join")
    if role not in JOIN_ROLES:
        raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"role: expected one of {', '.join(JOIN_ROLES)}, "
                                                        f"got {role[:40]!r}")


def _public_key(pem: bytes) -> rsa.RSAPublicKey:
    if len(pem) > _MAX_KEY_PEM:
        raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: longer than {_MAX_KEY_PEM} bytes")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as error:
        raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: not a PEM public key ({error})") from None
    problem = node_key_problem(key)
    if problem is not None:
        raise _Status(grpc.StatusCode.INVALID_ARGUMENT, f"public_key_pem: {problem}")
    return key
