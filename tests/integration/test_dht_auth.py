"""Admission on the hivemind side: the DHT's token authorizer, owned and checked records, and
credentialed averaging, attacked with what a real intruder would send.

Credentials come from one module-scoped ``RunAuthority`` (plus a foreign one, another root for
the same run id). The module shares two admitted workers of stage 0 (``first`` bootstraps,
``second`` joins); each test adds at most one more DHT peer, the attacker. Tests that write
records use their own stage number so they never see each other's entries. Pure checks of the
authorizer and the record validator come first and start no process.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses
import functools
import io
import itertools
import logging
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.proto import dht_pb2
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.utils import MSGPackSerializer, get_dht_time

from agora.auth.authority import RunAuthority
from agora.auth.credentials import issue_credential
from agora.dht.security import (
    CredentialTokenAuthorizer,
    DHTSecurity,
    OwnedRecordValidator,
    OwnerSignatureValidator,
    split_credential,
)
from agora.dht.entry_value import CHAIN_MARK, credential_attachment
from agora.auth.keys import hivemind_private_key, openssh_public_key
from agora.auth.node_state import CREDENTIAL_FILE, NodeCredentials
from agora.dht import DHTRequestError, SwarmDHT, WorkerRecord, worker_key
from agora.dht.averaging import SliceAverager, round_group_bits
from agora.dht.averaging_admission import AdmissionGate, AveragingAdmission
from agora.dht.bootstrap import main as bootstrap_main
from agora.dht.bootstrap import BootstrapOptions, run_bootstrap
from agora.dht.key_families import MAX_HEARTBEAT_S
from agora.dht.keys import averaging_prefix, move_key, owned_subkey, rounds_key, trainer_key, units_key
from agora.dht.records import RoundRecord
from agora.pipeline.fingerprint import RunFingerprint
from polling import eventually
from record_samples import SAMPLES

pytestmark = pytest.mark.timeout(120)

RUN = "authrun"
OURS = RunFingerprint(seed=0, stages=2, basis="b0", data="d0", config="c0")


# ---- credentials ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tmp_path_factory.mktemp("dht-auth")


@pytest.fixture(scope="module")
def authority(dirs):
    return RunAuthority(dirs / "authority", run_id=RUN)


@pytest.fixture(scope="module")
def mint(authority, dirs):
    """mint(name, role, stage=None) -> the state directory of a node admitted to RUN."""
    def make(name: str, role: str, stage=None) -> Path:
        authority.mint(dirs / name, role=role, stage=stage)
        return dirs / name
    return make


@pytest.fixture(scope="module")
def stages():
    return itertools.count(10)


@pytest.fixture
def stage(stages, authority, worker_dirs):
    """A stage number (so a DHT key) no other test of the module writes under. The module's two
    workers hold credentials for it while the test runs (a renewal naming another stage, as a
    moved worker gets; their DHT processes pick it up at their next store), stage 0 again after."""
    number = next(stages)
    for state_dir in worker_dirs:
        authority.mint(state_dir, role="worker", stage=number)
    yield number
    for state_dir in worker_dirs:
        authority.mint(state_dir, role="worker", stage=0)


@pytest.fixture(scope="module")
def worker_dirs(mint):
    return mint("worker-a", "worker", 0), mint("worker-b", "worker", 0)


def make_record(swarm_or_peer, stage: int, **overrides) -> WorkerRecord:
    peer_id = swarm_or_peer if isinstance(swarm_or_peer, str) else swarm_or_peer.peer_id
    fields = dict(peer_id=peer_id, run_id=RUN, endpoint="127.0.0.1:50051", stage=stage, n_stages=4096,
                  throughput=10.0, queue_depth=0, step=1, phase="member", version="0.1.0", updated_at=1.0,
                  fingerprint=OURS.text())
    fields.update(overrides)
    return WorkerRecord(**fields)


# ---- the authorizer, without a network ---------------------------------------------------------


def authorizer_of(state_dir: Path, root_pem: bytes) -> CredentialTokenAuthorizer:
    return CredentialTokenAuthorizer(state_dir, root_pem, RUN)


async def signed(request, by: CredentialTokenAuthorizer):
    await by.sign_request(request, None)
    return request


def test_the_token_is_the_credential_and_only_its_key_can_use_it(authority, worker_dirs, mint, dirs):
    a_dir, b_dir = worker_dirs
    a, b = authorizer_of(a_dir, authority.root_pem), authorizer_of(b_dir, authority.root_pem)
    token = asyncio.run(a.get_token())
    chain, identity = NodeCredentials(a_dir, clock=time.time).current()
    assert token.username.encode() == chain and float(token.expiration_time) == identity.not_after
    assert token.public_key == openssh_public_key(NodeCredentials(a_dir, clock=time.time).key)
    assert b.is_token_valid(token) and b.identity_of(token).role == "worker"
    # The chain presented with another key (b's): the credential is bound to a's key.
    stolen = AccessToken(username=token.username, public_key=b.local_public_key.to_bytes())
    assert not b.is_token_valid(stolen)
    with pytest.raises(Exception, match="presented with another key"):
        b.identity_of(stolen)
    # It survives pickling into hivemind's process and still works there.
    copied = pickle.loads(pickle.dumps(a))
    assert copied.is_token_valid(token) and copied.local_public_key.to_bytes() == token.public_key
    # Renewal: the main process replaces credential.pem; the token is refreshed.
    assert not a.does_token_need_refreshing(token)
    authority.mint(a_dir, role="worker", stage=0)
    assert a.does_token_need_refreshing(token)
    renewed = asyncio.run(a.get_token())
    assert renewed.username != token.username and not a.does_token_need_refreshing(renewed)


def test_a_monitor_may_find_but_not_store_and_a_replayed_request_is_refused(authority, worker_dirs, mint):
    worker = authorizer_of(worker_dirs[0], authority.root_pem)
    monitor = authorizer_of(mint("monitor-unit", "monitor"), authority.root_pem)

    async def scenario():
        store = await signed(dht_pb2.StoreRequest(keys=[b"k"], subkeys=[b""], values=[b"v"]), monitor)
        find = await signed(dht_pb2.FindRequest(keys=[b"k"]), monitor)
        own_store = await signed(dht_pb2.StoreRequest(keys=[b"k"], subkeys=[b""], values=[b"v"]), worker)
        replay = copy.deepcopy(own_store)
        return [await worker.validate_request(store), await worker.validate_request(find),
                await worker.validate_request(own_store), await worker.validate_request(replay)]

    assert asyncio.run(scenario()) == [False, True, True, False]


# ---- the record validator, without a network -------------------------------------------------


def signing_validator(state_dir: Path, root_pem: bytes) -> CompositeValidator:
    """What an admitted node's DHT process runs: it signs with that node's key and attaches its credential."""
    key = NodeCredentials(state_dir, clock=time.time).key
    return CompositeValidator([OwnerSignatureValidator(hivemind_private_key(key)),
                               OwnedRecordValidator(RUN, root_pem, state_dir=state_dir)])


def stored_entry(validator: CompositeValidator, key: str, subkey, value, expires_in: float = 30.0) -> DHTRecord:
    record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                       MSGPackSerializer.dumps(value), time.time() + expires_in)
    return dataclasses.replace(record, value=validator.sign_value(record))


def subkey_of(state_dir: Path) -> str:
    node = NodeCredentials(state_dir, clock=time.time)
    return owned_subkey(node.peer_id, openssh_public_key(node.key).decode())


def test_the_record_validator_admits_only_owned_well_formed_entries(authority, worker_dirs):
    nodes = [NodeCredentials(d, clock=time.time) for d in worker_dirs]
    a_key, (a_id, b_id) = nodes[0].key, [n.peer_id for n in nodes]
    validator = signing_validator(worker_dirs[0], authority.root_pem)  # a worker of stage 0
    key = DHTID.generate(source=worker_key(RUN, 0)).to_bytes()
    owner = openssh_public_key(a_key).decode()

    def entry(value, subkey=owned_subkey(a_id, owner), key=key, sign=True, expires_in=30.0):
        record = DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
                           time.time() + expires_in)
        if sign:
            record = dataclasses.replace(record, value=validator.sign_value(record))
        return record

    good = make_record(a_id, 0).to_wire()
    assert validator.validate(entry(good))
    assert validator.validate(entry(None))  # the owner's tombstone
    refused = {
        "a key of no family": entry(good, key=DHTID.generate(source="elsewhere").to_bytes()),
        "unsigned subkey": entry(good, subkey=a_id),
        "no signature": entry(good, sign=False),
        "plain value": DHTRecord(key, MSGPackSerializer.dumps(None), MSGPackSerializer.dumps(good), 1e12),
        "another peer's id": entry(make_record(b_id, 0).to_wire(), subkey=owned_subkey(b_id, owner)),
        "record of another peer": entry(make_record(b_id, 0).to_wire()),
        "another stage": entry(make_record(a_id, 2).to_wire()),
        "garbage": entry({"schema": 2, "kind": "worker", "peer_id": a_id}),
        "another record type": entry(SAMPLES["trainer"].replace(peer_id=a_id, run_id=RUN).to_wire()),
        "not a key": entry(good, subkey=owned_subkey(a_id, "ssh-rsa AAAAnotakey")),
        "expires in a year": entry(good, expires_in=365 * 24 * 3600.0),
        "a tombstone for a year": entry(None, expires_in=365 * 24 * 3600.0),
        "expires in an hour": entry(good, expires_in=3600.0),  # a dead member's record kept alive
    }
    # Three of the longest heartbeats is what a worker's announce may live (4 beats and the skew the bound).
    assert validator.validate(entry(good, expires_in=3 * MAX_HEARTBEAT_S))
    assert {name: validator.validate(record) for name, record in refused.items()} == dict.fromkeys(refused, False)


@pytest.fixture(scope="module")
def writers(mint, worker_dirs):
    """A state directory per credential a record's writer may hold."""
    return {"worker of stage 0": worker_dirs[0], "worker of stage 1": mint("worker-s1", "worker", 1),
            "trainer": mint("trainer-w", "trainer"), "operator": mint("operator-w", "operator"),
            "monitor": mint("monitor-w", "monitor"), "client": mint("client-w", "client")}


