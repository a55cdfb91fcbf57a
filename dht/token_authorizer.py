"""``CredentialTokenAuthorizer``: the access tokens of admitted DHT peers (dht/security.py's
docstring describes what they carry and what a receiver checks)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase

from agora.auth.credentials import Clock, CredentialError, CredentialVerifier, Identity
from agora.auth.keys import hivemind_private_key, load_or_create_key
from agora.auth.node_state import NodeCredentials
from agora.dht.entry_value import record_bytes
from agora.dht.storage_bounds import STORE_CONTEXT, StoreContext
from agora.dht.store_checks import RefusedEntries, StoreTimes, refusal_kind

__all__ = ["DHT_WRITER_ROLES", "CredentialTokenAuthorizer"]

logger = logging.getLogger(__name__)

# Roles whose DHT stores are served; a monitor reads only.
DHT_WRITER_ROLES = ("worker", "trainer", "operator")
_MAX_WARNED = 256
_MAX_MATCHED = 4096  # token (credential, key) pairs remembered as matching


class CredentialTokenAuthorizer(TokenAuthorizerBase):
    """Access tokens that are the node's credential chain (see the module docstring).

    ``state_dir`` is the node's ``NodeCredentials`` directory (key and current credential);
    ``root_pem`` and ``run_id`` are what peers' tokens are checked against.
    """

    def __init__(self, state_dir: str | Path, root_pem: bytes, run_id: str, *, clock: Clock = time.time):
        super().__init__(hivemind_private_key(load_or_create_key(state_dir)))
        self.state_dir = Path(state_dir)
        self.root_pem = root_pem
        self.run_id = run_id
        self._clock = clock
        self._runtime: Optional[_Runtime] = None
        self._refresh_at = 0.0  # clock time at which the current token is past half its life
        # The run's banned peers, as this process last read them (dht/bans.py fetch_ban_list).
        self.banned: frozenset[str] = frozenset()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runtime"] = None  # rebuilt lazily in the process it lands in
        del state["_local_public_key"]  # hivemind's public key wrapper does not pickle; derived again
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local_public_key = self._local_private_key.get_public_key()

    def _state(self) -> _Runtime:
        if self._runtime is None:
            self._runtime = _Runtime(NodeCredentials(self.state_dir, clock=self._clock),
                                     CredentialVerifier(self.root_pem, self.run_id, clock=self._clock),
                                     StoreTimes(self.run_id, unwrap=record_bytes))
        return self._runtime

    @property
    def refused(self) -> RefusedEntries:
        """Stores refused for what they carry (not for their token), by kind."""
        return self._state().refused

    # ---- TokenAuthorizerBase

    async def get_token(self) -> AccessToken:
        chain, identity = self._state().credentials.current()  # CredentialError if ours is not valid
        self._refresh_at = identity.not_before + (identity.not_after - identity.not_before) / 2
        self._state().token_generation = self._state().credentials.generation
        return AccessToken(username=chain.decode("ascii"), public_key=self.local_public_key.to_bytes(),
                           expiration_time=repr(identity.not_after))

    def is_token_valid(self, access_token: AccessToken) -> bool:
        try:
            self.identity_of(access_token)
        except CredentialError as error:
            self._warn_once(error.reason, access_token, str(error))
            return False
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        runtime = self._state()
        try:
            runtime.credentials.current()  # a stat; re-reads the file only when it changed
        except CredentialError:
            return True  # get_token raises the readable reason
        return runtime.credentials.generation != runtime.token_generation or self._clock() >= self._refresh_at

    async def validate_request(self, request: Any) -> bool:
        if not await super().validate_request(request):
            return False
        if isinstance(request, dht_pb2.StoreRequest):
            identity = self.identity_of(request.auth.client_access_token)  # valid: checked just above
            if identity.role not in DHT_WRITER_ROLES:
                self._warn_once("read_only", request.auth.client_access_token,
                                f"store refused: a {identity.role} credential is read-only")
                return False
            problem = self._state().store_times.problem(request, self._clock())
            if problem is not None:
                self._state().refused.add(refusal_kind(problem, "units"),
                                          f"DHT store refused from {identity.describe()}: {problem}")
                return False
            STORE_CONTEXT.set(StoreContext.of(identity.peer_id, request))  # for the record validator
        return True

    # ---- checks

    def identity_of(self, access_token: AccessToken) -> Identity:
        """The identity a token proves, or ``CredentialError`` saying why it proves none (a banned
        peer's proves none: its requests go unanswered and its replies are ignored; this node's own
        token is exempt, so a banned node's requests still go out and are refused by the others).

        Every DHT request and reply carries a token, so a token whose key was once matched to its
        credential skips parsing the key again; the chain's validity (time, run) is checked each call.
        """
        identity = self._proven_identity(access_token)
        if identity.peer_id in self.banned and identity.peer_id != self._state().credentials.peer_id:
            raise CredentialError("banned", f"{identity.describe()} is banned by the run's operator")
        return identity

    def _proven_identity(self, access_token: AccessToken) -> Identity:
        runtime = self._state()
        seen = (access_token.username, bytes(access_token.public_key))
        if seen in runtime.matched_keys:
            return runtime.verifier.verify(seen[0].encode("ascii"))
        try:
            public_key = serialization.load_ssh_public_key(access_token.public_key)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise CredentialError("malformed", "access token: its public key is not an OpenSSH key") from None
        if not isinstance(public_key, rsa.RSAPublicKey):
            raise CredentialError("malformed", "access token: its public key is not an RSA key")
        try:
            chain = access_token.username.encode("ascii")
        except UnicodeEncodeError:
            raise CredentialError("malformed", "access token: the credential is not PEM text") from None
        identity = runtime.verifier.verify(chain, public_key=public_key)
        if len(runtime.matched_keys) >= _MAX_MATCHED:
            runtime.matched_keys.clear()
        runtime.matched_keys.add(seen)
        return identity

    def _warn_once(self, reason: str, token: AccessToken, message: str) -> None:
        # hivemind logs refusals at DEBUG; an operator wants to see the first of each kind.
        runtime = self._state()
        entry = (reason, bytes(token.public_key[-32:]))
        level = logging.DEBUG
        if entry not in runtime.warned:
            if len(runtime.warned) >= _MAX_WARNED:
                runtime.warned.clear()
            runtime.warned.add(entry)
            level = logging.WARNING
        logger.log(level, "DHT request refused: %s", message)


class _Runtime:
    """What an authorizer builds in the process it runs in (not pickled)."""

    def __init__(self, credentials: NodeCredentials, verifier: CredentialVerifier, store_times: StoreTimes):
        self.credentials = credentials
        self.verifier = verifier
        self.store_times = store_times
        self.refused = RefusedEntries()
        self.token_generation = -1
        self.warned: set[tuple[str, bytes]] = set()
        self.matched_keys: set[tuple[str, bytes]] = set()  # (credential, public key) pairs that matched
