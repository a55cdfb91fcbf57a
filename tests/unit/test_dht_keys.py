"""Which keys an admitted peer may store, without a network: the run's record families, its ban list
and hivemind's matchmaking keys of its averagers, by the hash hivemind names them by; nothing else."""

from agora.dht.key_policy import KeyTable, key_hash
from agora.dht.key_families import BAN_LIST
from agora.dht.keys import averaging_keys, averaging_prefix, bans_key, units_key, worker_key

RUN = "ban-run"


def test_the_key_table_knows_the_runs_record_ban_and_averaging_keys_and_nothing_else():
    table = KeyTable(RUN, methods=("sparta", "diloco"), max_stages=8)
    assert table.family(key_hash(worker_key(RUN, 3)))[1] == 3
    assert table.family(key_hash(units_key(RUN, 4095)))[0].name == "units"
    assert table.family(key_hash(bans_key(RUN)))[0] is BAN_LIST
    assert table.family(key_hash(worker_key("other-run", 3))) is None
    assert averaging_prefix(RUN, 2, "sparta") == "ban-run_stage2_sparta"
    keys = list(averaging_keys(RUN, methods=("sparta", "diloco"), max_stages=8))
    assert len(keys) == len(set(keys)) == 8 * 2 * 16 and "ban-run_stage7_diloco.0b1111" in keys
    assert all(table.is_averaging(key_hash(key)) for key in keys)
    for stranger in ("free-key", "ban-run_stage8_sparta.0b0000", "ban-run_stage0_sparta.0b00000",
                     "ban-run_stage0_sparta.all_averagers"):
        assert table.family(key_hash(stranger)) is None and not table.is_averaging(key_hash(stranger))