# Each sample's rightful writer: the samples' stage is 1, a move leaves stage 0.
RIGHTFUL = {"worker": "worker of stage 1", "round": "worker of stage 1", "move": "worker of stage 0",
            "trainer": "trainer", "units": "trainer"}
SAMPLE_KEYS = {"worker": worker_key(RUN, 1), "trainer": trainer_key(RUN), "move": move_key(RUN),
               "round": rounds_key(RUN, 1, "sparta"), "units": units_key(RUN, 1)}


def test_the_record_validator_takes_each_keys_record_type_from_its_family_and_refuses_any_other(authority,
                                                                                                  writers):
    reader = CompositeValidator([OwnerSignatureValidator(), OwnedRecordValidator(RUN, authority.root_pem)])

    def accepted(key: str, kind: str) -> bool:
        state_dir = writers[RIGHTFUL[kind]]
        record = SAMPLES[kind].replace(peer_id=NodeCredentials(state_dir, clock=time.time).peer_id, run_id=RUN)
        return reader.validate(stored_entry(signing_validator(state_dir, authority.root_pem), key,
                                            subkey_of(state_dir), record.to_wire()))

    for kind, key in SAMPLE_KEYS.items():
        verdicts = {other: accepted(key, other) for other in SAMPLES}
        assert verdicts == {other: other == kind for other in SAMPLES}, key


