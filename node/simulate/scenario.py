"""A simulation's scenario: what `agora-node simulate --scenario FILE` reads, as typed sections.

Every section is a frozen pydantic dataclass declared with pipeline/schema.py's `setting` (type,
default, bounds, help once), so a bad value is one line naming the field (`load_scenario` turns
pydantic's report into a `ConfigError`). A scenario states what the simulator cannot derive: the
time a stage's replica computes one microbatch (measured, or from FLOPs and a stated MFU:
bench/simulate_8b.py does that), each kind of link (rate each way, round trip), how long a DHT
operation takes at the swarm's size, the churn, and the run's shape (stages, replicas, trainers,
microbatches). The swarm's decisions are not settings here: the simulator calls the project's own.

    [run]        seconds, seed, warmup_s, tokens_per_microbatch, microbatches, stages
    [compute]    ms per microbatch per stage, the forward's share, per-call overhead, shared cores and
                 the CPU they carry besides the jobs
    [[links]]    name, up/down Mbit/s, RTT ms, share (a replica draws its link by share)
    [trainers]   count, link, CPU per microbatch, staleness cap or fixed depth
    [workers]    replicas per stage, credits, speed spread
    [wire]       bytes per token of a Forward's and a Backward's frames
    [dht]        one operation's latency (base + per doubling, or measured against the swarm's size), its CPU
    [averaging]  the run's SyncConfig fields that shape rounds, the averaged vector's size, the all-reduce's CPU
    [churn]      arrivals per hour, mean lifetime, a newcomer's admission and state size
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.schema import SECTION, ConfigError, explain, setting

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["RunSection", "ComputeSection", "LinkSection", "TrainerSection", "WorkerSection", "WireSection",
           "DHTSection", "AveragingSection", "ChurnSection", "Scenario", "load_scenario", "scenario_from_dict"]



@dataclass(frozen=True, config=SECTION)
class RunSection:
    """What is simulated and for how long."""

    seconds: StrictFloat = setting(120.0, "simulated seconds of training", gt=0, le=100 * 86400)
    warmup_s: StrictFloat = setting(0.0, "seconds left out of the throughput figures (the pipeline filling)", ge=0)
    seed: StrictInt = setting(0, "seed of every random draw (links by share, churn, speed spread)", ge=0)
    stages: StrictInt = setting(3, "pipeline stages (1: one stage's replicas alone, with batch_s)", ge=1, le=64)
    tokens_per_microbatch: StrictInt = setting(256, "tokens in one microbatch", gt=0)
    microbatches: StrictInt = setting(4, "microbatches per global batch", gt=0)
    batch_s: StrictFloat | None = setting(
        None, "a global batch every this many seconds instead of simulated trainers and microbatches (for days "
        "of churn: the pace from a run simulated in full)", gt=0)

    @model_validator(mode="after")
    def _warmup_within(self) -> "RunSection":
        if self.stages == 1 and self.batch_s is None:
            raise ValueError("stages: a pipeline needs 2; one stage's replicas alone run on run.batch_s")
        if self.warmup_s >= self.seconds:
            raise ValueError(f"warmup_s: {self.warmup_s} leaves nothing of run.seconds={self.seconds} to measure")
        return self


@dataclass(frozen=True, config=SECTION)
class ComputeSection:
    """A replica's compute per microbatch, per stage (a head or body runs a Forward and a Backward, the
    tail one call that does both)."""

    ms: tuple[StrictFloat, ...] = setting((20.0, 20.0, 20.0), "compute per microbatch of each stage, ms", min_length=1)
    step_ms: tuple[StrictFloat, ...] = setting((), "each stage's optimizer step on a replica's executor, ms "
                                               "(empty: none)")
    forward_share: StrictFloat = setting(0.5, "a head's or body's Forward's share of its compute", gt=0, lt=1)
    call_overhead_ms: StrictFloat = setting(
        0.0, "each call's time outside compute and the links (framing, gRPC, the trainer's relay)", ge=0)
    shared_cores: StrictInt | None = setting(
        None, "every process on one host with this many cores (the emulation harness); none: one machine each",
        gt=0)
    call_cpu_ms: tuple[StrictFloat, ...] = setting(
        (), "each stage's CPU per call besides its compute (the worker's gRPC threads: a frame decoded and "
        "encoded, the process's other work per call), taken on shared_cores as the request arrives (empty: none)")
    background_cpu_ms_per_s: StrictFloat = setting(
        0.0, "CPU ms a second the host burns besides the simulated jobs (every role's p2pd and DHT process, "
        "the supervisor, an emulated link's relay), taken on shared_cores", ge=0)

    @model_validator(mode="after")
    def _positive(self) -> "ComputeSection":
        if not all(value > 0 for value in self.ms):
            raise ValueError(f"ms: every stage's compute must be > 0, got {list(self.ms)}")
        for name in ("step_ms", "call_cpu_ms"):
            values = getattr(self, name)
            if values and (len(values) != len(self.ms) or min(values) < 0):
                raise ValueError(f"{name}: one time >= 0 per stage of ms, got {list(values)}")
        if (self.call_cpu_ms or self.background_cpu_ms_per_s) and self.shared_cores is None:
            raise ValueError("call_cpu_ms, background_cpu_ms_per_s: CPU beside the jobs is taken on shared_cores; "
                             "set it")
        return self


@dataclass(frozen=True, config=SECTION)
class LinkSection:
    """One kind of access link; a replica draws its kind by `share`."""

    name: StrictStr = setting(..., "what trainers and the scenario call it", min_length=1)
    up_mbit: StrictFloat = setting(..., "upload rate, Mbit/s", gt=0)
    down_mbit: StrictFloat = setting(..., "download rate, Mbit/s", gt=0)
    rtt_ms: StrictFloat = setting(0.0, "access round trip, ms (two nodes see the mean of theirs)", ge=0, le=10_000)
    share: StrictFloat = setting(1.0, "relative share of the workers on this kind of link (0: trainers only)", ge=0)
    slow_start_after_idle: StrictBool = setting(
        False, "the hosts' net.ipv4.tcp_slow_start_after_idle (Linux's default is on): a connection idle longer "
        "than its retransmission timeout sends again from a smaller congestion window (network.py)")


@dataclass(frozen=True, config=SECTION)
class TrainerSection:
    count: StrictInt = setting(1, "trainers", gt=0, le=1000)
    link: StrictStr = setting("", "their link's name (empty: the first link)")
    cpu_ms: StrictFloat = setting(0.0, "a trainer's own work per microbatch between calls, ms", ge=0)
    max_staleness: StrictFloat = setting(1.0, "the in-flight cap in global batches (the trainer's --max-staleness)",
                                         gt=0)
    max_in_flight: StrictInt | None = setting(None, "a fixed depth instead of the adaptive one (none: adaptive)", gt=0)
    start_every_s: StrictFloat = setting(
        0.0, "seconds between two trainers' starts, the first at 0 (0: all at once). All at once, every trainer's "
        "first depth (half a global batch, within its credits) reaches the stages before any of them has measured "
        "a microbatch: with 60 trainers over 7 x 100 replicas, about a minute of the busiest stage's work", ge=0)


@dataclass(frozen=True, config=SECTION)
class WorkerSection:
    replicas: StrictInt = setting(1, "replicas per stage at the start", gt=0, le=10_000)
    credits: StrictInt = setting(64, "calls a trainer may hold at one worker (and microbatches it keeps)", gt=0)
    speed_spread: StrictFloat = setting(0.0, "replicas' compute drawn uniformly within +- this fraction", ge=0, lt=1)
    slowdown: tuple[StrictFloat, ...] = setting(
        (1.0,), "replica i of every stage computes slowdown[i % len] times the stage's time (a mixed swarm)",
        min_length=1)
    heartbeat_s: StrictFloat = setting(
        0.0, "a worker's heartbeat (a ban-list read, a record store) every so many seconds; 0: not simulated", ge=0)
    heartbeat_reads_bans: StrictBool = setting(
        True, "each heartbeat reads the ban list first (an admitted swarm's; an insecure one has none)")
    background_cpu_ms_per_s_at: tuple[tuple[StrictFloat, StrictFloat], ...] = setting(
        (), "measured [nodes, CPU ms per second] each worker's processes burn besides what is simulated (idle "
        "replicas: hivemind's and p2pd's upkeep), taken on compute.shared_cores (none: nothing)")

    @model_validator(mode="after")
    def _checked(self) -> "WorkerSection":
        _check_table("background_cpu_ms_per_s_at", self.background_cpu_ms_per_s_at)
        if not all(value > 0 for value in self.slowdown):
            raise ValueError(f"slowdown: every factor must be > 0, got {list(self.slowdown)}")
        return self


@dataclass(frozen=True, config=SECTION)
class WireSection:
    forward_bytes_per_token: StrictFloat = setting(64.0, "a Forward's frame per token, bytes (each way)", ge=0)
    backward_bytes_per_token: StrictFloat = setting(64.0, "a Backward's gradient frame per token, bytes", ge=0)


def _check_table(name: str, table: tuple[tuple[float, float], ...]) -> None:
    """A measured [size, value] table as network.py's `at_size` reads it."""
    sizes = [size for size, _ in table]
    if any(size < 1 for size in sizes) or sizes != sorted(set(sizes)):
        raise ValueError(f"{name}: node counts must be >= 1 and increasing, got {sizes}")
    if any(value < 0 for _, value in table):
        raise ValueError(f"{name}: every value must be >= 0, got {[value for _, value in table]}")


