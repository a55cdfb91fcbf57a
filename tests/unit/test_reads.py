"""agora.dht.reads: which read of a dictionary key is full and which quick, and what a peer remembers
of its reads (pure: hivemind's ValueWithExpiration, a fake clock)."""

import pytest
from hivemind.utils.timed_storage import ValueWithExpiration

from agora.dht.reads import ReadMemory


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def found(**entries: tuple[object, float]) -> ValueWithExpiration:
    items = {subkey: ValueWithExpiration(value, expiration) for subkey, (value, expiration) in entries.items()}
    return ValueWithExpiration(items, max(item.expiration_time for item in items.values()))


def values(merged: ValueWithExpiration) -> dict:
    return {subkey: (item.value, item.expiration_time) for subkey, item in merged.value.items()}


def test_the_first_read_and_every_second_one_are_full_the_others_quick_at_the_newest_expiration_seen():
    memory = ReadMemory(Clock())
    assert memory.next_bar("k") is None
    memory.merge("k", found(a=("a1", 130.0), b=("b1", 150.0)))
    assert memory.next_bar("k") == 150.0
    assert memory.next_bar("k") is None
    assert memory.next_bar("k") == 150.0


def test_a_quick_read_with_nothing_remembered_is_full():
    memory = ReadMemory(Clock())
    assert memory.next_bar("k") is None
    memory.merge("k", None)
    assert memory.next_bar("k") is None  # nothing seen: nothing a holder could be measured against


def test_an_entry_seen_once_stays_in_the_answers_until_it_expires_though_later_answers_lack_it():
    clock = Clock()
    memory = ReadMemory(clock)
    memory.merge("k", found(a=("a1", 130.0), newcomer=("n1", 160.0)))
    assert values(memory.merge("k", found(a=("a2", 140.0)))) == {"a": ("a2", 140.0), "newcomer": ("n1", 160.0)}
    clock.now = 161.0
    assert values(memory.merge("k", found(a=("a3", 190.0)))) == {"a": ("a3", 190.0)}


def test_the_later_expiration_wins_so_a_tombstone_hides_its_entry_and_an_older_copy_does_not_revive_it():
    memory = ReadMemory(Clock())
    memory.merge("k", found(a=("a1", 130.0)))
    assert values(memory.merge("k", found(a=(None, 130.001)))) == {"a": (None, 130.001)}
    assert values(memory.merge("k", found(a=("a1", 130.0)))) == {"a": (None, 130.001)}


def test_a_plain_value_is_returned_as_found_and_forgets_the_keys_dictionary():
    memory = ReadMemory(Clock())
    memory.merge("k", found(a=("a1", 130.0)))
    plain = ValueWithExpiration("v", 140.0)
    assert memory.merge("k", plain) is plain
    assert memory.merge("k", None) is None


def test_past_max_keys_the_oldest_key_is_forgotten_and_its_next_read_is_full():
    memory = ReadMemory(Clock(), max_keys=2)
    for key in ("k1", "k2", "k3"):
        memory.next_bar(key)
        memory.merge(key, found(a=("a", 130.0)))
    assert memory.next_bar("k1") is None
    assert memory.next_bar("k3") == 130.0


def test_full_read_every_must_be_positive():
    with pytest.raises(ValueError, match="full_read_every"):
        ReadMemory(Clock(), full_read_every=0)
