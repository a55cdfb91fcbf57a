"""DHT tokens that name a credential chain the counterparty holds instead of carrying it
(dht/chain_references.py, dht/token_authorizer.py): what a receiver accepts and refuses, how many
bytes a token costs, and how a peer that restarted (and so holds nothing) is served again.

The authorizers' exchanges run without a network first (sign, validate, as hivemind's RPC wrapper
calls them); then two real admitted DHT peers, one restarted in a new process with the same key.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import socket
import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken

from agora.auth.authority import RunAuthority
from agora.auth.node_state import NodeCredentials
from agora.dht import SwarmDHT, WorkerRecord
from agora.dht.chain_references import chain_digest, reference_digest, reference_of
from agora.dht.security import CredentialTokenAuthorizer, DHTSecurity
from agora.pipeline.fingerprint import RunFingerprint
from polling import eventually

pytestmark = pytest.mark.timeout(120)

RUN = "refrun"
FINGERPRINT = RunFingerprint(seed=0, stages=2, basis="b0", data="d0", config="c0").text()


@pytest.fixture(scope="module")
def authority(tmp_path_factory):
    return RunAuthority(tmp_path_factory.mktemp("refs") / "authority", run_id=RUN)


@pytest.fixture(scope="module")
def nodes(authority, tmp_path_factory):
    """State directories of three workers of stage 0."""
    base = tmp_path_factory.mktemp("ref-nodes")
    for name in ("a", "b", "c"):
        authority.mint(base / name, role="worker", stage=0)
    return [base / name for name in ("a", "b", "c")]


def authorizer(state_dir, authority) -> CredentialTokenAuthorizer:
    return CredentialTokenAuthorizer(state_dir, authority.root_pem, RUN)


def peer_id(state_dir) -> str:
    return NodeCredentials(state_dir, clock=time.time).peer_id


async def exchange(client: CredentialTokenAuthorizer, server: CredentialTokenAuthorizer, to: str):
    """One find RPC as hivemind's wrappers run it: (request token bytes, response token bytes, whether
    the server accepted the request, whether the client accepted the response)."""
    request = dht_pb2.FindRequest(keys=[b"k"])
    await client.sign_request(request, None, peer_id=to)
    sent = request.auth.client_access_token.ByteSize()
    if not await server.validate_request(copy.deepcopy(request)):
        client.unanswered(to)  # what our client stub does when the request is refused
        return sent, 0, False, False
    response = dht_pb2.FindResponse()
    await server.sign_response(response, request)
    returned = response.auth.service_access_token.ByteSize()
    return sent, returned, True, await client.validate_response(response, request, peer_id=to)


def test_after_one_exchange_both_tokens_name_the_chain_and_are_a_tenth_of_the_size(nodes, authority):
    a, b = authorizer(nodes[0], authority), authorizer(nodes[1], authority)

    async def scenario():
        return [await exchange(a, b, peer_id(nodes[1])) for _ in range(3)]

    first, second, third = asyncio.run(scenario())
    assert first[2:] == second[2:] == third[2:] == (True, True)
    # The first request carries a's chain (b's is unknown to a); b's reply carries b's chain, as the
    # request said it held none of b's; from then on both name their chains.
    chain_bytes = len(NodeCredentials(nodes[0], clock=time.time).current()[0])
    assert first[0] > chain_bytes and first[1] > chain_bytes
    assert second[0] < 200 and second[1] < 200 and third[:2] == second[:2]
    assert second[0] * 10 < first[0]


def test_a_name_the_receiver_does_not_hold_is_refused_and_the_next_request_carries_the_chain(nodes, authority):
    a, b = authorizer(nodes[0], authority), authorizer(nodes[1], authority)
    to_b = peer_id(nodes[1])

    async def scenario():
        await exchange(a, b, to_b)  # now each holds the other's chain
        named = await exchange(a, b, to_b)
        restarted = authorizer(nodes[1], authority)  # b's process again: same key, nothing held
        refused = await exchange(a, restarted, to_b)
        carried = await exchange(a, restarted, to_b)
        named_again = await exchange(a, restarted, to_b)
        return named, refused, carried, named_again

    named, refused, carried, named_again = asyncio.run(scenario())
    assert named[2] and not refused[2] and refused[0] == named[0]
    assert carried[2:] == (True, True) and carried[0] > 10 * named[0]
    assert named_again[2:] == (True, True) and named_again[0] == named[0]


def test_a_name_is_refused_with_another_key_and_for_a_chain_never_verified(nodes, authority):
    a, b, c = (authorizer(state_dir, authority) for state_dir in nodes)

    async def named_request(by: CredentialTokenAuthorizer, username: str, key: bytes):
        """A request signed by ``by`` whose token names ``username`` and carries ``key``."""
        request = dht_pb2.FindRequest(keys=[b"k"])
        await by.refresh_token_if_needed()
        request.auth.client_access_token.CopyFrom(AccessToken(username=username, public_key=key))
        request.auth.time = time.time()
        request.auth.nonce = b"12345678"
        request.auth.signature = by._local_private_key.sign(request.SerializeToString())
        return request

    async def scenario():
        await exchange(a, b, peer_id(nodes[1]))  # b holds a's chain
        a_chain = NodeCredentials(nodes[0], clock=time.time).current()[0]
        c_chain = NodeCredentials(nodes[2], clock=time.time).current()[0]
        c_key = c.local_public_key.to_bytes()
        # c names a's chain, signing with its own key and presenting it: the chain is a's key's.
        stolen = await named_request(c, reference_of(chain_digest(a_chain)), c_key)
        # c names its own chain, which b never verified (c never sent it to b).
        unheard = await named_request(c, reference_of(chain_digest(c_chain)), b"")
        return await b.validate_request(stolen), await b.validate_request(unheard)

    assert asyncio.run(scenario()) == (False, False)
    with pytest.raises(Exception, match="does not hold"):
        b.identity_of(AccessToken(username=reference_of(bytes(32))))


def test_a_replayed_request_that_names_its_chain_is_refused(nodes, authority):
    a, b = authorizer(nodes[0], authority), authorizer(nodes[1], authority)

    async def scenario():
        await exchange(a, b, peer_id(nodes[1]))
        request = dht_pb2.FindRequest(keys=[b"k"])
        await a.sign_request(request, None, peer_id=peer_id(nodes[1]))
        assert reference_digest(request.auth.client_access_token.username) is not None
        return await b.validate_request(copy.deepcopy(request)), await b.validate_request(request)

    assert asyncio.run(scenario()) == (True, False)


# ---- real admitted DHT peers ---------------------------------------------------------------------


async def _finds_at(_dht, node, *, peer_id: str, count: int):
    """Run in a DHT process: ``count`` find RPCs at ``peer_id`` through its client stub, each
    (answered, bytes of the request's token, whether the response named its chain)."""
    results = []
    for _ in range(count):
        request = dht_pb2.FindRequest(keys=[DHTID.generate(source="anything").to_bytes()], peer=node.protocol.node_info)
        try:
            response = await node.protocol.get_stub(PeerID.from_base58(peer_id)).rpc_find(request, timeout=5)
        except Exception:
            response = None
        named = response is not None and reference_digest(response.auth.service_access_token.username) is not None
        results.append((response is not None, request.auth.client_access_token.ByteSize(), named))
    return results


def finds(sender: SwarmDHT, target_peer_id: str, count: int):
    probe = functools.partial(_finds_at, peer_id=target_peer_id, count=count)
    return sender.hivemind_dht.run_coroutine(probe, return_future=True).result(30)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def record_of(swarm: SwarmDHT) -> WorkerRecord:
    return WorkerRecord(peer_id=swarm.peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=0, n_stages=2,
                        throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0", updated_at=1.0,
                        fingerprint=FINGERPRINT)


@pytest.mark.slow
def test_real_peers_store_and_read_with_named_chains_and_serve_a_restarted_peer_after_one_refusal(nodes):
    first = SwarmDHT.start(security=DHTSecurity.from_state_dir(nodes[0]))
    port = free_port()
    second_options = dict(host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"],
                          security=DHTSecurity.from_state_dir(nodes[1]))
    second = SwarmDHT.start(initial_peers=first.visible_maddrs(), **second_options)
    restarted = None
    try:
        assert second.announce_worker(record_of(second), ttl=60)
        eventually(lambda: first.live_workers(RUN, 0) == [record_of(second)], timeout=15, what="the announce")
        # They have talked (the join, the store, the read): both tokens name the chains.
        assert all(answered and size < 200 and named for answered, size, named in finds(first, second.peer_id, 2))
        second.shutdown()
        # The same key in a new process at the same address, joining no one: it holds no chain, and
        # first believes it holds first's. The first request is refused, the next carries the chain.
        restarted = SwarmDHT.start(**second_options)
        refused, carried, named = finds(first, restarted.peer_id, 3)
        assert not refused[0]
        assert carried[0] and carried[1] > 2000
        assert named[0] and named[1] < 200 and named[2]
        assert restarted.announce_worker(record_of(restarted).replace(step=2), ttl=60)
        eventually(lambda: first.live_workers(RUN, 0) == [record_of(restarted).replace(step=2)], timeout=15,
                   what="the restarted peer's announce")
    finally:
        for swarm in (restarted, second, first):
            if swarm is not None:
                swarm.shutdown()