@dataclass(frozen=True, config=SECTION)
class DHTSection:
    base_ms: StrictFloat = setting(5.0, "one DHT operation's latency in a swarm of 2 nodes, ms", ge=0)
    per_doubling_ms: StrictFloat = setting(0.0, "what each doubling of the swarm adds (Kademlia: log N hops)", ge=0)
    get_ms_at: tuple[tuple[StrictFloat, StrictFloat], ...] = setting(
        (), "measured [nodes, ms] of a get against the swarm's size; when given, replaces base_ms and "
        "per_doubling_ms (network.py's `at_size` reads between them)")
    store_ms_at: tuple[tuple[StrictFloat, StrictFloat], ...] = setting(
        (), "measured [nodes, ms] of a store against the swarm's size (none: a store takes a get's time)")
    cpu_ms_at: tuple[tuple[StrictFloat, StrictFloat], ...] = setting(
        (), "measured [nodes, CPU ms] one operation costs the swarm's hosts (its own and its serving), taken "
        "on compute.shared_cores when given (none: no CPU)")

    @model_validator(mode="after")
    def _tables(self) -> "DHTSection":
        for name in ("get_ms_at", "store_ms_at", "cpu_ms_at"):
            _check_table(name, getattr(self, name))
        return self


@dataclass(frozen=True, config=SECTION)
class AveragingSection:
    method: Literal["sparta", "none"] = setting("sparta", "sparta, or none (no rounds)")
    every_steps: StrictInt = setting(20, "local optimizer steps between rounds", gt=0)
    fraction: StrictFloat = setting(0.05, "share of every tensor per round", gt=0, le=1)
    vector_bytes: StrictInt = setting(1_000_000, "bytes of one stage's averaged slice", ge=0)
    matchmaking_dht_ops: StrictInt = setting(
        4, "DHT operations of a replica's matchmaking before it joins a group, two at a time (workers.py); with "
        "between_rounds the loop's own (its announcers' store, the live count's read when due) are simulated "
        "apart (swarm.py's `_matchmaking`)", ge=0)
    matchmaking_cpu_ms_at: tuple[tuple[StrictFloat, StrictFloat], ...] = setting(
        (), "measured [live replicas, CPU ms] of a replica's matchmaking besides matchmaking_dht_ops (hivemind's "
        "declaration, its read of the declared averagers, the join requests: bench/allreduce_cost.py's rounds "
        "with weight 0), taken on compute.shared_cores after them, with one DHT read's latency (none: nothing)")
    matchmaking_s: StrictFloat = setting(
        40.0, "the matchmaking window: a group short of the stage's live replicas forms when it closes", gt=0)
    optimizer_sync_steps: StrictInt = setting(100, "a joiner's optimizer-sync steps", ge=0)
    between_rounds: StrictBool = setting(
        False, "simulate the averaging loop's probes of the round board and its round closes between rounds "
        "(node/simulate/background.py)")
    allreduce_cpu_ms_per_peer: StrictFloat = setting(
        0.0, "CPU of a member's all-reduce per other member of its group, ms (bench/allreduce_cost.py)", ge=0)
    allreduce_cpu_ns_per_byte: StrictFloat = setting(
        0.0, "CPU of a member's all-reduce per byte it sends, ns (bench/allreduce_cost.py)", ge=0)
    start_offsets_s: tuple[StrictFloat, ...] = setting(
        (), "measured delays of a replica's start of a round behind the first replica's of the same round, "
        "seconds (bench/averaging_scale.py): each replica's start of each round is delayed by one drawn at "
        "random (none: they start together)")

    @model_validator(mode="after")
    def _tables(self) -> "AveragingSection":
        _check_table("matchmaking_cpu_ms_at", self.matchmaking_cpu_ms_at)
        if any(not 0 <= offset < float("inf") for offset in self.start_offsets_s):
            raise ValueError("start_offsets_s: every offset must be a finite number of seconds >= 0")
        return self


