"""The WAN harness's pure rules: profiles, tc arguments, the 10% verdict, relay forwarding and delay,
the probe's steady rate, and where a demo's processes go. No namespaces here (test_wan_harness.py)."""

import pytest

from agora.bench.wan.links import PROBE_NODE
from agora.bench.wan.probe import steady_rate_mbit
from agora.bench.wan.profiles import (
    PROFILES,
    LinkMeasurement,
    LinkSpec,
    judge_measurement,
    profile_named,
    tbf_arguments,
)
from agora.bench.wan.relay import VNET_HEADER_BYTES, Relay, RelayPort, frame_delay_s
from agora.bench.wan.swarm import SpareNodes, chaos_predecessor, chaos_spares, demo_process_names, node_links, straggler_name
from agora.node.demo.processes import ChildFailed
from agora.node.demo.demo import DemoOptions


def test_profiles_are_the_issues():
    assert PROFILES["agora-floor"].link == LinkSpec(200, 200, 80.0)
    assert PROFILES["residential"].link == LinkSpec(20, 100, 40.0)
    assert PROFILES["intercontinental"].link == LinkSpec(1000, 1000, 150.0)
    assert PROFILES["lan"].link == LinkSpec(None, None, 0.0)
    straggler = PROFILES["straggler"]
    assert straggler.straggler.upload_mbit * 10 == straggler.link.upload_mbit
    assert straggler.links() == [straggler.link, straggler.straggler]
    with pytest.raises(ValueError, match="unknown profile 'moon'.*agora-floor"):
        profile_named("moon")


def test_tbf_bucket_passes_gso_frames_and_the_queue_holds_two_bdp():
    args = dict(zip(*[iter(tbf_arguments(200, 80.0))] * 2))
    assert args["rate"] == "200mbit"
    assert int(args["burst"]) >= 128 * 1024  # a 64 KiB GSO frame passes whole
    bdp = 200e6 / 8 * 0.080
    assert int(args["limit"]) >= int(args["burst"]) + 2 * bdp - 1
    fast = dict(zip(*[iter(tbf_arguments(1000, 150.0))] * 2))
    assert int(fast["burst"]) >= 1000e6 / 8 * 0.004  # timer granularity cannot cap the rate
    with pytest.raises(ValueError):
        tbf_arguments(0, 10)


def test_judge_accepts_within_ten_percent_and_names_what_is_off():
    link = LinkSpec(200, 200, 80.0)
    assert judge_measurement(LinkMeasurement(link, 80.5, 191.3, 185.0)) == []
    problems = judge_measurement(LinkMeasurement(link, 95.0, 150.0, 191.0))
    assert len(problems) == 2
    assert "RTT measured 95.0 ms, set 80 ms" in problems[0]
    assert "upload measured 150.0 Mbit/s, set 200 Mbit/s" in problems[1]
    assert judge_measurement(LinkMeasurement(link, 80.0, None, 190.0)) == ["upload not measured (set 200 Mbit/s)"]


def test_unshaped_directions_are_not_judged_and_zero_delay_allows_a_millisecond():
    lan = LinkSpec(None, None, 0.0)
    assert judge_measurement(LinkMeasurement(lan, 0.3, 9000.0, None)) == []
    assert judge_measurement(LinkMeasurement(lan, 2.5, None, None))  # 2.5 ms is added delay


def test_a_pair_of_equal_ports_sees_its_round_trip():
    a, b = RelayPort("p0", "02:77:00:00:00:01", 0.080), RelayPort("p1", "02:77:00:00:00:02", 0.080)
    assert frame_delay_s(a, b) + frame_delay_s(b, a) == pytest.approx(0.080)
    slow = RelayPort("p2", "02:77:00:00:00:03", 0.200)
    assert frame_delay_s(a, slow) == frame_delay_s(slow, a) == pytest.approx(0.070)


def _frame(destination_mac: str) -> bytes:
    mac = bytes(int(part, 16) for part in destination_mac.split(":"))
    return bytes(VNET_HEADER_BYTES) + mac + bytes(6) + b"\x08\x00" + bytes(40)


def test_relay_forwards_by_destination_mac_and_floods_the_rest():
    ports = [RelayPort(f"p{i}", f"02:77:00:00:00:0{i + 1}", 0.0) for i in range(3)]
    relay = Relay(ports)
    assert relay._destinations(0, _frame("02:77:00:00:00:03")) == (2,)
    assert relay._destinations(0, _frame("ff:ff:ff:ff:ff:ff")) == (1, 2)  # broadcast (ARP)
    assert relay._destinations(1, _frame("02:99:00:00:00:01")) == (0, 2)  # unknown unicast
    assert relay._destinations(0, _frame("02:77:00:00:00:01")) == ()  # never back to the sender


