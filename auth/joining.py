"""A node's Join, on the authorizer: the part of ``AuthorizerService`` (auth/service.py) that admits.

Why a module of its own: a Join is the one call that takes every step of admission, in the order
auth/service.py's docstring gives (format, the challenge, the key rule and its proof, the checks
in memory, the floors on the preflight's figures, the dial-back, the slot, then the signatures and
the log write), and its dry run (auth/join_check.py) reuses those steps up to the slot. The
decisions are auth/policy.py's; this class does their I/O over the service's state.

``check_role`` is the rule on the role a caller asks for (a join or a renewal challenge, a Join):
the operator's role is never joined, and the roles ``join_roles`` leaves out only renew.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Mapping, Optional

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.admitted import AdmittedNode
from agora.auth.challenges import ChallengeState
from agora.auth.credentials import issue_credential
from agora.auth.keys import node_key_problem, peer_id_of
from agora.auth.policy import (LinkMeasurement, Refusal, assign_stage, check_announce, check_floors, proof_is_valid,
                               run_payload, sign_proof)
from agora.auth.settings import JOIN_ROLES
from agora.auth.status import Status, answers, caller_address
from agora.pipeline.fingerprint import FingerprintMismatch
from agora.protos.authorizer_adapter import Admitted, JoinReply, JoinRequest, Queued, signed_payload
from agora.protos.authorizer_adapter import Refused as RefusedReply

__all__ = ["JoinService", "check_role"]

logger = logging.getLogger("agora.auth.service")

_MAX_KEY_PEM = 4096


class JoinService:
    """Join, over the state AuthorizerService builds (its challenge book, slots, dial and log)."""

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
        check_role(request.role, self.settings.join_roles, False)
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


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_role(role: str, join_roles: tuple[str, ...], renewal: bool) -> None:
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