@dataclass(frozen=True, config=SECTION)
class ChurnSection:
    arrivals_per_hour: StrictFloat = setting(0.0, "worker arrivals per hour (Poisson)", ge=0)
    mean_lifetime_h: StrictFloat = setting(0.0, "a worker's mean lifetime, hours (exponential; 0: never leaves)",
                                           ge=0)
    admission_s: StrictFloat = setting(2.0, "a newcomer's start and admission before its DHT join, seconds", ge=0)
    join_dht_ops: StrictInt = setting(6, "DHT operations of its join and first reads, one after another", ge=0)
    dial_rtts: StrictFloat = setting(
        0.0, "round trips each of those operations spends first opening connections to peers the newcomer has "
        "not talked to (libp2p over TCP: the handshake, security negotiation, noise, muxer negotiation: 4)", ge=0)
    state_bytes: StrictInt = setting(10_000_000, "the stage state it downloads, bytes", ge=0)
    state_load_s: StrictFloat = setting(0.0, "loading the downloaded state, seconds", ge=0)
    kill_at_s: tuple[StrictFloat, ...] = setting((), "times a worker (the oldest of a stage, in turn) is killed "
                                                 "and a newcomer starts for it, seconds")
    join_at_s: tuple[StrictFloat, ...] = setting((), "times one more worker starts (on the least covered "
                                                 "stage), seconds")


