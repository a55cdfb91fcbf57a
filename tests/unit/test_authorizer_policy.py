"""The authorizer's decisions without sockets: floors, addresses, stages, the cap's queue, the rate
limit, challenges, proofs and renewal timing (auth/policy.py), and the adapter's conversions."""

from __future__ import annotations

import dataclasses
import math
import random
from itertools import count

import pytest

from agora.auth.challenges import ChallengeBook, ChallengeError, RenewalChallenges
from agora.auth.keys import generate_key, node_key_problem, peer_id_of
from agora.auth.limits import CallerLimits, CallSlots, TokenBuckets, address_key, network_prefix
from agora.auth.policy import (ContributorSlots, Floors, LinkMeasurement, assign_stage, check_announce, check_floors,
                               credential_lifetime_s, dialback_allowed, dialback_answer, download_mbit, median_rtt_ms,
                               proof_is_valid, renewal_delay_s, retry_delay_s, run_payload, sign_proof, upload_mbit)
from agora.auth.settings import AuthorizerSettings
from agora.auth.status import caller_address
from agora.pipeline.schema import ConfigError, checked
from agora.protos import authorizer_adapter as adapter
from agora.protos.authorizer_adapter import Hardware
from odd_keys import same_modulus_with_exponent

pytestmark = pytest.mark.timeout(30)

FAST = LinkMeasurement(rtt_ms=10.0, download_mbit=1000.0, upload_mbit=1000.0)
BIG = Hardware("NVIDIA H100", 80 * 10**9, 512 * 10**9)


@pytest.fixture(scope="module")
def key():
    return generate_key()


# ---- node keys

def test_only_a_2048_bit_key_with_exponent_65537_is_a_node_key(key):
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    assert node_key_problem(key.public_key()) is None
    reexponented = same_modulus_with_exponent(key, 65539)
    assert peer_id_of(reexponented) != peer_id_of(key), "a new exponent of the same modulus is a new peer id"
    assert "exponent 65539" in node_key_problem(reexponented.public_key())
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    assert "got 1024 bits" in node_key_problem(small.public_key())
    assert "expected an RSA key" in node_key_problem(ec.generate_private_key(ec.SECP256R1()).public_key())


# ---- floors

def test_the_default_floors_are_the_agora_reports():
    assert Floors() == Floors(min_upload_mbit=200, min_download_mbit=200, max_rtt_ms=80, min_accelerator_gb=24,
                              min_ram_gb=80)
    assert check_floors(Floors(), BIG, FAST) is None


@pytest.mark.parametrize("field, link, hardware, shown", [
    ("max_rtt_ms", dataclasses.replace(FAST, rtt_ms=95.25), BIG, "95.2 ms"),
    ("min_upload_mbit", dataclasses.replace(FAST, upload_mbit=150.0), BIG, "150.0 Mbit/s"),
    ("min_download_mbit", dataclasses.replace(FAST, download_mbit=12.3), BIG, "12.3 Mbit/s"),
    ("min_accelerator_gb", FAST, dataclasses.replace(BIG, accelerator_memory_bytes=16 * 10**9), "16.0 GB"),
    ("min_accelerator_gb", FAST, Hardware("cpu", 0, 512 * 10**9), "(cpu) reported 0.0 GB"),
    ("min_ram_gb", FAST, dataclasses.replace(BIG, ram_bytes=64 * 10**9), "64.0 GB"),
])
def test_a_refusal_names_the_floor_its_flag_and_the_measured_value(field, link, hardware, shown):
    refusal = check_floors(Floors(), hardware, link)
    assert refusal is not None and refusal.field == field
    assert shown in refusal.reason and field in refusal.reason
    assert "--" + field.replace("_", "-") in refusal.reason


def test_a_24_gb_card_passes_the_24_gb_floor():
    """Decimal GB: an RTX 4090 reports 23.99 GiB."""
    card = Hardware("NVIDIA GeForce RTX 4090", 25_757_220_864, 128 * 10**9)
    assert check_floors(Floors(), card, FAST) is None