def test_each_family_is_written_only_by_its_role_and_stage_as_the_attached_credential_says(authority, writers,
                                                                                           dirs):
    reader = CompositeValidator([OwnerSignatureValidator(), OwnedRecordValidator(RUN, authority.root_pem)])
    signers = {name: signing_validator(d, authority.root_pem) for name, d in writers.items()}

    def written_by(name: str, kind: str, value="record") -> DHTRecord:
        state_dir = writers[name]
        record = SAMPLES[kind].replace(peer_id=NodeCredentials(state_dir, clock=time.time).peer_id, run_id=RUN)
        return stored_entry(signers[name], SAMPLE_KEYS[kind], subkey_of(state_dir),
                            record.to_wire() if value == "record" else value)

    verdicts = {(kind, name): reader.validate(written_by(name, kind)) for kind in SAMPLES for name in writers}
    assert verdicts == {(kind, name): name == RIGHTFUL[kind]
                        or (kind == "units" and name == "operator") for kind, name in verdicts}
    # A tombstone needs the role, not the stage: a mover withdraws its move from the stage it came to.
    assert reader.validate(written_by("worker of stage 1", "move", value=None))
    assert not reader.validate(written_by("trainer", "worker", value=None))

    worker_dir = writers["worker of stage 1"]
    good = written_by("worker of stage 1", "worker")
    value, chain = split_credential(good.value[:good.value.rindex(b"[signature:")])
    assert chain == (worker_dir / CREDENTIAL_FILE).read_bytes() and MSGPackSerializer.loads(value)["stage"] == 1
    # What a writer cannot attach instead of its own live credential of the right role and stage:
    worker_key_pair = NodeCredentials(worker_dir, clock=time.time).key
    foreign = RunAuthority(dirs / "foreign-writer-authority", run_id=RUN)  # same run id, another root
    chains = {"none": None, "another peer's": (writers["worker of stage 0"] / CREDENTIAL_FILE).read_bytes(),
              "not a certificate": b"not a chain" + (11).to_bytes(2, "big") + b"\x01" + CHAIN_MARK,
              "an older agora's": b"[credential:" + base64.b64encode((worker_dir / CREDENTIAL_FILE).read_bytes()) + b"]",
              "another root's": foreign.issue(worker_key_pair.public_key(), role="worker", stage=1),
              "expired": authority.issue(worker_key_pair.public_key(), role="worker", stage=1, lifetime_s=1.0)}
    record = SAMPLES["worker"].replace(peer_id=NodeCredentials(worker_dir, clock=time.time).peer_id, run_id=RUN)
    key_validator = OwnerSignatureValidator(hivemind_private_key(worker_key_pair))
    # A reader two seconds on: the one-second credential is over there, the hour-long ones are not.
    owned_later = OwnedRecordValidator(RUN, authority.root_pem, clock=lambda: time.time() + 2.0)
    later = CompositeValidator([OwnerSignatureValidator(), owned_later])

    def with_chain(chain) -> DHTRecord:
        body = MSGPackSerializer.dumps(record.to_wire())
        if chain is not None:
            body += credential_attachment(chain) if chain.startswith(b"-----") else chain  # else: as given
        unsigned = DHTRecord(DHTID.generate(source=SAMPLE_KEYS["worker"]).to_bytes(),
                             MSGPackSerializer.dumps(subkey_of(worker_dir)), body, time.time() + 30)
        return dataclasses.replace(unsigned, value=key_validator.sign_value(unsigned))  # signed by the owner

    assert later.validate(with_chain((worker_dir / CREDENTIAL_FILE).read_bytes()))
    assert {name: later.validate(with_chain(chain)) for name, chain in chains.items()} == dict.fromkeys(chains, False)
    assert owned_later.refused.snapshot()["workers.credential_format"] == 1  # told apart, logged as such
    # The signature covers the attachment: another chain put in after signing breaks it.
    swapped = good.value.replace(credential_attachment((worker_dir / CREDENTIAL_FILE).read_bytes()),
                                 credential_attachment(chains["another peer's"]))
    assert swapped != good.value and not reader.validate(dataclasses.replace(good, value=swapped))


