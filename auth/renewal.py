"""Renew and Leave on the authorizer: the calls of a node that already holds a credential, and
how such a caller is authenticated (``_authenticated``, which a trainer's Report uses too).

Why apart from joining: these calls draw on nothing a newcomer can spend. Their challenges are
MACed nonces without a book, their rate limits are buckets of their own, and they need a live
credential of this run, a proof with its key and no ban, checked cheapest first (size, the
nonce's MAC, the cached chain, the key rule, the role, the proof, the ban). So a flood of
newcomers never makes an admitted node's renewal fail, and reading this module alone shows it.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from dataclasses import replace
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.challenges import ChallengeError
from agora.auth.credentials import CredentialError, Identity, load_chain
from agora.auth.keys import node_key_problem
from agora.auth.policy import proof_is_valid
from agora.auth.settings import JOIN_ROLES
from agora.auth.status import Status, answers, caller_address
from agora.protos.authorizer_adapter import (LeaveReceipt, LeaveRequest, RenewReply, RenewRequest, WorkerReport,
                                             signed_payload)

__all__ = ["RenewalService"]

logger = logging.getLogger("agora.auth.service")

_MAX_CHAIN_PEM = 16384


class RenewalService:
    """Renew and Leave, over the state AuthorizerService builds (renewal nonces, buckets, slots, log)."""

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