def test_steady_rate_skips_the_start_of_a_transfer():
    # 1 s at 8 Mbit/s (slow start), then 4 s at 80 Mbit/s: only the steady part counts.
    samples, total = [], 0
    for tenth in range(51):
        samples.append((tenth / 10, total))
        total += 100_000 if tenth < 10 else 1_000_000
    assert steady_rate_mbit(samples) == pytest.approx(80.0)
    assert steady_rate_mbit(samples[:1]) is None


def test_steady_rate_is_not_raised_by_bytes_released_at_once_after_a_retransmission():
    # 200 Mbit/s, read every 5 ms for 1.5 s. A loss at 0.45 s holds what arrives after it in the
    # out-of-order queue until its retransmission lands at 0.62 s, inside the steady part (from
    # 0.6 s): then 4.25 MB are readable at once.
    samples, total = [], 0
    for ms in range(0, 1501, 5):
        t = ms / 1000
        samples.append((t, total))
        total += 125_000
    held = next(n for t, n in samples if t >= 0.45)
    jumped = [(t, held if 0.45 <= t < 0.62 else n) for t, n in samples]
    ends = (jumped[-1][1] - next(n for t, n in jumped if t >= 0.6)) * 8 / 1e6 / 0.9
    assert ends == pytest.approx(233.3, abs=0.1)  # the steady part's ends alone count the held bytes in it
    assert steady_rate_mbit(jumped) == pytest.approx(200.0, rel=0.01)  # (a window holds 19 or 20 reads)
    # A slow link's reads are few and large: its windows span several of them.
    slow = [(t / 20, 65_536 * t) for t in range(31)]  # 10.5 Mbit/s in 64 KiB reads
    assert steady_rate_mbit(slow) == pytest.approx(10.49, abs=0.01)


def test_every_demo_process_gets_a_node_and_the_straggler_is_one_replica():
    options = DemoOptions(stages=3, replicas=2, trainers=1)
    names = demo_process_names(options)
    assert names[:2] == ["bootstrap", "authorizer"] and "worker-s2-r1" in names and names[-1] == "trainer-0"
    assert "authorizer" not in demo_process_names(DemoOptions(insecure=True))
    links = node_links(PROFILES["straggler"], options)
    assert straggler_name(options) == "worker-s1-r1"
    assert links["worker-s1-r1"] == PROFILES["straggler"].straggler
    assert links["worker-s1-r0"] == links["trainer-0"] == PROFILES["straggler"].link
    assert links[PROBE_NODE] == LinkSpec(None, None, 80.0)


def test_chaos_newcomers_take_spare_nodes_and_free_their_predecessors():
    assert chaos_predecessor("worker-s1-r0.j1") == "worker-s1-r0"
    assert chaos_predecessor("worker-s1-r0.j3") == "worker-s1-r0.j2"
    assert chaos_predecessor("trainer-0.j1") == "trainer-0"
    assert chaos_predecessor("worker-s0-r2") is None and chaos_predecessor("trainer-0.jx") is None
    assert list(node_links(PROFILES["lan"], DemoOptions(), spares=2))[-3:] == ["spare-0", "spare-1", PROBE_NODE]
    assert chaos_spares(DemoOptions(stages=3, replicas=2, trainers=2)) == 8
    spares = SpareNodes(["spare-0", "spare-1"])
    assert spares.node_for("worker-s1-r0.j1") == "spare-0"
    assert spares.node_for("worker-s1-r0.j1") == "spare-0"  # prefix and host ask for the same name
    assert spares.node_for("trainer-0.j1") == "spare-1"
    # .j1 was killed before .j2 starts: its node is free again, and the only one.
    assert spares.node_for("worker-s1-r0.j2") == "spare-0"
    with pytest.raises(ChildFailed, match="worker-s2-r1.j1: no spare node left"):
        spares.node_for("worker-s2-r1.j1")
    spares.reset()
    assert spares.node_for("worker-s2-r1.j1") == "spare-0"
    # With a node free elsewhere, a newcomer does not take the one its predecessor just left.
    spares = SpareNodes(["spare-0", "spare-1", "spare-2"])
    assert [spares.node_for(n) for n in ("worker-s0-r0.j1", "worker-s0-r0.j2", "worker-s0-r0.j3")] == [
        "spare-0", "spare-1", "spare-2"]
    assert spares.node_for("worker-s0-r0.j4") == "spare-0"