def gather_of(credential=None, **extra) -> bytes:
    """A peer's gather metadata as hivemind's averager sends it: [bandwidth, mode, msgpack(user data)]."""
    user = {"round": 1, "weight": 1.0, **extra}
    if credential is not None:
        user["credential"] = credential
    return MSGPackSerializer.dumps([1e9, 0, MSGPackSerializer.dumps(user)])


def test_the_averaging_gate_admits_only_workers_of_its_stage_under_their_own_peer_id(authority, worker_dirs,
                                                                                       mint, dirs):
    a, b = (NodeCredentials(d, clock=time.time) for d in worker_dirs)
    gate = AdmissionGate(AveragingAdmission(root_pem=authority.root_pem, run_id=RUN, stage=0))
    chain = a.current()[0]
    assert gate.problem(gather_of(chain), a.peer_id) is None
    trainer = NodeCredentials(mint("trainer-gate", "trainer"), clock=time.time)
    stage1 = NodeCredentials(mint("stage1-gate", "worker", 1), clock=time.time)
    foreign = RunAuthority(dirs / "foreign-gate", run_id=RUN).mint(dirs / "foreign-gate-worker", role="worker", stage=0)
    problems = {
        "no credential": gate.problem(gather_of(), a.peer_id),
        "not msgpack": gate.problem(b"\xff\x00junk", a.peer_id),
        "not a chain": gate.problem(gather_of(b"-----BEGIN CERTIFICATE-----\nAAAA"), a.peer_id),
        "another's chain": gate.problem(gather_of(chain), b.peer_id),
        "another stage": gate.problem(gather_of(stage1.current()[0]), stage1.peer_id),
        "a trainer": gate.problem(gather_of(trainer.current()[0]), trainer.peer_id),
        "another root": gate.problem(gather_of(foreign.current()[0]), foreign.peer_id),
    }
    assert {name: problem.split(":")[0] for name, problem in problems.items()} == {
        "no credential": "no credential in its gather metadata", "not msgpack": "malformed gather metadata",
        "not a chain": "malformed", "another's chain": "wrong_key", "another stage": "wrong_stage",
        "a trainer": "wrong_role", "another root": "untrusted"}
    assert a.peer_id in problems["another's chain"]


# ---- admitted DHT peers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def swarm(worker_dirs):
    securities = [DHTSecurity.from_state_dir(d) for d in worker_dirs]
    first = SwarmDHT.start(security=securities[0])
    try:
        second = SwarmDHT.start(initial_peers=first.visible_maddrs(), security=securities[1])
        try:
            yield first, second
        finally:
            second.shutdown()
    finally:
        first.shutdown()


