"""What an admitted but hostile peer sends one DHT peer by hand: a single store RPC straight at that
peer, its value signed and its credential attached by the sender's own validators (as hivemind's
store does), carrying any record; and the unit block entries a lease squatter writes, with claims
`UnitBlockRecord.build` would never build. Straight at the peer: hivemind's own store would answer
with the sender's own copy first, and the peer's count of what it refused is then exactly what was
sent (tests/integration/test_hostile_leases.py, tests/system/test_attacks.py)."""

from __future__ import annotations

import functools
import struct
from typing import Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import MSGPackSerializer

from agora.dht.records import UnitBlockRecord
from agora.dht.swarm import SwarmDHT

# One packed claim of a unit block entry: (unit offset in the block, claimed at, expires at).
CLAIM = struct.Struct("<Hdd")


async def _store_at(_dht, node, *, target: str, key: str, subkey: str, wire: dict, expiration: float):
    """Run in the sender's DHT process: one store RPC at ``target``."""
    key_id = DHTID.generate(source=key)
    record = DHTRecord(key_id.to_bytes(), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(wire), expiration)
    value = node.protocol.record_validator.sign_value(record)
    answer = await node.protocol.call_store(PeerID.from_base58(target), [key_id], [value], expiration,
                                            subkeys=[subkey])
    return None if answer is None else list(answer)


def store_at(sender: SwarmDHT, target: str, key: str, wire: dict, *, ttl_s: float = 60.0) -> Optional[list[bool]]:
    """``sender`` stores ``wire`` under ``key`` (its own subkey) at the DHT peer ``target``: [True]
    stored, [False] refused by the target's record validator, None refused at its door (its token
    authorizer answers nothing)."""
    store = functools.partial(_store_at, target=target, key=key, subkey=sender.subkey_of(sender.peer_id),
                              wire=wire, expiration=sender.clock() + ttl_s)
    return sender.hivemind_dht.run_coroutine(store, return_future=True).result(20)


def hostile_entry(squatter: SwarmDHT, run_id: str, *, claims: bytes, updated_at: float,
                  block: int = 0) -> dict:
    """The squatter's unit block entry in wire form with any claims and time (no `build`, no checks);
    its DHT process attaches its trainer chain, as to every typed entry."""
    honest = UnitBlockRecord.build(squatter.peer_id, run_id, block, set(), {}, updated_at)
    return {**honest.to_wire(), "claims": claims}


def lease_holds(squatter: SwarmDHT, run_id: str, unit: int) -> dict[str, dict]:
    """Four entries that would hold `unit` (of block 0) against every honest claim, by name; a peer
    refuses the first two in its record validator and the last two at its door (``LEASE_ANSWERS``)."""
    now = squatter.clock()
    return {
        # Claimed at the dawn of time, expiring at its end: the earliest claim, held for good.
        "eternal": hostile_entry(squatter, run_id, claims=CLAIM.pack(unit, -1e300, 1e300), updated_at=now),
        # Dated two hours back with an ordinary lease: it would win every contest for the unit.
        "back-dated": hostile_entry(squatter, run_id, claims=CLAIM.pack(unit, now - 7200, now + 30),
                                    updated_at=now),
        # Consistent in itself, but written five minutes ago: its claim is dated back by the store's time.
        "stale": hostile_entry(squatter, run_id, claims=CLAIM.pack(unit, now - 310, now + 200),
                               updated_at=now - 300),
        # Written an hour ahead: a claim that expires then, made "later" than any honest one.
        "ahead": hostile_entry(squatter, run_id, claims=CLAIM.pack(unit, now + 3590, now + 3620),
                               updated_at=now + 3600),
    }


# What a peer answers each of `lease_holds`' entries (`store_at`'s answers).
LEASE_ANSWERS = {"eternal": [False], "back-dated": [False], "stale": None, "ahead": None}
