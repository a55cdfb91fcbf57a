"""``CredentialTokenAuthorizer``: the access tokens of admitted DHT peers (dht/security.py's
docstring describes what they carry and what a receiver checks).

hivemind's ``TokenAuthorizerBase`` gives every message the same token; ours makes each for its
counterparty, so it names (dht/chain_references.py) a chain the counterparty holds instead of
carrying it. A request needs to know whom it goes to: ``use_peer_stubs`` makes the DHT process's
client stubs say so (``PeerStub``), and report a request that got no valid answer. A request
hivemind sends before they are installed (the first pings of a join) names no peer and carries
the full chain.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.protocol import DHTProtocol
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils.auth import TokenAuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from agora.auth.credentials import Clock, CredentialError, CredentialVerifier, Identity
from agora.auth.keys import hivemind_private_key, load_or_create_key
from agora.auth.node_state import NodeCredentials
from agora.dht.chain_references import ChainCache, PeerChains, chain_digest, holds, reference_digest, reference_of
from agora.dht.entry_traffic import SENT
from agora.dht.entry_value import record_bytes
from agora.dht.key_policy import ROUND_METHODS, KeyTable
from agora.dht.storage_bounds import STORE_CONTEXT, StoreContext
from agora.dht.store_checks import RefusedEntries, StoreTimes, refusal_kind

__all__ = ["DHT_WRITER_ROLES", "CredentialTokenAuthorizer", "PeerStub", "use_peer_stubs"]

logger = logging.getLogger(__name__)

# Roles whose DHT stores are served; a monitor reads only.
DHT_WRITER_ROLES = ("worker", "trainer", "operator")
_MAX_WARNED = 256
# Refusals a healthy swarm makes (a peer restarted and lost the chains it held): not warnings.
_EXPECTED_REFUSALS = ("unknown_reference",)


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
        runtime = self._state()
        chain, identity = runtime.credentials.current()  # CredentialError if ours is not valid
        self._refresh_at = identity.not_before + (identity.not_after - identity.not_before) / 2
        runtime.token_generation = runtime.credentials.generation
        runtime.own_digest = chain_digest(chain)
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

    async def sign_request(self, request: Any, service_public_key: Any, peer_id: Optional[str] = None) -> None:
        """hivemind's, with the token made for ``peer_id`` (None: a peer hivemind's own stub does not name)."""
        await self.refresh_token_if_needed()
        runtime = self._state()
        auth = request.auth
        auth.client_access_token.CopyFrom(self._token_for(refer=runtime.peers.may_refer(peer_id, runtime.own_digest),
                                                          theirs=runtime.peers.theirs(peer_id)))
        if service_public_key is not None:
            auth.service_public_key = service_public_key.to_bytes()
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(8)
        self._sign(request, auth, auth.client_access_token)

    async def validate_request(self, request: Any) -> bool:
        token = request.auth.client_access_token
        self._restore_key(token)
        if not await super().validate_request(request):
            return False
        identity = self.identity_of(token)  # valid: checked just above
        self._heard(identity, token)
        if isinstance(request, dht_pb2.StoreRequest):
            if identity.role not in DHT_WRITER_ROLES:
                self._warn_once("read_only", token, f"store refused: a {identity.role} credential is read-only")
                return False
            problem = self._state().store_times.problem(request, self._clock())
            if problem is not None:
                self._state().refused.add(refusal_kind(problem, "units"),
                                          f"DHT store refused from {identity.describe()}: {problem}")
                return False
            STORE_CONTEXT.set(StoreContext.of(identity.peer_id, request))  # for the record validator
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        """hivemind's, with a token that names our chain if the request said it holds it."""
        await self.refresh_token_if_needed()
        asked = request.auth.client_access_token  # validated: the requester's chain is held
        auth = response.auth
        auth.service_access_token.CopyFrom(self._token_for(
            refer=holds(bytes(asked.signature), self._state().own_digest), theirs=_digest_named(asked)))
        auth.nonce = request.auth.nonce
        self._sign(response, auth, auth.service_access_token)

    async def validate_response(self, response: Any, request: Any, peer_id: Optional[str] = None) -> bool:
        token = response.auth.service_access_token
        self._restore_key(token)
        if not await super().validate_response(response, request):
            if peer_id is not None:
                self.unanswered(peer_id)
            return False
        self._heard(self.identity_of(token), token)
        return True

    def unanswered(self, peer_id: str) -> None:
        """A request to ``peer_id`` got no valid response: its next one carries our chain."""
        self._state().peers.unanswered(peer_id)

    # ---- tokens for a counterparty

    def _token_for(self, *, refer: bool, theirs: Optional[bytes]) -> AccessToken:
        """Our token, naming our chain if ``refer``, saying which chain of the counterparty we hold.

        That tag rides in ``signature``: hivemind's base class never reads a token's signature (it
        is the field for an authorizer service's signature of the token, which admission by a
        credential does not need), it is bytes, and the message's signature covers it. An older
        agora peer ignores it, so it never names a chain to one and is served full chains.
        """
        runtime, local = self._state(), self._local_access_token
        username = reference_of(runtime.own_digest) if refer else local.username
        return AccessToken(username=username, public_key=local.public_key, expiration_time=local.expiration_time,
                           signature=runtime.chains.tag_of(theirs))

    def _sign(self, message: Any, auth: Any, token: AccessToken) -> None:
        """Sign ``message`` with the node key; a token naming our chain then leaves out our key (the
        chain certifies it, the receiver puts it back before checking: ``_restore_key``)."""
        assert auth.signature == b""
        auth.signature = self._local_private_key.sign(message.SerializeToString())
        if reference_digest(token.username) is not None:
            token.ClearField("public_key")

    def _restore_key(self, token: AccessToken) -> None:
        """Put back the key a token naming a held chain left out (an unknown name is refused later)."""
        digest = reference_digest(token.username)
        held = None if digest is None or token.public_key else self._state().chains.get(digest)
        if held is not None:
            token.public_key = held[1]

    def _heard(self, identity: Identity, token: AccessToken) -> None:
        self._state().peers.heard(identity.peer_id, holds_ours=bytes(token.signature), theirs=_digest_named(token))

    # ---- checks

    def identity_of(self, access_token: AccessToken) -> Identity:
        """The identity a token proves, or ``CredentialError`` saying why it proves none (a banned
        peer's proves none: its requests go unanswered and its replies are ignored; this node's own
        token is exempt, so a banned node's requests still go out and are refused by the others).

        Every DHT request and reply carries a token, so a chain once verified with its key is held
        (``ChainCache``): a token naming it, or carrying it with that key again, skips parsing the key;
        the chain's validity (time, run) is checked each call.
        """
        identity = self._proven_identity(access_token)
        if identity.peer_id in self.banned and identity.peer_id != self._state().credentials.peer_id:
            raise CredentialError("banned", f"{identity.describe()} is banned by the run's operator")
        return identity

    def _proven_identity(self, access_token: AccessToken) -> Identity:
        runtime = self._state()
        digest = reference_digest(access_token.username)
        if digest is not None:
            return self._named_identity(digest, bytes(access_token.public_key))
        try:
            chain = access_token.username.encode("ascii")
        except UnicodeEncodeError:
            raise CredentialError("malformed", "access token: the credential is not PEM text") from None
        held = runtime.chains.get(chain_digest(chain))
        if held is not None and held[1] == access_token.public_key:
            return runtime.verifier.verify(chain)
        try:
            public_key = serialization.load_ssh_public_key(access_token.public_key)
        except (ValueError, TypeError, UnsupportedAlgorithm):
            raise CredentialError("malformed", "access token: its public key is not an OpenSSH key") from None
        if not isinstance(public_key, rsa.RSAPublicKey):
            raise CredentialError("malformed", "access token: its public key is not an RSA key")
        identity = runtime.verifier.verify(chain, public_key=public_key)
        runtime.chains.add(chain, bytes(access_token.public_key))
        return identity

    def _named_identity(self, digest: bytes, public_key: bytes) -> Identity:
        """The identity of a token that names a chain: one this process verified with its key."""
        held = self._state().chains.get(digest)
        if held is None:
            raise CredentialError("unknown_reference", f"access token: names credential chain {digest.hex()[:16]}... "
                                                       "that this peer does not hold (it restarted, or let it go); "
                                                       "the sender's next request carries the chain")
        chain, key = held
        if key != public_key:
            raise CredentialError("wrong_key", "access token: names a credential chain with another key")
        return self._state().verifier.verify(chain)  # its times and run, now

    def _warn_once(self, reason: str, token: AccessToken, message: str) -> None:
        # hivemind logs refusals at DEBUG; an operator wants to see the first of each kind.
        runtime = self._state()
        entry = (reason, bytes(token.public_key[-32:]) or token.username[-32:].encode())
        level = logging.DEBUG
        if entry not in runtime.warned:
            if len(runtime.warned) >= _MAX_WARNED:
                runtime.warned.clear()
            runtime.warned.add(entry)
            level = logging.INFO if reason in _EXPECTED_REFUSALS else logging.WARNING
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
        self.own_digest = b""  # our current chain's (set with the token)
        self.chains = ChainCache()  # peers' chains, verified with their keys
        self.peers = PeerChains()  # which chain each peer holds of ours, and we of theirs