class PresentAnything(CredentialTokenAuthorizer):
    """An attacker's authorizer: presents whatever chain its credential file holds, trusts all."""

    async def get_token(self) -> AccessToken:
        chain = (self.state_dir / CREDENTIAL_FILE).read_bytes()
        return AccessToken(username=chain.decode(), public_key=self.local_public_key.to_bytes())

    def is_token_valid(self, access_token: AccessToken) -> bool:
        return True

    def does_token_need_refreshing(self, access_token: AccessToken) -> bool:
        return False


def start_attacker(swarm_peer: SwarmDHT, state_dir: Path, root_pem: bytes, **kwargs) -> SwarmDHT:
    node = NodeCredentials(state_dir, clock=time.time)
    return SwarmDHT.start(initial_peers=swarm_peer.visible_maddrs(), identity_path=str(node.identity_path),
                          authorizer=PresentAnything(state_dir, root_pem, RUN), startup_timeout=20, **kwargs)


async def _store_and_find_at(_dht, node, *, peer_id: str, key: str):
    """Run in a DHT process: one raw store and one find RPC at ``peer_id`` (None: no valid answer).
    What it stores is what hivemind's matchmaking stores: a flag under the sender's peer id."""
    target, key_id = PeerID.from_base58(peer_id), DHTID.generate(source=key)
    stored = await node.protocol.call_store(target, [key_id], [MSGPackSerializer.dumps(True)],
                                            get_dht_time() + 30, subkeys=[node.peer_id.to_bytes()])
    found = await node.protocol.call_find(target, [key_id])
    return None if stored is None else list(stored), None if found is None else found[key_id][0] is not None


def store_and_find(sender: SwarmDHT, target: SwarmDHT, key: str):
    """(store_ok list, whether the find found it) of raw DHT RPCs from ``sender`` at ``target``."""
    probe = functools.partial(_store_and_find_at, peer_id=target.peer_id, key=key)
    return sender.hivemind_dht.run_coroutine(probe, return_future=True).result(20)


@pytest.mark.slow
def test_an_uncredentialed_peer_can_neither_join_nor_store_nor_read(swarm):
    first, second = swarm
    with pytest.raises(DHTRequestError, match="none of the initial_peers responded"):
        SwarmDHT.start(initial_peers=first.visible_maddrs(), startup_timeout=20, join_attempts=1)
    key = f"{averaging_prefix(RUN, 5, 'sparta')}.0b"  # a matchmaking key of the run: admitted peers store there
    assert store_and_find(second, first, f"{key}0011") == ([True], True)  # an admitted peer: stored, then found
    intruder = SwarmDHT.start(initial_peers=first.visible_maddrs(), ensure_bootstrap_success=False)
    try:
        assert store_and_find(intruder, first, f"{key}0100") == (None, None)  # no answer to either
        assert first.hivemind_dht.get(f"{key}0100", latest=True) is None
    finally:
        intruder.shutdown()


async def _store_at(_dht, node, *, peer_id: str, key: str, value, subkey):
    """Run in a DHT process: one raw store RPC at ``peer_id`` (None: no answer)."""
    stored = await node.protocol.call_store(PeerID.from_base58(peer_id), [DHTID.generate(source=key)],
                                            [MSGPackSerializer.dumps(value)], get_dht_time() + 30, subkeys=[subkey])
    return None if stored is None else list(stored)


@pytest.mark.slow
def test_a_key_of_no_family_is_refused_and_the_runs_matchmaking_keys_take_only_a_flag(swarm):
    first, second = swarm

    def store(key: str, value, subkey):
        probe = functools.partial(_store_at, peer_id=first.peer_id, key=key, value=value, subkey=subkey)
        return second.hivemind_dht.run_coroutine(probe, return_future=True).result(20)

    first.refresh_bans(max_age_s=0)  # the node's read of its DHT process, its refusal counts included
    before = first.bans.refused().get("unknown_key", 0)
    own = PeerID.from_base58(second.peer_id).to_bytes()
    matchmaking = f"{averaging_prefix(RUN, 6, 'sparta')}.0b0101"
    assert store(matchmaking, True, own) == [True]
    for key, value, subkey in (("free-key", "hello", None), (f"{RUN}.stage6.anything", "hello", second.peer_id),
                               (f"{averaging_prefix(RUN, 6, 'sparta')}.0b00101", True, own),  # five group bits
                               (matchmaking, "not a flag", own)):
        assert store(key, value, subkey) == [False], key
    first.refresh_bans(max_age_s=0)
    assert first.bans.refused()["unknown_key"] - before == 3


@pytest.mark.slow
def test_a_credential_of_another_run_is_refused(swarm, dirs):
    foreign = RunAuthority(dirs / "foreign-authority", run_id=RUN)  # same run id, another root
    foreign.mint(dirs / "foreign-worker", role="worker", stage=0)
    with pytest.raises(DHTRequestError, match="none of the initial_peers responded"):
        SwarmDHT.start(initial_peers=swarm[0].visible_maddrs(), startup_timeout=20, join_attempts=1,
                       security=DHTSecurity.from_state_dir(dirs / "foreign-worker"))