def test_floors_can_be_disabled_and_reject_nonsense():
    off = Floors(0, 0, math.inf, 0, 0)
    assert check_floors(off, Hardware("cpu", 0, 0), LinkMeasurement(1e6, 0.0, 0.0)) is None
    with pytest.raises(ConfigError, match="^floors.min_ram_gb: must be >= 0, got -1$"):
        checked(Floors, "floors", min_ram_gb=-1)
    with pytest.raises(ConfigError, match="^floors.max_rtt_ms: must be >= 0, got nan$"):
        checked(Floors, "floors", max_rtt_ms=math.nan)


def test_preflight_arithmetic():
    assert median_rtt_ms([0.010, 0.500, 0.012]) == pytest.approx(12.0)
    assert upload_mbit(1_000_000, 0.08) == pytest.approx(100.0)
    # 1 MB acknowledged after 0.1 s with a 20 ms round trip: 80 ms of transfer.
    assert download_mbit(1_000_000, 0.1, 0.02) == pytest.approx(100.0)
    # An RTT inflated by delayed echoes cannot take off more than half the elapsed time.
    assert download_mbit(1_000_000, 0.1, 0.099) == pytest.approx(160.0)


# ---- addresses and stages

@pytest.mark.parametrize("host", ["0.0.0.0", "::", "224.0.0.1"])
def test_unspecified_announce_hosts_are_refused(host):
    refusal = check_announce(host, 5000)
    assert refusal is not None and refusal.field == "announce_host"
    assert host in refusal.reason


@pytest.mark.parametrize("host, port, field", [("", 5000, "announce_host"), ("not a host!", 5000, "announce_host"),
                                               ("10.0.0.7", 0, "announce_port"), ("10.0.0.7", 70000, "announce_port")])
def test_malformed_announce_addresses_are_refused(host, port, field):
    refusal = check_announce(host, port)
    assert refusal is not None and refusal.field == field


@pytest.mark.parametrize("host", ["203.0.113.5", "2001:db8::1", "127.0.0.1", "node-7.example.org"])
def test_dialable_announce_addresses_pass(host):
    assert check_announce(host, 443) is None


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700::1111", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("192.168.1.1", False), ("172.16.0.9", False),
    ("169.254.1.1", False), ("fe80::1%eth0", False), ("fd00::1", False), ("100.64.0.1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True), ("0.0.0.0", False), ("224.0.0.1", False),
    ("not an address", False),
])
def test_the_dial_back_goes_to_public_addresses_unless_the_run_is_local(address, public):
    assert dialback_allowed(address, local_network=False) is public
    unicast = address not in ("0.0.0.0", "224.0.0.1", "not an address")
    assert dialback_allowed(address, local_network=True) is unicast


def test_stage_assignment_prefers_the_least_covered_and_honours_a_request():
    assert assign_stage(3, {}, None) == 0
    assert assign_stage(3, {0: 500.0, 1: 100.0, 2: 300.0}, None) == 1
    assert assign_stage(3, {0: 1.0, 1: 1.0}, None) == 2  # a stage nobody announced is the least covered
    assert assign_stage(3, {0: 1.0, 1: 1.0, 2: 0.5}, None) == 0  # ties to the lowest index
    # The last stage runs one job a microbatch, the others two: equal machines announce half the rate
    # there and cover their stages equally; a newcomer goes to the stage short in microbatches/s.
    assert assign_stage(3, {0: 1.0, 1: 1.0, 2: 0.6}, None) == 0
    assert assign_stage(3, {0: 1.0, 1: 1.0, 2: 0.4}, None) == 2
    assert assign_stage(3, {1: 0.0}, 2) == 2
    refusal = assign_stage(3, {}, 3)
    assert not isinstance(refusal, int) and refusal.field == "stage" and "3-stage" in refusal.reason


# ---- the cap and its queue

