"""When the averaging loop reads its stage's round board (node/averaging/probes.py): pure, no clock."""

from __future__ import annotations

import pytest

from agora.node.averaging.probes import ProbeSchedule, probe_intervals

pytestmark = pytest.mark.timeout(10)


def test_the_first_probe_is_due_at_once_and_reads_everything():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    assert probes.due_in(100.0, steps=0) <= 0
    assert probes.reads_replicas(steps=0, now=100.0)


def test_a_training_replica_probes_every_base_interval_and_reads_a_settled_count_every_settled_interval():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    assert probes.replicas_s == 8.0  # twice the quiet interval: the matchmaking window
    assert probes.settled_s == 80.0  # ten windows
    read_at = []
    for step, now in enumerate([0.0, 1.0, 8.0, 9.0, 16.0, 87.9, 88.0, 89.0, 168.5]):
        if probes.reads_replicas(steps=step, now=now):
            probes.replicas_read(now, count=4)
            read_at.append(now)
        probes.probed(now, steps=step)
        assert probes.due_in(now, steps=step + 1) == pytest.approx(1.0)
    assert read_at == [0.0, 8.0, 88.0, 168.5]  # the second read agrees with the first: settled


def test_a_count_stands_once_two_reads_agree():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.replicas_read(0.0, count=12)  # the stage still coming up
    assert probes.replicas_due(8.0)
    probes.replicas_read(8.0, count=16)
    assert probes.replicas_due(16.0)
    probes.replicas_read(16.0, count=16)
    assert not probes.replicas_due(24.0) and probes.replicas_due(96.0)


def test_a_count_in_doubt_is_read_again_a_replicas_interval_after_the_last_read():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.replicas_read(0.0, count=4)
    probes.replicas_read(8.0, count=4)  # two reads agree: settled
    assert not probes.replicas_due(16.0)
    probes.count_in_doubt()  # a round formed short of the count, say
    assert not probes.replicas_due(15.9) and probes.replicas_due(16.0) and probes.reads_replicas(steps=1, now=16.0)
    probes.replicas_read(16.0, count=4)  # read again, and it agrees: settled again
    assert not probes.replicas_due(24.0) and not probes.replicas_due(95.9) and probes.replicas_due(96.0)


def test_a_replica_that_counts_itself_alone_reads_the_count_every_replicas_interval():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.replicas_read(0.0, count=1)  # no round of its own would show a newcomer
    assert probes.replicas_due(8.0)
    probes.replicas_read(8.0, count=1)  # alone, however many reads agree
    assert probes.replicas_due(16.0)


def test_a_round_that_read_the_count_puts_the_probes_read_off():
    probes = ProbeSchedule(base_s=1.0, quiet_s=2.0, replicas_s=3.0)
    assert probes.replicas_due(0.0)
    probes.replicas_read(0.5, count=1)  # a round about to start read it
    assert not probes.replicas_due(3.4) and not probes.reads_replicas(steps=1, now=3.4)
    assert probes.replicas_due(3.5) and probes.reads_replicas(steps=1, now=3.5)


def test_a_quiet_replica_probes_every_quiet_interval_for_the_announcements_only():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.probed(0.0, steps=7)
    assert probes.due_in(0.0, steps=7) == pytest.approx(1.0)  # not yet known to be quiet
    assert not probes.reads_replicas(steps=7, now=0.0)
    probes.probed(1.0, steps=7)
    assert probes.due_in(1.0, steps=7) == pytest.approx(4.0)
    assert not probes.reads_replicas(steps=7, now=100.0)  # never due while quiet


def test_a_step_after_a_quiet_spell_brings_the_next_probe_back_to_the_base_pace():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.probed(0.0, steps=7)
    probes.probed(1.0, steps=7)  # quiet: the next at 5.0
    assert probes.due_in(1.5, steps=8) == pytest.approx(0.5)  # base_s after the last probe
    assert probes.due_in(3.0, steps=8) <= 0
    assert probes.reads_replicas(steps=8, now=3.0)
    probes.probed(3.0, steps=8)
    assert probes.due_in(3.0, steps=8) == pytest.approx(1.0)


def test_look_now_makes_the_next_probe_due():
    probes = ProbeSchedule(base_s=1.0, quiet_s=4.0)
    probes.probed(0.0, steps=1)
    probes.probed(1.0, steps=1)
    probes.look_now()
    assert probes.due_in(1.0, steps=1) <= 0


@pytest.mark.parametrize("base_s, quiet_s, replicas_s, settled_s", [
    (0.0, 1.0, None, None), (2.0, 1.0, None, None), (-1.0, 1.0, None, None), (1.0, 2.0, 0.5, None),
    (1.0, 2.0, 4.0, 3.0)])
def test_intervals_out_of_order_are_refused(base_s, quiet_s, replicas_s, settled_s):
    with pytest.raises(ValueError, match="probe intervals"):
        ProbeSchedule(base_s, quiet_s, replicas_s, settled_s)


def test_the_intervals_are_a_quarter_and_a_half_of_the_window_unless_given():
    assert probe_intervals(3.0) == (0.75, 1.5)
    assert probe_intervals(0.4) == (0.25, 0.25)  # never below 0.25 s, quiet never below base
    assert probe_intervals(100.0) == (10.0, 50.0)
    assert probe_intervals(3.0, probe_s=2.0, quiet_probe_s=1.0) == (2.0, 2.0)
