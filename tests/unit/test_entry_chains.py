"""A changed find's answer naming a chain its asker holds (dht/entry_chains.py): the entry comes back
byte for byte, only where the asker's tag is the entry's chain's, and never from a tag not held."""

from __future__ import annotations

import base64

import pytest
from hivemind.utils import MSGPackSerializer

from agora.auth.authority import RunAuthority
from agora.auth.node_state import CREDENTIAL_FILE
from agora.dht.entry_chains import (REFERENCE_MARK, TAG_BYTES, HeldChains, chain_tag, entry_parts, named, restore_all,
                                    tag_to_name)
from agora.dht.entry_value import credential_attachment

KEY = b"k" * 20


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Two writers' chains (PEM)."""
    base = tmp_path_factory.mktemp("entry-chains")
    authority = RunAuthority(base / "authority", run_id="run")
    for name in ("one", "two"):
        authority.mint(base / name, role="worker", stage=0)
    return [(base / name / CREDENTIAL_FILE).read_bytes() for name in ("one", "two")]


def _entry(chain: bytes, record: bytes = b"\x81\xa4step\x01") -> bytes:
    """A typed entry's value as a holder stores it: record, chain, owner's signature (base64, as hivemind writes it; any here)."""
    return record + credential_attachment(chain) + b"[signature:" + base64.b64encode(bytes(range(256))) + b"]"


def test_a_named_chain_is_put_back_byte_for_byte_and_the_entry_is_a_third_of_its_size(chains):
    value = _entry(chains[0])
    parts = entry_parts(value)
    assert parts is not None and parts.record + parts.attachment + parts.signature == value
    short = tag_to_name(value, parts.tag)
    assert short == named(parts) and short.endswith(parts.signature)
    assert len(short) < len(value) / 3 and REFERENCE_MARK in short  # a ~1.4 KB chain, here with a short record
    held = HeldChains()
    assert held.restore(short) is None  # not held: the answer cannot be judged
    held.note(KEY, b"d" * 8, value)
    assert held.restore(short) == value
    assert held.tags(KEY) == {b"d" * 8: parts.tag} and held.tags(b"other key") == {}


def test_only_the_chain_the_asker_holds_is_named(chains):
    old, renewed = _entry(chains[0]), _entry(chains[1])
    assert tag_to_name(renewed, entry_parts(old).tag) is None  # a renewed credential: sent whole
    assert tag_to_name(old, b"") is None and tag_to_name(old, b"x" * (TAG_BYTES + 1)) is None
    for plain in (b"\x81\xa4step\x01", b"\x81\xa4step\x01[signature:abc]", _entry(chains[0])[:-1]):
        assert entry_parts(plain) is None and tag_to_name(plain, chain_tag(b"")) is None  # no chain, or unsigned


def test_values_that_name_nothing_pass_as_they_are_and_an_unheld_name_refuses_the_whole_answer(chains):
    held = HeldChains()
    whole, plain = _entry(chains[0]), b"\x81\xa4step\x01"
    held.note(KEY, b"a" * 8, whole)
    assert held.restore(whole) == whole and held.restore(plain) == plain
    other = named(entry_parts(_entry(chains[1])))
    assert restore_all(held, {"a": (named(entry_parts(whole)), 1.0), "b": (plain, 2.0)}) == {"a": (whole, 1.0),
                                                                                            "b": (plain, 2.0)}
    assert restore_all(held, {"a": (whole, 1.0), "b": (other, 2.0)}) is None
    truncated = REFERENCE_MARK + b"[signature:" + b"s" * 256 + b"]"  # a mark with no room for a tag
    assert held.restore(truncated) is None


def test_the_memory_is_bounded_and_a_forgotten_chain_is_named_no_more(chains):
    held = HeldChains(max_chains=1, max_keys=2, max_entries_per_key=2)
    first, second = _entry(chains[0]), _entry(chains[1])
    held.note(KEY, b"1" * 8, first)
    held.note(KEY, b"2" * 8, second)  # the first writer's chain goes
    assert len(held) == 1
    assert held.tags(KEY) == {b"2" * 8: entry_parts(second).tag}
    assert held.restore(named(entry_parts(first))) is None
    held.note(KEY, b"3" * 8, second)
    held.note(KEY, b"4" * 8, second)  # past max_entries_per_key the key's oldest entry goes
    assert set(held.tags(KEY)) == {b"3" * 8, b"4" * 8}
    held.note(b"key two", b"5" * 8, second)
    held.note(b"key three", b"6" * 8, second)  # past max_keys the least recently read key goes
    assert held.tags(KEY) == {} and set(held.tags(b"key three")) == {b"6" * 8}
    key_of_a_record = MSGPackSerializer.dumps("peer[owner:ssh-rsa AAAA]")
    held.note(key_of_a_record, b"7" * 8, b"not an entry")  # nothing to remember
    assert held.tags(key_of_a_record) == {}
