"""A node's dry run of its Join (``agora-node doctor``): the run's description, and what a Join
would find (the preflight's figures against the run's floors, the dial-back, the stage), without
being admitted; and a probe credential for a link probe of the stage's members.

Design choices:

- The same path as ``admit`` (auth/admission.py), up to the Join: the root taken from the TLS
  handshake only if it matches the pinned fingerprint, GetRun checked against it, a join
  challenge, its preflight (``run_preflight``), the reachability listener on the port the node
  would announce, a signed request. Then CheckJoin instead of Join: the authorizer answers its
  verdicts and admits nobody, holds no slot (``JoinCheckService.check_join`` says what it costs).
- Both sides live here: the node's (``check_join``) and the authorizer's handler
  (``JoinCheckService``, a part of auth/service.py's ``AuthorizerService``, reusing the Join's
  steps of auth/joining.py), so what one asks and the other answers read together.
- The request is signed with a key made for the dry run, never the node's own: nothing the dry
  run does touches the state directory, so it runs beside a node of the same identity.
- The stage's members: an unadmitted node may not read the DHT (every DHT request needs a run
  credential, docs/design.md "The DHT"), so the reply carries what the authorizer knows of the
  assigned stage's members: a random sample of ``MEMBERS_SHOWN`` announced addresses, for the node
  to time its links to (a TCP connect, which needs no credential; a link probe with the probe
  credential below), and every member's announced
  compute (samples/s, at most ``MEMBER_RATES_SHOWN`` figures), for the share of the stage it would
  take. An authorizer that reads the DHT (``serve --initial-peers``) takes both from the workers'
  records; one that does not, from its admissions (the announced addresses, compute unknown: 0).
  A few addresses to a caller that passed a Join's checks and its rate limits tell no more than
  a Join would, once admitted, read from the DHT. Each member's peer id comes with its address:
  the TLS name its credential carries, which a link probe dials it by.
- The probe credential: a member's gRPC port needs mutual TLS with a credential of the run, so
  to measure its link to a member (round trips and rates each way, node/doctor_links.py) the
  node needs one. When the dry run passed the checks before the measurements and the stage has
  members to show, the reply carries a credential of role ``probe`` (auth/credentials.py) for the
  request's key (the dry run's own, proven by the request's signature) and the assigned stage,
  valid ``PROBE_LIFETIME_S``. It admits nothing: no slot, no record in the admission log, no
  renewal (Renew takes the roles nodes join as), no DHT (every DHT check takes admitted roles
  only, dht/security.py), no gRPC method but a member's bounded link probe (auth/grpc_policy.py,
  node/worker/link_probe.py). It costs the authorizer one RSA signature, on a worker thread,
  after every cheaper check of the call.
- Every stage's capacity: the same source read for each stage at once (one read per stage, the
  assigned stage's members among them), summed up per stage as its members, those of unknown
  compute, and the others' compute in all (``stage_capacity``), so the node can tell the
  pipeline's bottleneck from its own stage (node/doctor_pipeline.py). Totals only: no address of
  another stage's members is shown.
- The authorizer's clock: CheckJoin carries it, read as it answers (after the dial-back, which
  can take seconds); the skew is taken against this node's clock on receipt, less half the
  measured round trip (the reply's way back).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional, Sequence

import grpc
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.admission import authorizer_root, check_root, reachability_listener, rpc_error, run_preflight
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.credentials import CLOCK_SKEW_S, PROBE_ROLE, Clock, issue_credential
from agora.auth.keys import generate_key
from agora.auth.node_state import public_key_pem
from agora.auth.policy import assign_stage, sign_proof
from agora.auth.status import Status, answers, caller_address
from agora.protos.authorizer_adapter import (AuthorizerStub, ChallengeRequest, Hardware, JoinCheck, JoinRequest,
                                             RunDescription, RunFloors, StageCapacity, StageMember, signed_payload)
from agora.protos.authorizer_adapter import Refused as RefusedReply

__all__ = ["MEMBERS_SHOWN", "MEMBER_RATES_SHOWN", "PROBE_LIFETIME_S", "JoinCheckResult", "describe_run", "check_join",
           "sample_members", "stage_capacity", "JoinCheckService"]

logger = logging.getLogger("agora.auth.service")

# Members of the stage whose addresses a dry run shows, and the most compute figures it carries.
MEMBERS_SHOWN, MEMBER_RATES_SHOWN = 5, 256
# How long a dry run's probe credential lasts (its not-before is back-dated by CLOCK_SKEW_S, as every credential's).
PROBE_LIFETIME_S = 120.0


@dataclass(frozen=True)
class JoinCheckResult:
    check: JoinCheck
    skew_s: float  # the authorizer's clock minus this machine's (positive: this machine is behind)
    key: Optional[rsa.RSAPrivateKey] = None  # the dry run's key: the probe credential's (check.probe_credential_pem)
    root_pem: bytes = b""  # the run's root, as pinned: what members' credentials chain to


async def describe_run(address: str, root_fingerprint: str, *, rpc_timeout_s: float = 30.0) -> RunDescription:
    """The run served at ``address``, once its root checked out against ``root_fingerprint``;
    AdmissionError (one line) when the authorizer is unreachable or not the pinned one."""
    root_pem = await authorizer_root(address, root_fingerprint, rpc_timeout_s)
    async with authorizer_channel(address, root_pem) as channel:
        try:
            run = await AuthorizerStub(channel).get_run(timeout=rpc_timeout_s)
        except grpc.aio.AioRpcError as error:
            raise rpc_error(address, error) from None
    check_root(run.root_pem, address, root_fingerprint)
    return run


async def check_join(address: str, root_fingerprint: str, *, fingerprint: Callable[[dict], str], hardware: Hardware,
                     announce: tuple[str, int], listen_host: Optional[str] = None, stage: Optional[int] = None,
                     clock: Clock = time.time, rpc_timeout_s: float = 60.0) -> JoinCheckResult:
    """A worker's Join, dry run: the preflight, the dial-back to ``announce`` (a listener on
    ``listen_host``, default the announced host, on that port answers it) and the authorizer's
    verdicts. Raises AdmissionError (one line) when the authorizer is unreachable or refuses the call."""
    key = generate_key()
    root_pem = await authorizer_root(address, root_fingerprint, rpc_timeout_s)
    listening = reachability_listener(listen_host or announce[0], announce[1])
    async with authorizer_channel(address, root_pem) as channel, listening as listener:
        stub = AuthorizerStub(channel)
        try:
            run = await stub.get_run(timeout=rpc_timeout_s)
            check_root(run.root_pem, address, root_fingerprint)
            challenge = await stub.get_challenge(ChallengeRequest(role="worker"), timeout=rpc_timeout_s)
            listener.answer(challenge.dial_token)
            await run_preflight(stub, challenge, address, rpc_timeout_s)
            request = JoinRequest(nonce=challenge.nonce, public_key_pem=public_key_pem(key), role="worker",
                                  fingerprint=fingerprint(json.loads(run.config_json)), hardware=hardware,
                                  stage=stage, announce_host=announce[0], announce_port=announce[1])
            request = replace(request, signature=sign_proof(key, signed_payload(request)))
            before = clock()
            check = await stub.check_join(request, timeout=rpc_timeout_s)
            after = clock()
        except grpc.aio.AioRpcError as error:
            raise rpc_error(address, error) from None
    skew = check.server_time - (after - min(check.rtt_ms / 2e3, (after - before) / 2))
    return JoinCheckResult(check, skew, key=key, root_pem=root_pem)


def sample_members(members: Sequence[StageMember], limit: int, rng: random.Random) -> tuple[StageMember, ...]:
    """At most ``limit`` of ``members``, drawn at random (every member's link is as likely to be timed)."""
    members = list(members)
    return tuple(members if len(members) <= limit else rng.sample(members, limit))


def stage_capacity(stage: int, members: Sequence[StageMember]) -> StageCapacity:
    """Stage ``stage`` summed up: its members, those announcing no compute, the others' compute in all."""
    known = [member.samples_per_s for member in members if member.samples_per_s > 0]
    return StageCapacity(stage=stage, members=len(members), unknown_members=len(members) - len(known),
                         samples_per_s=sum(known))


class JoinCheckService:
    """CheckJoin on the authorizer, over the state AuthorizerService builds and JoinService's steps."""

    @answers
    async def check_join(self, request: JoinRequest, context: Any) -> JoinCheck:
        """What a worker's Join would find, without the Join (`agora-node doctor`): the checks before
        the measurements, the preflight's figures and the run's floors, the dial-back, the stage it
        would be assigned, and our clock; and a probe credential for the stage's members (the module
        docstring). It admits nobody, writes nothing and takes no slot, nor a place in the queue.

        Cost and bounds: exactly a Join's up to its admission. It spends a join challenge (the
        address and network buckets, the book's room in all and per network), its preflight (the
        same transfers, one at a time), a newcomer's call slot, one RSA verification (the proof of
        possession) and at most one dial-back of ``dialback_timeout_s``, to an address
        ``dialback_allowed`` accepts, answered in the same words whatever went wrong. So it dials
        no more often, nor anywhere else, than Joins already may, and tells no more about what
        listens there: no free port scanner. Beyond a Join's, it reads each stage's members once
        (the stage's DHT record, on a serving authorizer that reads the DHT); and, where it shows
        members, signs a probe credential (one RSA signature, as a Join's admission signs one)."""
        caller = caller_address(context.peer())
        with self._newcomer(caller):
            return await self._check_join(request, caller)

    async def _check_join(self, request: JoinRequest, caller: str) -> JoinCheck:
        now = self._clock()
        if request.role != "worker":
            raise Status(grpc.StatusCode.INVALID_ARGUMENT, "role: only a worker's Join has floors and a dial-back "
                                                           "to check")
        public_key, peer_id, state = self._proven(request, caller, now)
        refusal = self._vet(request, peer_id)
        if refusal is not None:
            verdict = JoinCheck(refused=RefusedReply(reason=refusal.reason, field=refusal.field))
            unreachable, stage = None, None
        else:
            link = self._link(state, peer_id, caller, now)
            unreachable = await self._unreachable(request, state)
            stage = assign_stage(self.fingerprint.stages, await self._throughput(), request.stage)
            view = await self._pipeline_view(stage)
            probe = await self._probe_credential(public_key, stage) if view["members"] else {}
            verdict = JoinCheck(rtt_ms=link.rtt_ms, download_mbit=link.download_mbit, upload_mbit=link.upload_mbit,
                                floors=RunFloors(**asdict(self.settings.floors)),
                                unreachable=unreachable[0].reason if unreachable else "", stage=stage,
                                **view, **probe)
        self._on_join_check("refused" if refusal else "unreachable" if unreachable else "reachable")
        logger.info("authorizer: checked a join of %s from %s (dry run)", peer_id[:16], caller, extra={
            "milestone": "join_checked", "fields": {
                "peer_id": peer_id, "caller": caller, "refused": refusal.field if refusal else "",
                "reachable": unreachable is None, **({"detail": unreachable[1]} if unreachable else {})}})
        return replace(verdict, server_time=self._clock(), tolerated_skew_s=CLOCK_SKEW_S)

    async def _pipeline_view(self, stage: int) -> dict[str, tuple]:
        """The assigned stage's members (a sample, and every one's compute) and every stage's capacity,
        from one read of each stage's members, all at once."""
        pipeline = await asyncio.gather(*(self._members_of(index) for index in range(self.fingerprint.stages)))
        members = pipeline[stage]
        return dict(members=sample_members(members, MEMBERS_SHOWN, random.SystemRandom()),
                    member_samples_per_s=tuple(member.samples_per_s for member in members[:MEMBER_RATES_SHOWN]),
                    stage_capacities=tuple(stage_capacity(index, found) for index, found in enumerate(pipeline)))

    async def _probe_credential(self, public_key: rsa.RSAPublicKey, stage: int) -> dict[str, Any]:
        """A probe credential for the dry run's key and ``stage``, and its lifetime (the module
        docstring); its signature runs on a worker thread, as a Join's does."""
        now = self._clock()

        def issue() -> tuple[bytes, float]:
            issuer = self.authority.issuing()
            chain = issue_credential(issuer, public_key, run_id=self.authority.run_id, role=PROBE_ROLE, stage=stage,
                                     now=now, lifetime_s=PROBE_LIFETIME_S)
            return chain, min(now + PROBE_LIFETIME_S, issuer.not_after) - now
        chain, lifetime = await asyncio.to_thread(issue)
        return dict(probe_credential_pem=chain, probe_lifetime_s=lifetime)

    async def _members_of(self, stage: int) -> list[StageMember]:
        """The stage's current members (``AuthorizerService(stage_members=...)``, else its admissions)."""
        members = self._stage_members(stage)
        return list(await members if inspect.isawaitable(members) else members)
