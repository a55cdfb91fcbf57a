"""The ban list without a network: who may sign it, which list wins, the record's bounds, the
publisher's serials."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography import x509

from agora.auth.authority import RunAuthority
from agora.auth.keys import generate_key
from agora.auth.credentials import issue_credential, make_issuing_ca
from agora.dht.bans import BanBook, BanListError, sign_ban_list, verify_ban_list
from agora.dht.record_fields import MAX_BANS, RecordError
from agora.dht.records import BanListRecord
from agora.node.ban_publisher import next_serial

RUN = "ban-run"
NOW = 1_800_000_000.0
PEER_A = "QmPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
PEER_B = "QmPeerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"


@pytest.fixture(scope="module")
def authority(tmp_path_factory) -> RunAuthority:
    return RunAuthority(tmp_path_factory.mktemp("ca"), run_id=RUN, clock=lambda: NOW - 3600)


@pytest.fixture(scope="module")
def root(authority) -> x509.Certificate:
    return authority.root.certificate


def signed(authority, serial: int, banned=(PEER_A,), *, now: float = NOW, run_id: str = RUN) -> BanListRecord:
    return sign_ban_list(authority.issuing(), run_id=run_id, serial=serial, banned=banned, now=now)


def test_a_list_signed_by_the_runs_issuing_ca_verifies_to_what_it_states(authority, root):
    record = signed(authority, 7, [PEER_B, PEER_A, PEER_A])
    assert record.banned == f"{PEER_A}\n{PEER_B}"  # sorted, each once
    verified = verify_ban_list(BanListRecord.from_wire(record.to_wire()), root=root, run_id=RUN, now=NOW)
    assert (verified.serial, verified.banned, verified.issued_at) == (7, frozenset({PEER_A, PEER_B}), NOW)
    assert signed(authority, 8, []).peers() == frozenset()


def test_a_list_is_refused_unless_the_runs_root_vouches_for_every_field(authority, root, tmp_path):
    record = signed(authority, 7)
    other = RunAuthority(tmp_path / "other", run_id=RUN, clock=lambda: NOW - 3600)  # same run id, another root
    cases = [
        ("bad_signature", record.replace(banned=PEER_B)),  # another peer under the same signature
        ("bad_signature", record.replace(serial=8)),  # a higher serial, the same signature
        ("wrong_run", signed(authority, 7, run_id="other-run")),
        ("future", signed(authority, 7, now=NOW + 3600)),
        ("untrusted_signer", signed(other, 7)),
    ]
    for reason, forged in cases:
        with pytest.raises(BanListError) as caught:
            verify_ban_list(forged, root=root, run_id=RUN, now=NOW)
        assert caught.value.reason == reason, (reason, str(caught.value))
    # A node's own credential (a leaf the issuing CA signed) is no signer: only a CA the root signed is.
    key = generate_key()
    leaf = issue_credential(authority.issuing(), key.public_key(), run_id=RUN, role="operator", stage=None,
                            now=NOW - 60, lifetime_s=3600)
    as_leaf = dataclasses.replace(authority.issuing(), key=key, certificate=x509.load_pem_x509_certificate(leaf))
    with pytest.raises(BanListError, match="not a CA of this run's root"):
        verify_ban_list(sign_ban_list(as_leaf, run_id=RUN, serial=9, banned=[PEER_A], now=NOW), root=root,
                        run_id=RUN, now=NOW)
    # An issuing CA used outside its validity signs nothing.
    expired = make_issuing_ca(authority.root, generate_key(), now=NOW - 7200, lifetime_s=3600)
    with pytest.raises(BanListError, match="outside its signer's validity"):
        verify_ban_list(sign_ban_list(expired, run_id=RUN, serial=9, banned=[], now=NOW), root=root, run_id=RUN,
                        now=NOW)


def test_the_highest_serial_wins_and_forged_or_misfiled_lists_are_ignored_and_counted(authority):
    book = BanBook(authority.root_pem, RUN, clock=lambda: NOW)
    first, unban = signed(authority, 5, [PEER_A]), signed(authority, 9, [PEER_B])
    forged = signed(authority, 20, [PEER_A]).replace(banned=f"{PEER_A}\n{PEER_B}")
    held = book.offer({"5": first.to_wire(), "20": forged.to_wire(), "9": unban.to_wire(),
                       "3": signed(authority, 4).to_wire(), "1": {"kind": "bans"}})
    assert held.serial == 9 and book.banned == frozenset({PEER_B})
    assert book.is_banned(PEER_B) and not book.is_banned(PEER_A)  # 9 lifted 5's ban
    assert book.offer({"5": first.to_wire()}).serial == 9  # an older list, read later, changes nothing
    assert book.refused == {"bad_signature": 1, "malformed": 2}  # a list under another serial is misfiled
    assert book.offer({"20": forged.to_wire()}).serial == 9 and book.refused["bad_signature"] == 2  # each read


def test_a_ban_list_record_names_valid_peer_ids_sorted_and_at_most_max_bans():
    fields = dict(run_id=RUN, serial=1, issued_at=NOW, signer=b"pem", signature=b"s")
    BanListRecord(banned=f"{PEER_A}\n{PEER_B}", **fields)
    for banned, problem in ((f"{PEER_B}\n{PEER_A}", "sorted"), (f"{PEER_A}\n{PEER_A}", "sorted"),
                            ("not a peer", "base58"), ("\n".join(f"Qm{i:044d}" for i in range(MAX_BANS + 1)),
                                                       "at most")):
        with pytest.raises(RecordError, match=problem):
            BanListRecord(banned=banned, **fields)


def test_serials_rise_with_every_list_and_across_a_clock_set_back():
    assert next_serial(0, NOW) == int(NOW * 1000)
    assert next_serial(int(NOW * 1000), NOW) == int(NOW * 1000) + 1  # two lists in one millisecond
    assert next_serial(int(NOW * 1000), NOW - 86400) == int(NOW * 1000) + 1  # the clock went back a day
