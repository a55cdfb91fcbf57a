"""The DHT storage ledger without a network: a flood from one owner is refused over its bound, the
total bound refuses rather than evicts, re-stores and expiries count right."""

from agora.dht.storage_bounds import StorageLedger, StorageLimits

NOW = 1_800_000_000.0


def test_a_flood_from_one_owner_is_refused_over_its_bound_and_no_held_entry_is_evicted():
    ledger = StorageLedger(StorageLimits(max_entries_per_owner=3, max_bytes_per_owner=1000, max_entries=5,
                                         max_bytes=10_000))
    admit = lambda key, owner, size=10, expires=NOW + 60: ledger.admit(key, b"s", owner, size, expires, NOW)  # noqa: E731
    assert [admit(k, "flood") for k in (b"1", b"2", b"3")] == [None, None, None]
    assert "one owner" in admit(b"4", "flood")
    assert admit(b"1", "flood", size=20) is None  # a re-store replaces its entry: not one more
    assert ledger.held_by("flood") == (3, 40)
    assert "one owner" in admit(b"2", "flood", size=990)  # bytes count too
    assert admit(b"h1", "honest") is None and admit(b"h2", "honest") is None
    assert "storage bound" in admit(b"h3", "honest")  # the total is full: refused, not evicted
    assert ledger.entries == 5 and ledger.refused == {"owner": 2, "total": 1}
    ledger.admit(b"x", b"s", "honest", 10, NOW + 10, NOW + 120)  # at a later time every entry has expired
    assert ledger.entries == 1 and ledger.held_by("flood") == (0, 0)
