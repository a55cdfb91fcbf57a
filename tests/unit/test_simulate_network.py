"""The simulator's links: Linux's slow start after idle, and measured DHT costs read between swarm sizes."""

import math

import pytest
import simpy

from agora.node.simulate.network import (
    INITIAL_WINDOW,
    SEGMENT_BYTES,
    CongestionWindow,
    NodeLink,
    at_size,
    dht_op_s,
    transmit,
)
from agora.node.simulate.scenario import DHTSection, LinkSection

RTT = 0.080
RATE = 192e6  # bits/s: agora-floor
FRAME = 131_091  # small's relayed frame per microbatch (91 segments)


def _flight_s(segments: float) -> float:
    return segments * SEGMENT_BYTES * 8 / RATE


@pytest.mark.parametrize("idle, window", [(0.2, 160), (0.5, 80), (0.6, 40), (10.0, INITIAL_WINDOW)])
def test_an_idle_window_is_halved_per_retransmission_timeout_down_to_the_initial_one(idle, window):
    """The timeout is the round trip plus Linux's 200 ms floor: 0.28 s. Idle 0.2 s: untouched; 0.5 s:
    one timeout passed, halved once; 0.6 s: the second halving as the idle time runs past it; 10 s:
    floored at 10 segments."""
    congestion = CongestionWindow(segments=160, last_sent=0.0)
    congestion.restart_after_idle(idle, RTT)
    assert congestion.segments == window


def test_a_frame_from_the_initial_window_waits_three_round_trips_of_slow_start():
    """91 segments from 10: flights of 10, 20 and 40 each wait out the rest of a round trip, the last
    21 go within the fourth window; the window ends at 80, twice the largest flight that filled it."""
    congestion = CongestionWindow()
    extra = congestion.send_s(FRAME, RATE, RTT)
    assert extra == pytest.approx(3 * RTT - _flight_s(10 + 20 + 40))
    assert congestion.segments == 80


def test_a_window_that_holds_the_frame_sends_it_without_rounds_and_does_not_grow_unused():
    congestion = CongestionWindow(segments=200)
    assert congestion.send_s(FRAME, RATE, RTT) == 0.0
    assert congestion.segments == 200


def test_a_window_never_grows_past_the_bandwidth_delay_product():
    path = RATE * RTT / 8 / SEGMENT_BYTES
    congestion = CongestionWindow(segments=path)
    assert congestion.send_s(20_000_000, RATE, RTT) == 0.0
    assert congestion.segments == pytest.approx(path)


def _send_twice(slow_start: bool, gap_s: float) -> list[float]:
    """Two frames from one node to another, `gap_s` apart: how long each took to arrive."""
    env = simpy.Environment()
    kind = LinkSection(name="wan", up_mbit=RATE / 1e6, down_mbit=RATE / 1e6, rtt_ms=RTT * 1000,
                       slow_start_after_idle=slow_start)
    sender, receiver = NodeLink.on(env, kind), NodeLink.on(env, kind)
    took = []

    def frames():
        for gap in (0.0, gap_s):
            yield env.timeout(gap)
            began = env.now
            yield from transmit(env, sender, receiver, FRAME)
            took.append(env.now - began)

    env.process(frames())
    env.run()
    return took


def test_transmit_pays_slow_start_on_an_idle_connection_only_where_the_host_restarts_it():
    plain = FRAME * 8 / RATE + RTT / 2
    assert _send_twice(False, 5.0) == pytest.approx([plain, plain])
    from_initial = plain + 3 * RTT - _flight_s(10 + 20 + 40)
    assert _send_twice(True, 5.0) == pytest.approx([from_initial, from_initial])
    first, busy = _send_twice(True, 0.0)  # back to back: the window the first frame grew carries it
    assert busy == pytest.approx(plain + RTT - _flight_s(80))


def test_a_measured_table_is_read_as_a_power_law_between_its_sizes():
    table = ((8.0, 27.3), (16.0, 44.3), (32.0, 56.3))
    assert at_size(table, 8) == pytest.approx(27.3)
    assert at_size(table, 16) == pytest.approx(44.3)
    assert at_size(table, round(math.sqrt(8 * 16))) == pytest.approx(
        27.3 * (44.3 / 27.3) ** (math.log(11 / 8) / math.log(2)))
    assert at_size(table, 4) == pytest.approx(27.3 * 27.3 / 44.3)  # the first two extended below
    assert at_size(table, 64) == pytest.approx(56.3 * 56.3 / 44.3)  # the last two above
    assert at_size(((8.0, 250.0),), 64) == 250.0
    assert at_size(((2.0, 0.0), (4.0, 10.0)), 8) == pytest.approx(20.0)  # a zero: linear in log N


def test_a_store_takes_its_own_measured_time_or_a_gets():
    measured = DHTSection(get_ms_at=((8.0, 200.0),), store_ms_at=((8.0, 300.0),))
    assert dht_op_s(measured, 8, "get") == pytest.approx(0.200)
    assert dht_op_s(measured, 8, "store") == pytest.approx(0.300)
    assert dht_op_s(DHTSection(get_ms_at=((8.0, 200.0),)), 8, "store") == pytest.approx(0.200)
    assert dht_op_s(DHTSection(base_ms=5.0, per_doubling_ms=2.0), 16) == pytest.approx(0.011)
