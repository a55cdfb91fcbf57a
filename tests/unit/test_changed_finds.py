"""What a holder answers a changed find with (dht/changed_finds.py ``changed_entries``): the entries
its asker lacks or holds older copies of, and its whole dictionary's newest expiration; and that the
asker's copies merged with that answer are the whole dictionary merged with them."""

from hivemind.dht.storage import DictionaryDHTValue
from hivemind.utils.timed_storage import ValueWithExpiration, get_dht_time

from agora.dht.changed_finds import ChangedDigests, ChangedFindRequest, changed_digests, changed_entries, subkey_digest
from agora.dht.reads import ReadMemory


def dictionary(entries: dict) -> DictionaryDHTValue:
    held = DictionaryDHTValue()
    for subkey, (value, expiration) in entries.items():
        held.store(subkey, value, expiration)
    return held


T = get_dht_time() + 3600.0  # hivemind's dictionaries hide entries expired by its clock
HOLDER = {"same": (b"s", T + 100), "newer": (b"n2", T + 120), "new": (b"x", T + 110), "older": (b"o1", T + 90),
          "gone": (None, T + 130)}  # a tombstone
ASKER = {"same": T + 100, "newer": T + 105, "older": T + 95, "gone": T + 125}


def test_the_answer_is_what_the_asker_lacks_or_holds_older_with_the_whole_dictionarys_expiration():
    answer = changed_entries(dictionary(HOLDER), {subkey_digest(k): e for k, e in ASKER.items()})
    assert {subkey: (item.value, item.expiration_time) for subkey, item in answer.items()} == {
        "newer": (b"n2", T + 120), "new": (b"x", T + 110), "gone": (None, T + 130)}
    assert answer.latest_expiration_time == T + 130


def test_nothing_changed_is_an_empty_answer_that_is_still_as_new_as_the_holder():
    held = dictionary(HOLDER)
    answer = changed_entries(held, {subkey_digest(k): e for k, (_, e) in HOLDER.items()})
    assert list(answer.items()) == [] and answer.latest_expiration_time == T + 130


def test_an_asker_holding_nothing_gets_everything():
    answer = changed_entries(dictionary(HOLDER), {})
    assert {subkey for subkey, _ in answer.items()} == set(HOLDER)


def test_the_memory_merged_with_the_changes_is_the_memory_merged_with_the_whole_dictionary():
    def memory_holding(entries: dict) -> ReadMemory:
        memory = ReadMemory(lambda: 0.0)
        memory.merge("k", ValueWithExpiration(dict(entries), T + 200))
        return memory

    asker = {k: ValueWithExpiration(b"mine", e) for k, e in ASKER.items()}
    whole = memory_holding(asker).merge("k", ValueWithExpiration(
        {k: ValueWithExpiration(v, e) for k, (v, e) in HOLDER.items()}, T + 130))
    memory = memory_holding(asker)
    answer = changed_entries(dictionary(HOLDER), memory.held("k"))
    changed = memory.merge("k", ValueWithExpiration({k: item for k, item in answer.items()}, T + 130))
    assert changed.value == whole.value
    assert changed.value["older"].value == b"mine"  # the asker's later copy wins, as it would have


def test_a_request_names_an_entry_in_under_20_bytes_where_the_answer_would_carry_it_in_2700():
    request = ChangedFindRequest(key=b"k" * 20, seen_subkeys=[subkey_digest(f"peer-{i}") for i in range(20)],
                                 seen_expirations=[float(i) for i in range(20)])
    assert request.ByteSize() < 20 * 20


def test_the_digests_name_what_the_entries_would_send_in_16_bytes_each():
    seen = {subkey_digest(k): e for k, e in ASKER.items()}
    named = changed_digests(dictionary(HOLDER), seen)
    assert named == {subkey_digest(subkey): item.expiration_time
                     for subkey, item in changed_entries(dictionary(HOLDER), seen).items()}
    answer = ChangedDigests(subkeys=list(named), expirations=list(named.values()))
    assert answer.ByteSize() < 20 * len(named)
