"""A find that answers only what its asker has not seen: the entries of a key with subkeys that are
new to the asker or newer than its copies.

Design choices:

- Bytes. A holder answers hivemind's find with the key's whole dictionary: a stage's R entries of
  about 2.7 KB each (the writer's credential chain rides in every entry), and up to 20 nearest peers.
  A stage's readers read it about once a second while each entry changes once a heartbeat, so most
  of what they received they already held, and what they received grew like R, like N at a fixed
  stage count. Here the asker names what it holds (8 bytes of digest and the expiration, per entry)
  and the holder answers with the entries whose expiration is later than the asker's copy, or that
  it lacks: a heartbeat's changes, not the stage. No nearest peers: the reads that use this go to
  holders they already know (dht/holder_reads.py).
- Exactness. An entry the asker holds is left out only when the holder's copy expires no later than
  the asker's: the same entry, or an older one the asker's would win over anyway (the later
  expiration wins, hivemind's rule, tombstones included). So the asker's copies merged with the
  answer (dht/reads.py ``ReadMemory.merge``) are what the whole dictionary merged with them would
  be. The answer's expiration is the holder's whole dictionary's, so a quick read's stop rule (a
  holder as new as the newest entry this peer saw) reads it as it would the whole dictionary.
- Trust. The request is authorized as every DHT request is (this peer's DHT authorizer signs it, the
  holder's validates it, and the reverse for the answer: dht/token_authorizer.py), and the entries
  found are validated by the record validator as hivemind's find validates them, one bad entry
  refusing the answer. A holder could leave entries out, as it could of hivemind's answer.
- The message. hivemind's auth messages live in a flat ``auth.proto`` that protoc code of ours
  could not import by its package path, so the request is a message built on hivemind's own
  descriptors at import time; the answer is hivemind's ``FindResponse``.
- Digests. A full read asks every holder so that an entry one of them lacks is still found; the
  holders that are up to date then all send the same changes. So a holder may be asked for the
  digests alone (``call_find_changed_digests``: 16 bytes an entry), as Cassandra's digest reads do:
  the reader takes the entries from one holder and fetches from another only what its digests show
  that one lacked (dht/holder_reads.py).
- Chains named. An entry carries its writer's credential chain, most of its bytes; a reader asks
  again for entries it holds (each beat rewrites them), whose writers' chains it already has. So the
  request says, per entry held, which chain came with it (``seen_chains``), and the answer names
  that chain instead of carrying it; the reader puts it back before any validator sees the entry
  (dht/entry_chains.py has the format and why a holder gains nothing by it). A chain named and no
  longer held here costs one more request, naming none.
- Served and asked from the DHT process: ``attach`` (through ``run_coroutine``) registers the
  handlers on the node's p2pd and gives the protocol a ``call_find_changed`` and a
  ``call_find_changed_digests`` beside its ``call_find``. A peer that has not registered it yet (for milliseconds after its start) answers
  with an error, which the read treats as a silence.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from typing import Any, Mapping, Optional

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.proto import auth_pb2, dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.entry_chains import HeldChains, restore_all, tag_to_name
from agora.dht.entry_traffic import received_entries
from agora.dht.token_authorizer import CredentialTokenAuthorizer, PeerStub

__all__ = ["ChangedDigests", "ChangedFindRequest", "DIGESTS_HANDLER", "HANDLER", "Seen", "attach", "changed_digests",
           "changed_entries", "subkey_digest"]

logger = logging.getLogger(__name__)

# The p2pd protocol names the handlers are registered under: the changed entries, their digests alone.
HANDLER = "agora.dht.find_changed"
DIGESTS_HANDLER = "agora.dht.find_changed_digests"
# Bytes of a subkey's digest in a request: collisions among a key's few hundred entries at most are
# negligible, and one would only make the holder leave out an entry the asker then lacks until it
# changes again (a quick read's kind of miss).
_DIGEST_BYTES = 8

# What an asker holds under a key: each entry's subkey digest and expiration.
Seen = Mapping[bytes, float]


def _message_types() -> tuple[Any, Any]:
    """The request, and the digests answer: built once into protobuf's default pool."""
    pool = descriptor_pool.Default()
    names = ("agora.dht.ChangedFindRequest", "agora.dht.ChangedDigests")
    try:
        return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(name)) for name in names)
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto(name="agora/dht/changed_find.proto", package="agora.dht",
                                              syntax="proto3", dependency=[auth_pb2.DESCRIPTOR.name])
    field = descriptor_pb2.FieldDescriptorProto

    def add(message: Any, name: str, number: int, kind: int, repeated: bool = False, type_name: str = "") -> None:
        added = message.field.add(name=name, number=number, type=kind,
                                  label=field.LABEL_REPEATED if repeated else field.LABEL_OPTIONAL)
        if type_name:
            added.type_name = type_name

    request = file.message_type.add(name="ChangedFindRequest")
    add(request, "auth", 1, field.TYPE_MESSAGE, type_name="." + auth_pb2.RequestAuthInfo.DESCRIPTOR.full_name)
    add(request, "key", 2, field.TYPE_BYTES)
    add(request, "seen_subkeys", 3, field.TYPE_BYTES, repeated=True)
    add(request, "seen_expirations", 4, field.TYPE_DOUBLE, repeated=True)
    # Per seen subkey, the tag of the writer's chain the asker holds with it (b"": none): dht/entry_chains.py.
    add(request, "seen_chains", 5, field.TYPE_BYTES, repeated=True)
    digests = file.message_type.add(name="ChangedDigests")
    add(digests, "auth", 1, field.TYPE_MESSAGE, type_name="." + auth_pb2.ResponseAuthInfo.DESCRIPTOR.full_name)
    add(digests, "subkeys", 2, field.TYPE_BYTES, repeated=True)
    add(digests, "expirations", 3, field.TYPE_DOUBLE, repeated=True)
    pool.Add(file)
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(name)) for name in names)


