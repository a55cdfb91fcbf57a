"""When a DHT token may name its sender's credential chain instead of carrying it (pure decisions)."""

from __future__ import annotations

from agora.dht.chain_references import (TAG_BYTES, ChainCache, PeerChains, chain_digest, holds, reference_digest,
                                        reference_of)

OURS, RENEWED, THEIRS = b"our chain", b"our renewed chain", b"their chain"


def test_a_reference_names_exactly_one_digest_and_nothing_else_reads_as_one():
    digest = chain_digest(OURS)
    assert reference_digest(reference_of(digest)) == digest
    for username in ("-----BEGIN CERTIFICATE-----\n", "", "sha256:", reference_of(digest)[:-1],
                     reference_of(digest).upper(), reference_of(digest) + "0", "md5:" + digest.hex()):
        assert reference_digest(username) is None, username


def test_a_tag_says_a_chain_is_held_only_when_it_is_that_chains():
    digest = chain_digest(OURS)
    assert holds(digest[:TAG_BYTES], digest)
    assert not holds(b"", digest)  # an older peer, or one that holds nothing of ours
    assert not holds(digest[:TAG_BYTES - 1], digest)
    assert not holds(chain_digest(RENEWED)[:TAG_BYTES], digest)


def test_the_cache_resolves_what_it_verified_and_forgets_the_least_recent_beyond_its_capacity():
    cache = ChainCache(capacity=2)
    first, second = cache.add(b"chain 1", b"key 1"), cache.add(b"chain 2", b"key 2")
    assert cache.get(first) == (b"chain 1", b"key 1") and cache.tag_of(first) == first[:TAG_BYTES]
    third = cache.add(b"chain 3", b"key 3")  # chain 2 is now the least recently used
    assert cache.get(second) is None and cache.tag_of(second) == b""
    assert cache.get(first) is not None and cache.get(third) is not None
    assert cache.tag_of(None) == b""


def test_a_peer_is_sent_our_name_only_while_its_last_word_is_that_it_holds_our_current_chain():
    ours, theirs = chain_digest(OURS), chain_digest(THEIRS)
    peers = PeerChains()
    assert not peers.may_refer(None, ours) and not peers.may_refer("peer", ours)  # never heard: the chain
    peers.heard("peer", holds_ours=b"", theirs=theirs)  # its first request carried its chain, held nothing
    assert not peers.may_refer("peer", ours) and peers.theirs("peer") == theirs
    peers.heard("peer", holds_ours=ours[:TAG_BYTES], theirs=theirs)  # its response: it holds ours now
    assert peers.may_refer("peer", ours)
    assert not peers.may_refer("peer", chain_digest(RENEWED))  # our credential renewed: the new chain
    peers.heard("peer", holds_ours=b"", theirs=theirs)  # it restarted and spoke first: it says so
    assert not peers.may_refer("peer", ours)


def test_a_request_without_a_valid_response_makes_the_next_one_carry_the_chain_until_the_peer_says_again():
    ours = chain_digest(OURS)
    peers = PeerChains()
    peers.heard("peer", holds_ours=ours[:TAG_BYTES], theirs=chain_digest(THEIRS))
    peers.unanswered("peer")  # refused (it restarted), or timed out
    assert not peers.may_refer("peer", ours)
    peers.heard("peer", holds_ours=ours[:TAG_BYTES], theirs=chain_digest(THEIRS))
    assert peers.may_refer("peer", ours)
    peers.unanswered("stranger")  # nothing known: nothing to forget
    assert not peers.may_refer("stranger", ours)


def test_the_peers_remembered_are_bounded_least_recently_heard_out():
    ours = chain_digest(OURS)
    peers = PeerChains(capacity=2)
    for name in ("a", "b", "a", "c"):  # b is the least recently heard when c comes
        peers.heard(name, holds_ours=ours[:TAG_BYTES], theirs=chain_digest(name.encode()))
    assert peers.may_refer("a", ours) and peers.may_refer("c", ours)
    assert not peers.may_refer("b", ours) and peers.theirs("b") is None