@pytest.mark.slow
def test_an_expired_credential_is_refused_while_a_valid_one_gets_in(swarm, authority, mint):
    first, _ = swarm
    late = mint("late-worker", "worker", 0)
    # The attacker's tooling works: with its valid credential it joins and is answered.
    start_attacker(first, late, authority.root_pem).shutdown()
    node = NodeCredentials(late, clock=time.time)
    expired = issue_credential(authority.issuing(), node.key.public_key(), run_id=RUN, role="worker", stage=0,
                               now=time.time() - 7200, lifetime_s=3600)
    (late / CREDENTIAL_FILE).write_bytes(expired)
    with pytest.raises(DHTRequestError, match="none of the initial_peers responded"):
        start_attacker(first, late, authority.root_pem)


@pytest.mark.slow
def test_a_peer_cannot_overwrite_or_delete_anothers_record(swarm, stage):
    first, second = swarm
    key = worker_key(RUN, stage)
    original = make_record(first, stage)
    assert first.announce_worker(original, ttl=60)
    eventually(lambda: second.live_workers(RUN, stage) == [original], timeout=10, what="the announce")
    victims_subkey = first.subkey_of(first.peer_id)
    raw = second.hivemind_dht  # an admitted peer that misbehaves: straight to hivemind
    later = second.clock() + 120
    inflated = original.replace(throughput=1e9).to_wire()
    assert not raw.store(key, inflated, later, subkey=victims_subkey)  # not signed by the owner
    assert not raw.store(key, None, later, subkey=victims_subkey)  # a tombstone, likewise
    assert not raw.store(key, {"replaces": "every entry"}, later)  # a plain value over the whole key
    assert not second.announce_worker(original.replace(throughput=1e9), ttl=120)  # under its own key
    second.withdraw(RUN, stage, first.peer_id)  # can only name its own subkey: nothing of first's changes
    for reader in (first, second):
        assert reader.live_workers(RUN, stage) == [original]
    assert first.withdraw(RUN, stage, first.peer_id)  # the owner can
    eventually(lambda: second.live_workers(RUN, stage) == [], timeout=10, what="the owner's withdraw")


@pytest.mark.slow
def test_unsigned_records_and_records_under_another_peer_id_are_refused_and_skipped(swarm, authority, mint, stage):
    first, second = swarm
    key = worker_key(RUN, stage)
    raw, later = second.hivemind_dht, second.clock() + 60
    assert not raw.store(key, make_record(second, stage).to_wire(), later, subkey=second.peer_id)  # unsigned
    impostor = make_record(first, stage).to_wire()  # second claims first's peer id, signed by second
    assert not raw.store(key, impostor, later, subkey=second.subkey_of(first.peer_id))
    assert first.live_workers(RUN, stage) == [] and second.live_workers(RUN, stage) == []

    # A peer that runs no validators keeps such entries; admitted readers never take them from it,
    # and a reader over its storage skips and counts them.
    lax_dir = mint("lax-worker", "worker", 0)
    lax_security = DHTSecurity.from_state_dir(lax_dir)
    lax = SwarmDHT.start(initial_peers=first.visible_maddrs(), identity_path=lax_security.identity_path,
                         authorizer=CredentialTokenAuthorizer(lax_dir, authority.root_pem, RUN))
    try:
        lax_raw = lax.hivemind_dht
        # The admitted peers refuse both (so hivemind reports False); lax keeps its own copies.
        assert not lax_raw.store(key, make_record(lax, stage).to_wire(), later, subkey=lax.peer_id)
        assert not lax_raw.store(key, impostor, later + 1,
                                 subkey=owned_subkey(first.peer_id, lax_security.owner_public_key))
        reader = SwarmDHT(lax_raw, owner_public_key=lax_security.owner_public_key)  # a secured view of it
        assert reader.live_workers(RUN, stage) == []
        assert reader.rejections()[key] == 2
        assert first.live_workers(RUN, stage) == [] and key not in first.rejections()
    finally:
        lax.shutdown()