ChangedFindRequest, ChangedDigests = _message_types()


def subkey_digest(subkey: Any) -> bytes:
    """The digest naming ``subkey`` in a request (the same in every process: msgpack is canonical for
    the strings and numbers subkeys are). Remembered: a reader names, and a holder compares, the same
    few hundred subkeys (each with its writer's key, about 400 bytes) at every read."""
    try:
        return _remembered_digest(subkey)
    except TypeError:  # an unhashable subkey: not remembered
        return _digest(subkey)


def _digest(subkey: Any) -> bytes:
    return hashlib.blake2b(MSGPackSerializer.dumps(subkey), digest_size=_DIGEST_BYTES).digest()


_remembered_digest = functools.lru_cache(maxsize=4096)(_digest)


def changed_entries(held: DictionaryDHTValue, seen: Seen) -> DictionaryDHTValue:
    """The entries of ``held`` its asker lacks or holds an older copy of, with ``held``'s newest
    expiration (a quick read compares that, not the entries')."""
    answer = DictionaryDHTValue(held.maxsize)
    for subkey, item in held.items():
        if item.expiration_time > seen.get(subkey_digest(subkey), float("-inf")):
            answer.store(subkey, item.value, item.expiration_time)
    answer.latest_expiration_time = held.latest_expiration_time
    return answer


def changed_digests(held: DictionaryDHTValue, seen: Seen) -> dict[bytes, float]:
    """What ``changed_entries`` would answer, named instead of sent: digest -> expiration."""
    return {subkey_digest(subkey): item.expiration_time for subkey, item in changed_entries(held, seen).items()}