def _digest_named(token: AccessToken) -> bytes:
    """The digest of the chain a (validated) token carries or names."""
    return reference_digest(token.username) or chain_digest(token.username.encode("ascii"))


class PeerStub:
    """hivemind's ``AuthRPCWrapper`` on the client side, for one peer: the authorizer makes each
    request's token for ``peer_id`` and hears of a request that got no valid response; each request
    and its response are counted in ``SENT`` (dht/entry_traffic.py)."""

    def __init__(self, stub: Any, authorizer: CredentialTokenAuthorizer, peer_id: str):
        self._stub, self._authorizer, self._peer_id = stub, authorizer, peer_id

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if not name.startswith("rpc_"):
            return method

        async def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            await self._authorizer.sign_request(request, None, peer_id=self._peer_id)
            try:
                response = await method(request, *args, **kwargs)
            except Exception:  # refused (an unknown name among them), timed out, unreachable
                self._authorizer.unanswered(self._peer_id)
                SENT.add(name, request, None)
                raise
            SENT.add(name, request, response)
            valid = await self._authorizer.validate_response(response, request, peer_id=self._peer_id)
            return response if valid else None

        return call


async def use_peer_stubs(_dht: Any, node: Any) -> bool:
    """Run in the DHT process (``run_coroutine``): its protocol's client stubs become ``PeerStub``s,
    if it runs our authorizer. Whether it did (an insecure peer has nothing to name)."""
    protocol = node.protocol
    authorizer = protocol.authorizer
    if not isinstance(authorizer, CredentialTokenAuthorizer):
        return False

    def get_stub(peer: Any) -> PeerStub:  # DHTProtocol.get_stub, with our wrapper instead of hivemind's
        return PeerStub(super(DHTProtocol, protocol).get_stub(protocol.p2p, peer), authorizer, peer.to_base58())

    protocol.get_stub = get_stub
    SENT.keys = KeyTable(authorizer.run_id, methods=ROUND_METHODS)  # what its requests are counted by
    return True
