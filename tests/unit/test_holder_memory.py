"""`HolderMemory` (dht/holders.py): which stores of a key go straight to the holders a search found,
and which search again beside their store."""

import pytest
from hivemind.dht.routing import DHTID

from agora.dht.holders import HolderMemory

KEY, OTHER = DHTID.generate(source="a"), DHTID.generate(source="b")
HOLDERS = {DHTID.generate(source="h1"): "peer-1", DHTID.generate(source="h2"): "peer-2"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_search_serves_its_own_store_and_the_next_ones_and_every_fourth_searches_beside_its_store():
    memory = HolderMemory(Clock(), search_every=4)
    assert memory.recall(KEY) == (None, False)  # never searched: search first
    memory.remember(KEY, HOLDERS)
    assert [memory.recall(KEY) for _ in range(3)] == [(HOLDERS, False)] * 3
    assert memory.recall(KEY) == (HOLDERS, True)  # the search's fourth store: searched again beside it
    assert [memory.recall(KEY) for _ in range(3)] == [(HOLDERS, False)] * 3  # one search started, not one a store
    assert memory.recall(KEY) == (HOLDERS, True)
    assert memory.recall(OTHER) == (None, False)


def test_holders_older_than_the_ttl_are_searched_again():
    clock = Clock()
    memory = HolderMemory(clock, search_every=100, ttl_s=30.0)
    memory.remember(KEY, HOLDERS)
    clock.now = 30.0
    assert memory.recall(KEY) == (HOLDERS, False)
    clock.now = 30.1
    assert memory.recall(KEY) == (HOLDERS, True)
    assert memory.recall(KEY) == (HOLDERS, False)  # the age counts from the search started


def test_an_unanswered_store_makes_the_next_one_search():
    memory = HolderMemory(Clock())
    memory.remember(KEY, HOLDERS)
    memory.forget(KEY)
    memory.forget(OTHER)  # nothing held: nothing to do
    assert memory.recall(KEY) == (None, False)


def test_the_least_recently_stored_key_goes_first_past_the_bound():
    memory = HolderMemory(Clock(), max_keys=2)
    memory.remember(KEY, HOLDERS)
    memory.remember(OTHER, HOLDERS)
    assert memory.recall(KEY) == (HOLDERS, False)  # KEY is now the most recent
    memory.remember(DHTID.generate(source="c"), HOLDERS)
    assert memory.recall(OTHER) == (None, False) and memory.recall(KEY) == (HOLDERS, False)


def test_the_holders_given_are_a_copy():
    memory = HolderMemory(Clock())
    holders = dict(HOLDERS)
    memory.remember(KEY, holders)
    holders.clear()
    assert memory.recall(KEY) == (HOLDERS, False)


def test_search_every_must_be_positive():
    with pytest.raises(ValueError, match="search_every"):
        HolderMemory(search_every=0)


def test_reads_and_stores_count_apart_and_a_search_for_either_serves_both():
    memory = HolderMemory(Clock(), search_every=4, read_search_every=3)
    memory.remember(KEY, HOLDERS, reading=True)  # a read searched: its first use
    assert [memory.recall(KEY, reading=True) for _ in range(2)] == [(HOLDERS, False)] * 2
    assert [memory.recall(KEY) for _ in range(4)] == [(HOLDERS, False)] * 4  # stores: none counted yet
    assert memory.recall(KEY, reading=True) == (HOLDERS, True)  # three reads used it: the fourth searches beside
    assert memory.recall(KEY) == (HOLDERS, False)  # that search restarted the stores' count too
