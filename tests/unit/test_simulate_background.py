"""A replica's DHT operations between rounds in the simulator: the loop's probe schedule, its round
closes and the heartbeat, as the times and kinds of the operations it makes."""

import pytest

from agora.node.simulate.scenario import scenario_from_dict
from agora.node.simulate.swarm import SimSwarm


class RecordingSwarm(SimSwarm):
    """The simulated swarm, noting when each DHT operation began and its kind."""

    def __init__(self, scenario):
        self.ops: list[tuple[float, str]] = []
        super().__init__(scenario)

    def dht_op(self, kind: str = "get"):
        self.ops.append((round(self.env.now, 3), kind))
        yield from super().dht_op(kind)


def _stage(replicas: int, every_steps: int, heartbeat_s: float = 0.0, between_rounds: bool = True,
           workers: dict = None, compute: dict = None, matchmaking_dht_ops: int = 4):
    """One stage stepping every 2 s for 10 s, a 3 s window (probes every 0.75 s, 1.5 s quiet), DHT
    operations of no latency."""
    swarm = RecordingSwarm(scenario_from_dict({
        "run": {"seconds": 10.0, "stages": 1, "batch_s": 2.0},
        "compute": {"ms": [1.0], **(compute or {})},
        "workers": {"replicas": replicas, "heartbeat_s": heartbeat_s, **(workers or {})},
        "dht": {"base_ms": 0.0, "per_doubling_ms": 0.0},
        "averaging": {"method": "sparta", "every_steps": every_steps, "fraction": 0.5, "vector_bytes": 0,
                      "matchmaking_s": 3.0, "between_rounds": between_rounds,
                      "matchmaking_dht_ops": matchmaking_dht_ops},
    }))
    swarm.run()
    return swarm


def test_a_replica_probes_at_each_step_and_a_quiet_read_a_base_interval_later_and_counts_every_window():
    ops = _stage(1, every_steps=1000).ops
    # The count (the second read) falls due every 3 s window: read at 0, then at the probes of 4 and 8.
    counted = {0.0, 4.0, 8.0}
    expected = [(t, "get") for step in (0.0, 2.0, 4.0, 6.0, 8.0)
                for t in ((step, step) if step in counted else (step,)) + (step + 0.75,)]
    assert ops == expected


def test_no_probe_while_a_round_runs_and_a_close_after_it():
    """A round at steps 2 and 4 (t = 4, 8): each replica's matchmaking operations stand for the probe
    at its step, and a store closes the round; the quiet probe follows 0.75 s later."""
    ops = _stage(2, every_steps=2).ops
    at_round = sorted(kind for t, kind in ops if t == 4.0)
    # Each replica: its announcement (both of a stage of two announce), the live count (read at t = 0,
    # a window ago: due), then matchmaking_dht_ops' store, get, store, get; and the two closes.
    assert at_round == ["get"] * 6 + ["store"] * 8
    assert [kind for t, kind in ops if t == 4.75] == ["get", "get"]


def test_at_a_round_two_replicas_announce_and_the_count_is_read_only_when_due():
    """Of four replicas two announce each round (dht/round_board.py's `announcers`) and close it after.
    Rounds every step (t = 2, 4, ...); the count read at t = 0 is due again 3 s later (the first read
    leaves it in doubt), so the round at t = 2 reads none and the round at t = 4 reads it, at each replica."""
    ops = _stage(4, every_steps=1, matchmaking_dht_ops=0).ops
    assert sorted(kind for t, kind in ops if t == 2.0) == ["store"] * 4  # 2 announcements, 2 closes
    assert sorted(kind for t, kind in ops if t == 4.0) == ["get"] * 4 + ["store"] * 4


def test_an_insecure_swarms_heartbeat_stores_only():
    ops = _stage(1, every_steps=1000, heartbeat_s=3.0, between_rounds=False,
                 workers={"heartbeat_reads_bans": False}).ops
    assert [kind for _, kind in ops] == ["store"] * 3


def test_a_measured_background_takes_its_cpu_on_the_shared_cores():
    """10 ms a second per worker, two workers, 10 s: 0.2 CPU seconds besides everything else."""
    def cpu(background):
        swarm = _stage(2, every_steps=1000, between_rounds=False, compute={"shared_cores": 2},
                       workers={"background_cpu_ms_per_s_at": background})
        return swarm.cores.cpu_s
    assert cpu([[1.0, 10.0]]) - cpu([]) == pytest.approx(0.2, abs=0.011)  # a share every 0.5 s to t = 10


def test_a_heartbeat_reads_the_ban_list_then_stores_every_interval_from_its_phase():
    ops = _stage(1, every_steps=1000, heartbeat_s=3.0, between_rounds=False).ops
    times = [t for t, _ in ops]
    assert [kind for _, kind in ops] == ["get", "store"] * 3
    assert times[2] - times[0] == pytest.approx(3.0) and times[4] - times[2] == pytest.approx(3.0)
    assert 0.0 <= times[0] < 3.0


def test_nothing_between_rounds_unless_the_scenario_says_so():
    assert _stage(1, every_steps=1000, between_rounds=False).ops == []