class _Service:
    """The holder's side, one per DHT node."""

    def __init__(self, node: Any) -> None:
        self._protocol = node.protocol

    def _held(self, request: Any) -> tuple[Optional[ValueWithExpiration[Any]], dict[bytes, float]]:
        key_id = DHTID.from_bytes(request.key)
        held = self._protocol.storage.get(key_id)
        cached = self._protocol.cache.get(key_id)  # as hivemind's find: the newer of the two
        if cached is not None and (held is None or cached.expiration_time > held.expiration_time):
            held = cached
        return held, dict(zip(request.seen_subkeys, request.seen_expirations))

    @staticmethod
    def _chains_named(answer: DictionaryDHTValue, request: Any) -> DictionaryDHTValue:
        """``answer`` with the chains the asker holds named instead of carried (dht/entry_chains.py)."""
        chains = dict(zip(request.seen_subkeys, request.seen_chains))
        if not chains:
            return answer
        named = DictionaryDHTValue(answer.maxsize)
        for subkey, item in answer.items():
            asker_tag = chains.get(subkey_digest(subkey))
            short = None if asker_tag is None else tag_to_name(item.value, asker_tag)
            named.store(subkey, item.value if short is None else short, item.expiration_time)
        named.latest_expiration_time = answer.latest_expiration_time
        return named

    async def rpc_find_changed_digests(self, request: Any, _context: Any = None) -> Any:
        held, seen = self._held(request)
        if held is None or not isinstance(held.value, DictionaryDHTValue):
            return ChangedDigests()
        digests = changed_digests(held.value, seen)
        return ChangedDigests(subkeys=list(digests), expirations=list(digests.values()))

    async def rpc_find_changed(self, request: Any, _context: Any = None) -> dht_pb2.FindResponse:
        held, seen = self._held(request)
        if held is None:
            result = dht_pb2.FindResult(type=dht_pb2.NOT_FOUND)
        elif isinstance(held.value, DictionaryDHTValue):
            answer = self._chains_named(changed_entries(held.value, seen), request)
            result = dht_pb2.FindResult(type=dht_pb2.FOUND_DICTIONARY, expiration_time=held.expiration_time,
                                        value=self._protocol.serializer.dumps(answer))
        else:
            result = dht_pb2.FindResult(type=dht_pb2.FOUND_REGULAR, value=held.value,
                                        expiration_time=held.expiration_time)
        return dht_pb2.FindResponse(results=[result], peer=self._protocol.node_info)


class _Client:
    """The asker's side: the p2pd call, wrapped in the DHT's authorization like hivemind's stubs."""

    def __init__(self, p2p: Any, peer: Any, timeout: Optional[float]) -> None:
        self._p2p, self._peer, self._timeout = p2p, peer, timeout

    async def rpc_find_changed(self, request: Any) -> dht_pb2.FindResponse:
        call = self._p2p.call_protobuf_handler(self._peer, HANDLER, request, dht_pb2.FindResponse)
        return await asyncio.wait_for(call, self._timeout)

    async def rpc_find_changed_digests(self, request: Any) -> Any:
        call = self._p2p.call_protobuf_handler(self._peer, DIGESTS_HANDLER, request, ChangedDigests)
        return await asyncio.wait_for(call, self._timeout)