@pytest.mark.slow
def test_a_stages_records_are_refused_from_a_trainer_and_from_a_worker_of_another_stage(swarm, mint, stage):
    first, second = swarm
    squatters = {"a trainer": mint("squatter-trainer", "trainer"),
                 "a worker of another stage": mint("squatter-worker", "worker", stage + 100)}
    for name, state_dir in squatters.items():
        with SwarmDHT.start(initial_peers=first.visible_maddrs(),
                            security=DHTSecurity.from_state_dir(state_dir)) as squatter:
            # A member no trainer can reach (it would hold the stage's joiners in weight sync and
            # move its real member away), and a round far past the schedule: both refused by
            # every peer, the writer's own included.
            assert not squatter.announce_worker(make_record(squatter, stage), ttl=60), name
            far = RoundRecord(peer_id=squatter.peer_id, run_id=RUN, stage=stage, round=10**9,
                              started_at=squatter.clock())
            assert not squatter.store(rounds_key(RUN, stage, "sparta"), far, ttl=30,
                                      subkey=squatter.subkey_of(squatter.peer_id)), name
    assert first.live_workers(RUN, stage) == [] and second.live_workers(RUN, stage) == []
    ours = make_record(second, stage)  # a worker credentialed for the stage: accepted
    assert second.announce_worker(ours, ttl=60)
    eventually(lambda: first.live_workers(RUN, stage) == [ours], timeout=10, what="the member's record")
    # Even the member may not make its entry outlive the family's bound (an hour): a year is refused.
    a_year = second.clock() + 365 * 24 * 3600.0
    assert not second.hivemind_dht.store(worker_key(RUN, stage), ours.replace(step=99).to_wire(), a_year,
                                         subkey=second.subkey_of(second.peer_id))
    assert first.live_workers(RUN, stage) == [ours]


@pytest.mark.slow
def test_a_monitor_reads_but_cannot_store(swarm, mint, stage):
    first, _ = swarm
    record = make_record(first, stage)
    assert first.announce_worker(record, ttl=60)
    with SwarmDHT.start(initial_peers=first.visible_maddrs(),
                        security=DHTSecurity.from_state_dir(mint("monitor", "monitor"))) as monitor:
        assert monitor.live_workers(RUN, stage) == [record]
        assert not monitor.announce_worker(make_record(monitor, stage), ttl=60)
        assert first.live_workers(RUN, stage) == [record]


@pytest.mark.slow
def test_a_worker_of_another_run_configuration_is_skipped_naming_the_field(swarm, caplog, stage):
    first, second = swarm
    other_seed = dataclasses.replace(OURS, seed=1).text()
    assert first.announce_worker(make_record(first, stage, fingerprint=other_seed), ttl=60)
    ours = make_record(second, stage)
    assert second.announce_worker(ours, ttl=60)
    eventually(lambda: len(first.live_workers(RUN, stage)) == 2, timeout=10, what="both records")
    with caplog.at_level(logging.WARNING, logger="agora.dht.entry_reader"):
        assert first.live_workers(RUN, stage, fingerprint=OURS) == [ours]
        assert first.all_workers(RUN, stage + 1, fingerprint=OURS)[stage] == [ours]
    assert first.rejections()[worker_key(RUN, stage)] == 2
    assert "run fingerprint mismatch in seed" in caplog.text


# ---- the bootstrap -------------------------------------------------------------------------------


def test_the_bootstrap_needs_a_credential_or_insecure(mint, capsys):
    assert bootstrap_main([]) == 2
    assert "--state-dir: give the credential directory" in capsys.readouterr().err
    assert bootstrap_main(["--state-dir", str(mint("monitor-boot", "monitor"))]) == 2
    assert "a monitor credential is read-only" in capsys.readouterr().err


@pytest.mark.slow
def test_an_admitted_bootstrap_lets_admitted_peers_in_and_no_one_else(mint, tmp_path, stage):
    ready, stop, out, printed = tmp_path / "boot.ready", threading.Event(), [], io.StringIO()
    boot_dir = mint("operator", "operator")
    thread = threading.Thread(target=lambda: out.append(run_bootstrap(
        BootstrapOptions(ready_file=str(ready), state_dir=str(boot_dir)), stop=stop, out=printed)))
    thread.start()
    try:
        maddrs = eventually(lambda: ready.exists() and ready.read_text().split(), timeout=30, what="the bootstrap")
        assert all(NodeCredentials(boot_dir, clock=time.time).peer_id in maddr for maddr in maddrs)
        joiner = DHTSecurity.from_state_dir(mint("boot-joiner", "worker", stage))
        with SwarmDHT.start(initial_peers=maddrs, security=joiner) as peer:
            assert peer.announce_worker(make_record(peer, stage), ttl=30)
        with pytest.raises(DHTRequestError):
            SwarmDHT.start(initial_peers=maddrs, startup_timeout=20, join_attempts=1)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert out == [0] and not ready.exists() and printed.getvalue().split() == maddrs


# ---- averaging -----------------------------------------------------------------------------------