def test_the_cap_queues_in_fifo_order_and_admits_when_a_slot_frees():
    slots = ContributorSlots(1, stale_s=30)
    assert slots.request("a", now=0) == 0
    slots.hold("a", expires_at=100)
    assert slots.request("b", now=1) == 1
    assert slots.request("c", now=2) == 2
    assert slots.request("b", now=3) == 1  # polling keeps the place
    assert slots.request("a", now=4) == 0  # an admitted peer keeps its slot
    slots.release("a")  # banned
    assert slots.request("c", now=5) == 2, "c may not overtake b"
    assert slots.request("b", now=6) == 0
    slots.hold("b", expires_at=50)
    assert slots.request("c", now=7) == 1
    assert slots.expire(now=50) == ["b"]  # expired unrenewed
    assert slots.request("c", now=51) == 0


def test_a_queued_node_that_stops_polling_drops_out():
    slots = ContributorSlots(1, stale_s=10)
    slots.hold("a", expires_at=1000)
    assert slots.request("b", now=0) == 1
    assert slots.request("c", now=5) == 2
    assert slots.request("c", now=11) == 1, "b stopped polling at 0"
    assert slots.queue() == ["c"]


def test_no_cap_admits_everyone():
    slots = ContributorSlots(None, stale_s=10)
    for i in range(100):
        assert slots.request(str(i), now=0) == 0
        slots.hold(str(i), expires_at=10)


# ---- rate limits