async def attach(_dht: Any, node: Any) -> None:
    """Run in the DHT process (``run_coroutine``): serve changed finds, and ask them through
    ``node.protocol.call_find_changed(peer_id, key_id, seen)``. Once per node: a second owner of the
    same DHT process finds them there."""
    protocol = node.protocol
    if hasattr(protocol, "call_find_changed"):
        return
    authorizer = protocol.authorizer
    service = AuthRPCWrapper(_Service(node), AuthRole.SERVICER, authorizer)

    def handler(method: str) -> Any:
        async def handle(request: Any, context: Any) -> Any:
            response = await getattr(service, method)(request, context)
            if response is None:
                raise PermissionError("the changed find's credentials were refused")
            return response
        return handle

    held_chains = HeldChains()
    protocol.held_chains = held_chains

    async def ask(method: str, peer_id: Any, key_id: DHTID, seen: Seen, *, name_chains: bool = False) -> Optional[Any]:
        """``peer_id``'s response to ``method`` (its authorization checked), or None. ``name_chains``:
        say which writers' chains this peer holds with its entries (dht/entry_chains.py)."""
        client = _Client(protocol.p2p, peer_id, protocol.wait_timeout)
        if isinstance(authorizer, CredentialTokenAuthorizer):
            stub = PeerStub(client, authorizer, peer_id.to_base58())
        else:
            stub = AuthRPCWrapper(client, AuthRole.CLIENT, authorizer)
        request = ChangedFindRequest(key=key_id.to_bytes(), seen_subkeys=list(seen),
                                     seen_expirations=list(seen.values()))
        tags = held_chains.tags(request.key) if name_chains else {}
        if tags:  # entries no longer held still name their chains: held since time 0 (dht/entry_chains.py)
            gone = [digest for digest in tags if digest not in seen]
            request.seen_subkeys.extend(gone)
            request.seen_expirations.extend([0.0] * len(gone))
            request.seen_chains.extend(tags.get(digest, b"") for digest in request.seen_subkeys)
        try:
            async with protocol.rpc_semaphore:
                return await getattr(stub, method)(request)
        except Exception as error:  # refused, unreachable, timed out, not serving changed finds yet
            logger.debug("%s of %s at %s failed: %r", method, key_id, peer_id, error)
            return None

    async def call_find_changed(peer_id: Any, key_id: DHTID, seen: Seen) -> Optional[Any]:
        """What ``peer_id`` holds under ``key_id`` that is not in ``seen``, as ``call_find`` answers:
        ``{key_id: (value or None, {})}``, or None if it did not answer validly."""
        for name_chains in (True, False):  # an answer naming a chain no longer held here: asked again, naming none
            response = await ask("rpc_find_changed", peer_id, key_id, seen, name_chains=name_chains)
            if response is None or len(response.results) != 1:
                return None
            found = _found(protocol, key_id, response.results[0], held_chains)
            if found is not _UNRESOLVED:
                return {key_id: (found, {})}
        return None

    async def call_find_changed_digests(peer_id: Any, key_id: DHTID, seen: Seen) -> Optional[dict[bytes, float]]:
        """The digests and expirations of what ``call_find_changed`` would return, or None if
        ``peer_id`` did not answer validly (a holder lacking the key names nothing)."""
        response = await ask("rpc_find_changed_digests", peer_id, key_id, seen)
        if response is None or len(response.subkeys) != len(response.expirations):
            return None
        return dict(zip(response.subkeys, response.expirations))

    await protocol.p2p.add_protobuf_handler(HANDLER, handler("rpc_find_changed"), ChangedFindRequest)
    await protocol.p2p.add_protobuf_handler(DIGESTS_HANDLER, handler("rpc_find_changed_digests"), ChangedFindRequest)
    protocol.call_find_changed = call_find_changed
    protocol.call_find_changed_digests = call_find_changed_digests


# A changed find's answer naming a chain this peer no longer holds: asked again, naming none.
_UNRESOLVED = object()


def _found(protocol: Any, key_id: DHTID, result: Any, held_chains: HeldChains) -> Any:
    """A find result as hivemind's ``call_find`` reads it: validated (named chains put back first,
    and remembered after), or None; ``_UNRESOLVED`` if it named a chain ``held_chains`` lacks."""
    key_bytes = key_id.to_bytes()
    if result.type == dht_pb2.FOUND_DICTIONARY:
        received = protocol.serializer.loads(result.value)
        with received.freeze():
            wire = {subkey: (item.value, item.expiration_time) for subkey, item in received.items()}
        restored = restore_all(held_chains, wire)
        if restored is None:
            return _UNRESOLVED
        dictionary = DictionaryDHTValue(received.maxsize)
        for subkey, (value, expiration) in restored.items():
            dictionary.store(subkey, value, expiration)
        dictionary.latest_expiration_time = received.latest_expiration_time
        if not protocol._validate_dictionary(key_bytes, dictionary):
            return None
        counter = received_entries(protocol.record_validator)
        for subkey, (value, _) in restored.items():
            digest = subkey_digest(subkey)
            held_chains.note(key_bytes, digest, value)
            added = len(value) - len(wire[subkey][0])
            if added and counter is not None:
                counter.restored(key_bytes, protocol.serializer.dumps(subkey), added)
        return ValueWithExpiration(dictionary, result.expiration_time)
    if result.type == dht_pb2.FOUND_REGULAR:
        if not protocol._validate_record(key_bytes, protocol.IS_REGULAR_VALUE, result.value, result.expiration_time):
            return None
        return ValueWithExpiration(result.value, result.expiration_time)
    return None