TIMEOUTS = dict(matchmaking_s=3.0, request_s=1.0, sender_s=2.0, reducer_s=4.0, round_s=20.0)
PREFIX = averaging_prefix(RUN, 0, "sparta")  # admitted peers store only the run's matchmaking keys
SIZE = 1000


def declared(swarm_peer: SwarmDHT, prefix: str, round_number: int) -> int:
    """How many averagers are looking for a group of this round (hivemind's matchmaking key)."""
    found = swarm_peer.hivemind_dht.get(f"{prefix}.0b{round_group_bits(round_number)}", latest=True)
    if found is None or not isinstance(found.value, dict):
        return 0
    return sum(1 for item in found.value.values() if item.value)


@pytest.fixture(scope="module")
def averaging(swarm, worker_dirs, mint):
    """first and second average stage 0 with admission; the intruder, a worker of stage 1, checks nothing."""
    first, second = swarm
    intruder_dir = mint("stage1-worker", "worker", 1)
    intruder = SwarmDHT.start(initial_peers=first.visible_maddrs(), security=DHTSecurity.from_state_dir(intruder_dir))
    averagers = []
    try:
        for peer, state_dir in ((first, worker_dirs[0]), (second, worker_dirs[1]), (intruder, None)):
            security = None if state_dir is None else DHTSecurity.from_state_dir(state_dir)
            admission = None if security is None else AveragingAdmission.for_node(security, 0)
            averagers.append(SliceAverager.start(peer.hivemind_dht, prefix=PREFIX, size=SIZE,
                                                 part_size_bytes=16 * 1024, admission=admission, **TIMEOUTS))
        yield averagers, (intruder_dir / CREDENTIAL_FILE).read_bytes()
    finally:
        for averager in averagers:
            averager.shutdown()
        intruder.shutdown()


def round_threads(jobs):
    """One (not yet started) thread per (averager, values, kwargs) job, and the list their results land in."""
    results = [None] * len(jobs)

    def one(index, averager, values, kwargs):
        results[index] = averager.average(values, **kwargs)

    return [threading.Thread(target=one, args=(index, *job)) for index, job in enumerate(jobs)], results


@pytest.mark.slow
def test_an_intruder_is_refused_at_the_door_and_the_honest_pair_averages_without_it(swarm, averaging):
    (a, b, intruder), intruder_chain = averaging
    first = swarm[0]
    before = [a.refusals().get("join", 0), b.refusals().get("join", 0)]
    common = dict(round_number=1, weight=1.0, group_size=3)  # a full group would take 3: the window stays open
    threads, results = round_threads([(a, torch.ones(SIZE), common), (b, torch.full((SIZE,), 2.0), common),
                                  (intruder, torch.full((SIZE,), 1000.0), dict(common, credential=intruder_chain))])
    for thread in threads[:2]:
        thread.start()
    eventually(lambda: declared(first, PREFIX, 1) >= 2, timeout=10, what="the honest pair to declare")
    threads[2].start()  # later: the honest peers lead, the intruder asks to join them
    for thread in threads:
        thread.join(timeout=60)
    honest_a, honest_b, refused = results
    assert honest_a.outcome == honest_b.outcome == "committed", (honest_a.error, honest_b.error)
    assert torch.equal(honest_a.averaged, torch.full((SIZE,), 1.5))  # the honest mean: nothing of the 1000s
    assert torch.equal(honest_b.averaged, honest_a.averaged)
    assert sorted(honest_a.participants) == sorted([a.peer_id, b.peer_id])
    assert refused.outcome == "alone"
    after = [a.refusals().get("join", 0), b.refusals().get("join", 0)]
    assert sum(after) > sum(before)


@pytest.mark.slow
def test_a_group_with_an_unadmitted_member_is_refused_by_every_honest_member(swarm, averaging):
    (a, b, intruder), intruder_chain = averaging
    common = dict(round_number=2, weight=1.0, group_size=3)
    # The intruder leads (it declares first) and accepts everyone: the members' own check must catch it.
    threads, results = round_threads([
        (intruder, torch.full((SIZE,), 1000.0), dict(common, credential=intruder_chain)),
        (a, torch.ones(SIZE), common), (b, torch.full((SIZE,), 2.0), common)])
    threads[0].start()
    eventually(lambda: declared(swarm[0], PREFIX, 2) >= 1, timeout=10, what="the intruder to declare")
    threads[1].start()
    threads[2].start()
    for thread in threads:
        thread.join(timeout=60)
    _, honest_a, honest_b = results
    for result in (honest_a, honest_b):
        assert result.outcome == "rejected" and result.averaged is None
        assert intruder.peer_id in result.error and "wrong_stage" in result.error
    assert a.refusals()["group"] >= 1 and b.refusals()["group"] >= 1
