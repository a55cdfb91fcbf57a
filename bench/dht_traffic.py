"""The DHT traffic of a swarm's roles, as bench/dht_scale.py plays it: which record families each
role stores and reads, and how often. Pure: no DHT here, only the schedule and its arithmetic.

Every rate below is the code's own timer, at the pace of the many-node demo at N = 8
(bench/results/many_nodes.json: tiny's 3 s matchmaking window, one 32-token microbatch a global
batch), in logical seconds (`--dilation K` stretches every period K times: `Dilation`).

| role | action | every (logical s) | requests | where in the code |
|---|---|---:|---|---|
| worker | heartbeat | 5 | call bans, store workers | dht/heartbeat.py: join's `--heartbeat`, the ban list read each beat |
| worker | probe | 1.19 | get rounds | node/averaging/loop.py: `probe_s` (tiny: 3 s / 4) + the read, none while a round runs |
| worker | replicas | 30.4 | get workers | node/averaging/probes.py: a settled count falls due every ten windows (30 s); the next probe or round reads it |
| worker | round | 3.7 | store rounds x 2 x min(1, 2/R) | RoundBoard: announce and close by the round's 2 announcers (dht/round_board.py), 32.6 rounds a stage a minute |
| worker | units | 0.62 | get units | node/worker/unit_holders.py: `refresh_s` 0.5 s + the read, while work comes |
| worker | rebalance | 30 | get workers x S, get moves | node/worker/join.py: 6 heartbeats (`all_workers` + the moves) |
| trainer | heartbeat | 5 | call bans, store trainers | node/trainer/announce.py |
| trainer | roster | 2 | get workers x S | node/trainer/options.py `roster_refresh_s` (`all_workers`) |
| trainer | batch | 0.95 | get units x 4, store units x 2 | node/trainer/units.py: a block read (`_REFRESH_S` 1 s), a claim (store, read, read), a commit (store, read) |
| trainer | renew | 10 | store units | `lease_s` / 3 (30 s leases) |
| bootstrap | bans | 5 | call bans | dht/bootstrap.py: the ban list, as every node reads it |
| monitor | poll | 2 | get workers x S, get trainers | monitor/service.py `SwarmMonitor.poll`, monitor/options.py `poll_s` |

Loops that sleep after their read (the probe, the unit refresh) run at their interval plus the
read's own time, here the N = 8 get p50 (0.12 s), and a replica does not probe while its round runs
(a round of ~1 s every 3.7 s). Fixing those at their N = 8 values makes the offered load the same
logical rate at every N: what grows with N is then the DHT's cost of carrying it, not the workload.

Checked against what the demo's nodes measured at N = 8 (`check_rows`, per DHT peer a second, the
demo's authorizer counted as a peer that reads the ban list): the stores of workers, trainers,
rounds and units and the rounds' reads within 5%, units' reads +7%, the ban list +15% (0.2 against
0.17) and the moves' -21% (0.020 against 0.025, a few requests a minute). Not the workers' reads:
that record was taken when a replica read its stage's count every matchmaking window, ten times
what this model (and node/averaging/probes.py since) reads in a swarm that nothing changes. Reads made by `SwarmDHT.all_workers` (the trainer's
roster, the rebalancer) were not timed by dht/op_timings.py when bench/results/many_nodes.json was
taken (they are since), so its "get workers" does not count them; `Request.metered` marks them, and
the check against that record leaves them out (a many_nodes run taken again counts them all). The
whole model offers 4.4 to 4.8 requests a logical second per peer at N = 8 to 64.

The monitor is one peer whatever N (a read-only credential: it stores nothing), so `swarm_rates`,
a per-peer mean over the roles that grow with N, leaves it out, as the check against the demo does.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from agora.bench.many_nodes import Geometry
from agora.dht.round_board import ANNOUNCERS
from agora.node.averaging.probes import ProbeSchedule, probe_intervals

__all__ = ["ROLES", "Action", "Dilation", "Request", "Timetable", "TrafficModel", "check_rows", "first_due_s",
           "peer_rates", "role_actions", "swarm_rates"]

ROLES = ("worker", "trainer", "bootstrap", "monitor")


@dataclass(frozen=True)
class TrafficModel:
    """The timers and the pace the schedule is built from (the module docstring gives each one's source)."""

    stages: int = 3
    replicas: int = 2  # R, a stage's replicas: 2 of them announce each round (dht/round_board.py)
    heartbeat_s: float = 5.0  # join's and trainer's --heartbeat; every node's ban list read
    probe_s: float = 0.75  # node/averaging/loop.py: tiny's matchmaking_s 3 s / 4
    rounds_per_s: float = 0.27  # rounds a replica runs (N = 8 demo: 32.6 a stage a minute, 2 replicas)
    round_s: float = 1.0  # one round (N = 8 demo: p50 1.02 s): no probes meanwhile
    unit_refresh_s: float = 0.5  # node/worker/unit_holders.py
    read_s: float = 0.12  # a read's own time (N = 8 get p50): loops that sleep after it run this much slower
    rebalance_s: float = 30.0  # node/worker/join.py: 6 x heartbeat
    roster_refresh_s: float = 2.0  # node/trainer/options.py
    batches_per_s: float = 1.05  # per trainer (N = 8 demo: 4.38 unit stores a second over 2 trainers)
    lease_s: float = 30.0  # the trainer's --lease, renewed every third
    matchmaking_s: float = 3.0  # a round announcement lives matchmaking_s + request_s (node/worker/join.py)
    request_s: float = 1.0
    monitor_poll_s: float = 2.0  # monitor/options.py: `poll_s`

    def __post_init__(self):
        for name in ("replicas", "heartbeat_s", "probe_s", "rounds_per_s", "unit_refresh_s", "rebalance_s", "roster_refresh_s",
                     "batches_per_s", "lease_s", "monitor_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"traffic model: {name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.rounds_per_s * self.round_s < 1:
            raise ValueError(f"traffic model: rounds_per_s x round_s must be below 1 (a replica's time in rounds), "
                             f"got {self.rounds_per_s * self.round_s:g}")

    @property
    def probe_period_s(self) -> float:
        return (self.probe_s + self.read_s) / (1 - self.rounds_per_s * self.round_s)

    @property
    def replicas_period_s(self) -> float:
        """A settled replica count falls due every `settled_s` of the loop's schedule (nothing here puts it in
        doubt: no replica leaves or joins, every group is whole); the next probe reads it, half a
        probe on average."""
        return ProbeSchedule(*probe_intervals(self.matchmaking_s)).settled_s + self.probe_period_s / 2

    @property
    def announcing_share(self) -> float:
        """The share of a stage's replicas that announce a round."""
        return min(1.0, ANNOUNCERS / self.replicas)

    @property
    def round_announcement_s(self) -> float:
        return self.matchmaking_s + self.request_s


@dataclass(frozen=True)
class Request:
    operation: str  # store, get, call (dht/op_timings.py's OPERATIONS)
    family: str  # workers, trainers, moves, rounds, units, bans
    count: float = 1  # per action (an expected count where only some peers send it)
    metered: bool = True  # False: `all_workers`' reads, which many_nodes.json's metrics did not time

    @property
    def name(self) -> str:
        return f"{self.operation} {self.family}"


@dataclass(frozen=True)
class Action:
    name: str
    period_s: float  # logical seconds between two
    requests: tuple[Request, ...]


def role_actions(role: str, model: TrafficModel) -> tuple[Action, ...]:
    """What a peer of `role` does, and how often (the module docstring's table)."""
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    stages = model.stages
    if role == "worker":
        return (Action("heartbeat", model.heartbeat_s, (Request("call", "bans"), Request("store", "workers"))),
                Action("probe", model.probe_period_s, (Request("get", "rounds"),)),
                Action("replicas", model.replicas_period_s, (Request("get", "workers"),)),
                Action("round", 1 / model.rounds_per_s, (Request("store", "rounds", 2 * model.announcing_share),)),
                Action("units", model.unit_refresh_s + model.read_s, (Request("get", "units"),)),
                Action("rebalance", model.rebalance_s, (Request("get", "workers", stages, metered=False),
                                                        Request("get", "moves"))))
    if role == "trainer":
        return (Action("heartbeat", model.heartbeat_s, (Request("call", "bans"), Request("store", "trainers"))),
                Action("roster", model.roster_refresh_s, (Request("get", "workers", stages, metered=False),)),
                Action("batch", 1 / model.batches_per_s, (Request("get", "units", 4), Request("store", "units", 2))),
                Action("renew", model.lease_s / 3, (Request("store", "units"),)))
    if role == "monitor":
        return (Action("poll", model.monitor_poll_s, (Request("get", "workers", stages, metered=False),
                                                      Request("get", "trainers"))),)
    return (Action("bans", model.heartbeat_s, (Request("call", "bans"),)),)


def peer_rates(actions: tuple[Action, ...], *, metered_only: bool = False) -> dict[str, float]:
    """Requests per logical second by "operation family" (e.g. "get units") of one peer."""
    rates: dict[str, float] = {}
    for action in actions:
        for request in action.requests:
            if metered_only and not request.metered:
                continue
            rates[request.name] = rates.get(request.name, 0.0) + request.count / action.period_s
    return rates


def swarm_rates(geometry: Geometry, model: TrafficModel, *, services: int = 1,
                metered_only: bool = False) -> dict[str, float]:
    """Requests per logical second per DHT peer, by operation and family, of a swarm of `geometry`
    with `services` peers that only read the ban list (the bootstrap; the demo's authorizer too)."""
    peers = [("worker", geometry.stages * geometry.replicas), ("trainer", geometry.trainers), ("bootstrap", services)]
    model = replace(model, replicas=geometry.replicas)
    total: dict[str, float] = {}
    for role, count in peers:
        for name, rate in peer_rates(role_actions(role, model), metered_only=metered_only).items():
            total[name] = total.get(name, 0.0) + count * rate
    everyone = sum(count for _, count in peers)
    return {name: rate / everyone for name, rate in sorted(total.items())}


def check_rows(measured_per_node_s: dict[str, float], geometry: Geometry, model: TrafficModel,
               services: int) -> list[tuple[str, float, float]]:
    """(family, model's rate, measured rate) per node per second, for every family either has; the
    model counted as the nodes' metrics count (`metered_only`)."""
    modelled = swarm_rates(geometry, model, services=services, metered_only=True)
    names = sorted(set(modelled) | set(measured_per_node_s))
    return [(name, modelled.get(name, 0.0), measured_per_node_s.get(name, 0.0)) for name in names]


@dataclass(frozen=True)
class Dilation:
    """Time dilation K: every period of the schedule is K times longer in real time, so the swarm
    offers 1/K of its load; a count over a real window is read back per logical minute."""

    factor: float = 1.0

    def __post_init__(self):
        if not self.factor >= 1:
            raise ValueError(f"--dilation: must be at least 1, got {self.factor}")

    def real_s(self, logical_s: float) -> float:
        return logical_s * self.factor

    def per_logical_minute(self, amount: float, real_window_s: float, background_per_s: float = 0.0) -> float:
        """`amount` (requests, bytes, CPU seconds) over `real_window_s` real seconds, per logical minute.

        `background_per_s`: what the same peers spend per real second at rest (hivemind's and p2pd's
        own timers run in real time whatever the dilation): that part is not stretched back, the rest
        (the schedule's) is, so a node's figure is its background plus K times its traffic's."""
        if not real_window_s > 0:
            raise ValueError(f"window must be positive, got {real_window_s}")
        traffic_per_s = max(0.0, amount / real_window_s - background_per_s)
        return (traffic_per_s * self.factor + background_per_s) * 60.0

    def problem(self, model: TrafficModel, heartbeat_ttl_bound_s: float) -> str | None:
        """Why this dilation cannot play `model`, or None: a dilated heartbeat must leave its record
        alive until the next (a quarter of the bound's margin: peers refuse a longer lifetime)."""
        beat = self.real_s(model.heartbeat_s)
        if beat * 1.25 > heartbeat_ttl_bound_s:
            most = heartbeat_ttl_bound_s / 1.25 / model.heartbeat_s
            return (f"--dilation: {self.factor:g} stretches a {model.heartbeat_s:g} s heartbeat to {beat:g} s, but "
                    f"peers keep a record at most {heartbeat_ttl_bound_s:g} s: at most {most:g}")
        return None

    def ttl_s(self, logical_ttl_s: float, bound_s: float) -> float:
        """An entry's lifetime in real time, within the bound its family's peers accept
        (dht/key_families.py `max_ttl_s`): an entry still outlives the dilated beat that renews it
        as long as that beat is shorter than the bound."""
        return min(self.real_s(logical_ttl_s), bound_s)


def first_due_s(period_real_s: float, rng: random.Random) -> float:
    """When an action first runs after the schedule starts: at a random phase of its period, the
    heartbeat's too. The harness starts its peers together; a swarm's nodes start when their owners
    start them, each beating from its own start (dht/heartbeat.py). Peers whose beats were in step,
    as they were when the heartbeat ran at once, each read the ban list in one burst every beat, and
    its 8 holders answered that burst in 0.2-1 s at 32 peers."""
    return rng.uniform(0.0, period_real_s)


class Timetable:
    """One action's due times: a fixed rate from its first (dht/heartbeat.py's beats are jittered
    around theirs, here they are not: the first run's random phase already spreads the peers); a
    run that ended late does not cause a burst of catch-up runs, the schedule restarts from then."""

    def __init__(self, period_s: float, first_s: float):
        if not period_s > 0:
            raise ValueError(f"period must be positive, got {period_s}")
        self.period_s = period_s
        self.next_s = first_s

    def ran(self, now_s: float) -> float:
        """The action ran (it ended at `now_s`): its next due time."""
        self.next_s += self.period_s
        if self.next_s < now_s:
            self.next_s = now_s
        return self.next_s

    def count_between(self, start_s: float, end_s: float) -> int:
        """How many runs fall in [start_s, end_s) when every run takes no time (for the rates' tests)."""
        if end_s <= self.next_s:
            return 0
        first = max(0, math.ceil((start_s - self.next_s) / self.period_s))
        last = math.ceil((end_s - self.next_s) / self.period_s)
        return max(0, last - first)