def test_the_rate_limit_is_a_token_bucket_per_key():
    limiter = TokenBuckets(rate_per_s=0.5, burst=3)
    assert [limiter.acquire("1.2.3.4", now=0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("1.2.3.4", now=0) == pytest.approx(2.0)
    assert limiter.acquire("5.6.7.8", now=0) == 0.0, "another key has its own bucket"
    assert limiter.acquire("1.2.3.4", now=2.0) == 0.0
    assert limiter.acquire("1.2.3.4", now=2.0) == pytest.approx(2.0)


def test_the_rate_limiter_bounds_its_memory():
    limiter = TokenBuckets(rate_per_s=1.0, burst=1, max_keys=4)
    for i in range(100):
        assert limiter.acquire(f"10.0.0.{i}", now=float(i)) == 0.0
    assert len(limiter._buckets) <= 4


@pytest.mark.parametrize("peer, address", [
    ("ipv4:203.0.113.7:5000", "203.0.113.7"),
    ("ipv6:%5B2001:db8::1%5D:5000", "2001:db8::1"),  # grpc escapes the brackets
    ("ipv6:[2001:db8::1]:5000", "2001:db8::1"),
    ("unix:/tmp/socket", "unix:/tmp/socket"),
])
def test_the_caller_address_is_read_from_grpcs_peer_string(peer, address):
    assert caller_address(peer) == address


@pytest.mark.parametrize("address, key, network", [
    ("203.0.113.7", "203.0.113.7", "203.0.113.0/24"),
    ("::ffff:203.0.113.7", "203.0.113.7", "203.0.113.0/24"),
    ("2001:db8:aa:bb01:1:2:3:4", "2001:db8:aa:bb01::/64", "2001:db8:aa:bb00::/56"),
    ("unix:/tmp/socket", "unix:/tmp/socket", "unix:/tmp/socket"),
])
def test_callers_are_counted_by_ipv4_address_or_ipv6_64_and_by_network(address, key, network):
    assert (address_key(address), network_prefix(address)) == (key, network)


def _limits(**overrides) -> CallerLimits:
    return CallerLimits(**{**dict(address_rate_per_s=0.01, address_burst=2, network_rate_per_s=0.01,
                                  network_burst=5), **overrides})


def test_new_addresses_in_one_ipv6_64_share_one_bucket():
    limits = _limits()
    assert limits.acquire("2001:db8::1", now=0) is None and limits.acquire("2001:db8::2", now=0) is None
    limited = limits.acquire("2001:db8::ffff:3", now=0)
    assert (limited.scope, limited.key) == ("address", "2001:db8::/64")
    assert "too many join attempts from 2001:db8::/64" in limited.message("join attempts")


@pytest.mark.parametrize("network, address", [("198.51.100.0/24", "198.51.100.{}"),
                                              ("2001:db8:0:ff00::/56", "2001:db8:0:ff{:02x}::1")])
def test_a_network_is_limited_whatever_addresses_it_uses(network, address):
    limits = _limits()
    assert [limits.acquire(address.format(i), now=0) for i in range(5)] == [None] * 5
    limited = limits.acquire(address.format(99), now=0)
    assert (limited.scope, limited.key) == ("network", network) and limited.retry_after_s == pytest.approx(100.0)
    assert f"network {network}" in limited.message("join attempts")
    assert limits.acquire("192.0.2.1", now=0) is None, "another network has its own buckets"


def test_a_refused_attempt_spends_no_token():
    limits = _limits(address_burst=1, network_burst=1)
    assert limits.acquire("198.51.100.1", now=0) is None
    assert limits.acquire("198.51.100.2", now=0).scope == "network"
    assert limits.acquire("198.51.100.2", now=100.0) is None, "its address bucket was not spent by the refusal"


def test_newcomers_calls_in_flight_are_capped_per_network_and_in_all():
    slots = CallSlots(per_network=2, total=3)
    assert slots.enter("198.51.100.1") is None and slots.enter("198.51.100.2") is None
    assert slots.enter("198.51.100.3") == "2 calls in flight from network 198.51.100.0/24"
    assert slots.enter("192.0.2.1") is None
    assert slots.enter("203.0.113.1") == "3 calls of newcomers in flight (at most 3)"
    slots.leave("198.51.100.1")
    assert slots.enter("203.0.113.1") is None


def test_newcomers_may_hold_three_quarters_of_the_ports_calls():
    assert AuthorizerSettings().newcomer_calls == 384
    with pytest.raises(ConfigError, match="^authorizer.max_calls_per_network: 7 is above 6, three quarters"):
        checked(AuthorizerSettings, "authorizer", max_concurrent_rpcs=8, max_calls_per_network=7)
    with pytest.raises(ConfigError, match="^authorizer.challenges_per_network: 5000 is above max_challenges=4096$"):
        checked(AuthorizerSettings, "authorizer", challenges_per_network=5000)
    with pytest.raises(ConfigError, match="^authorizer.network_join_rate_per_s: must be > 0, got 0.0$"):
        checked(AuthorizerSettings, "authorizer", network_join_rate_per_s=0.0)


# ---- challenges

def _counting_bytes():
    counter = count()
    return lambda n: next(counter).to_bytes(n, "big")


def _book(ttl: float = 10.0, capacity: int = 4096, per_network=None) -> ChallengeBook:
    return ChallengeBook(ttl, random_bytes=_counting_bytes(), capacity=capacity, per_network=per_network)


def test_a_challenge_is_single_use_short_lived_and_bound_to_its_caller():
    book = _book()
    first = book.issue("1.2.3.4", "worker", now=0, latency_probes=3, download_bytes=10, upload_bytes=10)
    assert book.peek(first.nonce, "1.2.3.4", now=1) is first
    with pytest.raises(ChallengeError) as wrong:
        book.peek(first.nonce, "5.6.7.8", now=1)
    assert wrong.value.kind == "wrong_caller"
    assert book.consume(first.nonce, "1.2.3.4", now=2) is first
    with pytest.raises(ChallengeError) as used:
        book.consume(first.nonce, "1.2.3.4", now=2)
    assert used.value.kind == "unknown"
    late = book.issue("1.2.3.4", "worker", now=0)
    with pytest.raises(ChallengeError, match="expired"):
        book.consume(late.nonce, "1.2.3.4", now=10)


def test_outstanding_challenges_are_bounded():
    book = _book(capacity=2)
    book.issue("a", "trainer", now=0)
    book.issue("a", "trainer", now=0)
    with pytest.raises(ChallengeError) as full:
        book.issue("a", "trainer", now=1)
    assert full.value.kind == "full"
    book.issue("a", "trainer", now=11)  # the expired ones were pruned


def test_one_network_cannot_take_the_whole_book():
    book = _book(per_network=2)
    for host, now in ((1, 0), (2, 1)):  # two addresses of one /24
        book.issue(f"198.51.100.{host}", "worker", now=now)
    with pytest.raises(ChallengeError) as full:
        book.issue("198.51.100.3", "worker", now=2)
    assert full.value.kind == "full" and "network 198.51.100.0/24" in str(full.value)
    assert full.value.retry_after_s == pytest.approx(8.0), "until the network's oldest challenge expires"
    book.issue("192.0.2.1", "worker", now=2)
    book.consume(book.issue("2001:db8::1", "worker", now=2).nonce, "2001:db8::1", now=2)
    book.issue("198.51.100.3", "worker", now=10.5)  # the first one expired
    assert len(book) == 3


def test_a_challenges_measurements_run_one_at_a_time_and_once_each():
    state = _book().issue("a", "worker", now=0, latency_probes=2, download_bytes=10, upload_bytes=10)
    state.begin("download")
    with pytest.raises(ChallengeError) as busy:
        state.begin("download")
    assert busy.value.kind == "busy" and "one at a time" in str(busy.value)
    with pytest.raises(ChallengeError, match="still running"):
        state.begin("upload")
    state.end()
    with pytest.raises(ChallengeError) as again:
        state.begin("download")
    assert again.value.kind == "repeated"
    state.begin("upload")


def test_renewal_challenges_verify_without_a_record_and_are_used_once():
    challenges = RenewalChallenges(10.0, random_bytes=_counting_bytes())
    nonce = challenges.issue(now=0)
    challenges.check(nonce, now=5)
    challenges.check(nonce, now=5)  # unused until a proof spends it
    challenges.spend(nonce, now=5)
    for forged in (nonce, nonce[:-1] + bytes([nonce[-1] ^ 1]), b"", challenges.issue(now=0)):
        with pytest.raises(ChallengeError, match="unknown, expired or already used"):
            challenges.check(forged, now=10.5 if forged not in (nonce, b"") else 5)
    another_authorizer = RenewalChallenges(10.0, random_bytes=lambda n: bytes([7]) * n)
    with pytest.raises(ChallengeError):
        challenges.check(another_authorizer.issue(now=0), now=1)
    for _ in range(100_000):
        challenges.issue(now=1)  # issuing holds nothing
    assert challenges._used == {nonce: 10.0}


def test_a_challenge_has_its_link_only_after_the_whole_preflight():
    state = _book().issue("a", "worker", now=0, latency_probes=2, download_bytes=1000, upload_bytes=1000)
    state.rtts_s = [0.010, 0.020]
    state.download = (1_000_000, 0.09)
    assert state.link() is None
    state.upload = (1_000_000, 0.08)
    link = state.link()
    assert link == LinkMeasurement(rtt_ms=pytest.approx(15.0), download_mbit=pytest.approx(100.0),
                                   upload_mbit=pytest.approx(100.0))


def test_the_dialback_answer_carries_the_token():
    assert dialback_answer(bytes.fromhex("00ff")) == b"AGORA-DIALBACK/1 00ff\n"


# ---- proofs

def test_proof_of_possession_verifies_only_with_the_signing_key(key):
    payload = adapter.signed_payload(adapter.JoinRequest(nonce=b"n" * 32, public_key_pem=b"k", role="worker",
                                                         fingerprint="f"))
    signature = sign_proof(key, payload)
    assert proof_is_valid(key.public_key(), payload, signature)
    assert not proof_is_valid(key.public_key(), payload + b"x", signature)
    assert not proof_is_valid(generate_key().public_key(), payload, signature)
    assert not proof_is_valid(key.public_key(), payload, b"garbage")


def test_the_signed_payload_covers_every_field_but_the_signature():
    request = adapter.JoinRequest(nonce=b"n", public_key_pem=b"k", role="worker", fingerprint="f",
                                  hardware=adapter.Hardware("cpu", 0, 1), stage=None, announce_host="h",
                                  announce_port=1)
    base = adapter.signed_payload(request)
    assert adapter.signed_payload(dataclasses.replace(request, signature=b"sig")) == base
    for change in ({"nonce": b"m"}, {"role": "trainer"}, {"stage": 0}, {"announce_port": 2},
                   {"hardware": adapter.Hardware("cpu", 0, 2)}, {"fingerprint": "g"}):
        assert adapter.signed_payload(dataclasses.replace(request, **change)) != base, change
    renew = adapter.RenewRequest(nonce=b"n", credential_pem=b"k")
    assert adapter.signed_payload(renew) != base, "join and renewal payloads are domain-separated"


def test_the_run_payload_binds_config_peers_and_credential():
    base = run_payload("r", "{}", ("/ip4/1.2.3.4/tcp/1",), b"cred")
    assert run_payload("r", '{"a": 1}', ("/ip4/1.2.3.4/tcp/1",), b"cred") != base
    assert run_payload("r", "{}", (), b"cred") != base
    assert run_payload("r", "{}", ("/ip4/1.2.3.4/tcp/1",), b"other") != base


# ---- renewal timing

def test_renewal_is_at_half_life_jittered_earlier_by_at_most_a_tenth():
    rng = random.Random(0)
    not_before, not_after = 1000.0 - 60.0, 1000.0 + 3600.0  # issued at 1000 for 1 h (back-dated 60 s)
    assert credential_lifetime_s(not_before, not_after) == pytest.approx(3600.0)
    delays = [renewal_delay_s(not_before, not_after, 1000.0, rng) for _ in range(500)]
    assert all(1440.0 <= d <= 1800.0 for d in delays)
    assert max(delays) - min(delays) > 300.0, "the jitter spreads renewals"
    assert renewal_delay_s(not_before, not_after, now=4000.0, rng=rng) == 0.0, "past half life: renew now"


def test_retries_back_off_exponentially_with_jitter_up_to_a_ceiling():
    rng = random.Random(1)
    for attempt, step in enumerate([1, 2, 4, 8, 16, 30, 30]):
        delay = retry_delay_s(attempt, rng, initial_s=1.0, maximum_s=30.0)
        assert step / 2 <= delay <= step


# ---- the adapter

SAMPLES = [
    adapter.RunDescription(run_id="r", config_json="{}", fingerprint="seed=0"),
    adapter.ChallengeRequest(peer_id="Qm", role="worker", renewal=True),
    adapter.Challenge(nonce=b"n", dial_token=b"t", expires_in_s=60.0, latency_probes=5, download_bytes=7,
                      upload_bytes=9),
    adapter.JoinRequest(nonce=b"n", public_key_pem=b"k", role="worker", fingerprint="f",
                        hardware=adapter.Hardware("cpu", 0, 2**40), stage=0, announce_host="h", announce_port=9,
                        signature=b"s"),
    adapter.JoinRequest(nonce=b"n", public_key_pem=b"k", role="trainer", fingerprint="f"),
    adapter.JoinReply(admitted=adapter.Admitted(credential_pem=b"c", root_pem=b"r", run_id="r", role="worker",
                                                lifetime_s=3600.0, config_json="{}", initial_peers=("a", "b"),
                                                stage=0, run_signature=b"s")),
    adapter.JoinReply(admitted=adapter.Admitted(credential_pem=b"c", root_pem=b"r", run_id="r", role="trainer",
                                                lifetime_s=1.0, config_json="{}")),
    adapter.JoinReply(queued=adapter.Queued(position=3, retry_after_s=5.0)),
    adapter.JoinReply(refused=adapter.Refused(reason="why", field="min_ram_gb")),
    adapter.RenewRequest(nonce=b"n", credential_pem=b"c", signature=b"s"),
    adapter.RenewReply(credential_pem=b"c", lifetime_s=10.0),
    adapter.UploadReceipt(received_bytes=10, mbit_per_s=1.5),
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_dataclass_message_round_trip(value):
    message = adapter.to_message(value)
    assert adapter.from_message(type(message).FromString(message.SerializeToString())) == value