@dataclass(frozen=True, config=SECTION)
class Scenario:
    run: RunSection = setting(default_factory=RunSection)
    compute: ComputeSection = setting(default_factory=ComputeSection)
    links: tuple[LinkSection, ...] = setting(
        (LinkSection(name="lan", up_mbit=10_000.0, down_mbit=10_000.0),), "kinds of link", min_length=1)
    trainers: TrainerSection = setting(default_factory=TrainerSection)
    workers: WorkerSection = setting(default_factory=WorkerSection)
    wire: WireSection = setting(default_factory=WireSection)
    dht: DHTSection = setting(default_factory=DHTSection)
    averaging: AveragingSection = setting(default_factory=AveragingSection)
    churn: ChurnSection = setting(default_factory=ChurnSection)

    @model_validator(mode="after")
    def _agree(self) -> "Scenario":
        if len(self.compute.ms) != self.run.stages:
            raise ValueError(f"compute.ms: {len(self.compute.ms)} stages given, run.stages is {self.run.stages}")
        names = [link.name for link in self.links]
        if len(set(names)) != len(names):
            raise ValueError(f"links: names must differ, got {names}")
        if self.trainers.link and self.trainers.link not in names:
            raise ValueError(f"trainers.link: no link named {self.trainers.link!r} (known: {', '.join(names)})")
        if not any(link.share > 0 for link in self.links):
            raise ValueError("links: at least one link needs share > 0 (the workers' links)")
        return self

    def link(self, name: str) -> LinkSection:
        return next((link for link in self.links if link.name == name), self.links[0])


_SCENARIO = TypeAdapter(Scenario)


def scenario_from_dict(values: dict) -> Scenario:
    """A scenario from parsed TOML (or any mapping), or a ConfigError naming the first bad field."""
    try:
        return _SCENARIO.validate_python(values)
    except ValidationError as error:
        raise explain(error, Scenario) from None


def load_scenario(path: str | Path) -> Scenario:
    """Read a TOML scenario file; a ConfigError (one line naming the file and field) when it is wrong."""
    path = Path(path)
    try:
        values = tomllib.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the scenario: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    try:
        return scenario_from_dict(values)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
