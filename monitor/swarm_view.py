"""The swarm as the monitor sees it: pure functions from DHT records to one view.

Design choices:

- `summarize(...)` turns what one poll of the DHT returned (every stage's `WorkerRecord`s, the
  run's `TrainerRecord`s) into a frozen `SwarmView`: workers per stage and phase, throughput
  per stage and the bottleneck (the stage with the least announced throughput: the pipeline
  runs at its speed), the step drift between stages (highest minus lowest stage step), each
  stage's averaging success (committed rounds over all rounds of its workers), and the
  trainers' loss and tokens/s. No sockets, no clock of its own: `now` is passed in.
- The view is what every endpoint serves: `/api/swarm` is `view.to_json()`, `/sd` is
  `scrape_targets(view)`, `/metrics` is monitor/swarm_metrics.py reading the view. One poll
  replaces it whole, so a reader never sees half of one poll and half of the next.
- `scrape_targets` is Prometheus' HTTP service discovery format: a list of
  `{"targets": ["host:port"], "labels": {...}}`, one per node that announces a metrics
  endpoint the scrape policy accepts (monitor/scrape_policy.py: a worker's on its own gRPC host,
  a trainer's on a host the operator named), labelled with its role and stage (and run), plus the
  operator's static targets (`--target ROLE=HOST:PORT`: the authorizer and the bootstrap, which
  have no record). The full list each time, `[]` when there is none. The endpoints left out are in
  the view too (`left_out`, with the announcing peer), for the monitor to log and count.
- `LossHistory` keeps the curve the status page draws: one point per poll in which the trainers'
  run-wide step moved, bounded (oldest points dropped first). `EvalHistory` likewise keeps the
  held-out loss the trainers measured through the swarm (node/trainer/evals.py): a point whenever
  the step of their latest evaluation moved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping, Optional

from agora.dht.record_fields import parse_endpoint
from agora.dht.records import PHASES, TrainerRecord, WorkerRecord
from agora.monitor.scrape_policy import host_key, trainer_target_refusal, worker_target_refusal

__all__ = ["EvalHistory", "EvalPoint", "HistoryPoint", "LeftOutTarget", "LossHistory", "StageView", "StaticTarget", "SwarmView", "TrainerStatus",
           "WorkerStatus", "scrape_targets", "summarize"]


@dataclass(frozen=True)
class StaticTarget:
    """A scrape target the DHT does not announce (`--target ROLE=HOST:PORT`)."""

    role: str
    endpoint: str


@dataclass(frozen=True)
class LeftOutTarget:
    """An announced metrics endpoint `/sd` does not list, and why (monitor/scrape_policy.py)."""

    role: str
    peer_id: str  # the whole id: the log line names the record's writer
    metrics_endpoint: str
    reason: str


@dataclass(frozen=True)
class WorkerStatus:
    peer: str  # the peer id, shortened for people (the record holds the whole one)
    endpoint: str
    phase: str
    step: int
    throughput: float
    queue_depth: int
    averaging_rounds: int
    averaging_committed: int
    metrics_endpoint: str


@dataclass(frozen=True)
class StageView:
    stage: int
    workers: tuple[WorkerStatus, ...]
    throughput: float  # sum of its workers' announced tokens/s
    step: int  # its most advanced worker's step (0 without workers)
    phases: dict[str, int]
    averaging_rounds: int
    averaging_committed: int

    @property
    def averaging_success(self) -> Optional[float]:
        return self.averaging_committed / self.averaging_rounds if self.averaging_rounds else None


@dataclass(frozen=True)
class TrainerStatus:
    index: int
    batches: int
    step: int
    loss: float
    tokens_per_s: float
    metrics_endpoint: str
    eval_step: int = 0  # of its last evaluation against the live swarm (0: none yet)
    heldout_loss: float = 0.0  # that evaluation's


@dataclass(frozen=True)
class EvalPoint:
    t: float  # seconds since the monitor started
    step: int
    heldout_loss: float


@dataclass(frozen=True)
class HistoryPoint:
    t: float  # seconds since the monitor started
    step: int
    loss: float
    tokens_per_s: float


@dataclass(frozen=True)
class SwarmView:
    run_id: str
    updated_at: float  # seconds since the monitor started, at the poll that built this view
    stages: tuple[StageView, ...]
    trainers: tuple[TrainerStatus, ...]
    static_targets: tuple[StaticTarget, ...] = ()
    history: tuple[HistoryPoint, ...] = ()
    worker_targets: tuple[tuple[str, int, str], ...] = field(default=())  # (endpoint, stage, peer)
    trainer_targets: tuple[str, ...] = ()  # the trainers' metrics endpoints /sd lists
    left_out: tuple[LeftOutTarget, ...] = ()
    eval_history: tuple[EvalPoint, ...] = ()

    @property
    def bottleneck_stage(self) -> Optional[int]:
        """The stage with the least throughput among stages with workers (None: no worker yet)."""
        staffed = [s for s in self.stages if s.workers]
        return min(staffed, key=lambda s: (s.throughput, s.stage)).stage if staffed else None

    @property
    def step_drift(self) -> int:
        steps = [s.step for s in self.stages if s.workers]
        return max(steps) - min(steps) if steps else 0

    @property
    def tokens_per_s(self) -> float:
        return sum(t.tokens_per_s for t in self.trainers)

    @property
    def loss(self) -> Optional[float]:
        losses = [t.loss for t in self.trainers if t.batches]
        return sum(losses) / len(losses) if losses else None

    def to_json(self) -> dict:
        return {
            "run": self.run_id, "updated_at": round(self.updated_at, 3),
            "stages": [{**asdict(s), "workers": [asdict(w) for w in s.workers],
                        "averaging_success": s.averaging_success} for s in self.stages],
            "trainers": [asdict(t) for t in self.trainers],
            "bottleneck_stage": self.bottleneck_stage, "step_drift": self.step_drift,
            "tokens_per_s": self.tokens_per_s, "loss": self.loss,
            "history": [asdict(p) for p in self.history],
            "eval_history": [asdict(p) for p in self.eval_history],
            "targets": len(scrape_targets(self)),
        }


def _short(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}...{peer_id[-6:]}"


def summarize(run_id: str, workers_by_stage: Mapping[int, Iterable[WorkerRecord]],
              trainers: Iterable[TrainerRecord], *, n_stages: int, now: float,
              static_targets: tuple[StaticTarget, ...] = (), history: tuple[HistoryPoint, ...] = (),
              trainer_hosts: tuple[str, ...] = ()) -> SwarmView:
    """One poll's records as a view. `n_stages`: the stages to show even when empty; more are
    shown when workers announce a larger count. `trainer_hosts`: hosts besides the static targets'
    whose trainers' metrics endpoints `/sd` lists (monitor/scrape_policy.py)."""
    announced = max([n_stages] + [r.n_stages for records in workers_by_stage.values() for r in records])
    stages = []
    for stage in range(announced):
        records = sorted(workers_by_stage.get(stage, ()), key=lambda r: r.peer_id)
        workers = tuple(WorkerStatus(_short(r.peer_id), r.endpoint, r.phase, r.step, r.throughput, r.queue_depth,
                                   r.averaging_rounds, r.averaging_committed, r.metrics_endpoint) for r in records)
        phases = {phase: sum(1 for r in records if r.phase == phase) for phase in sorted(PHASES)}
        stages.append(StageView(stage, workers, sum(r.throughput for r in records),
                                max((r.step for r in records), default=0), phases,
                                sum(r.averaging_rounds for r in records), sum(r.averaging_committed for r in records)))
    trainers = sorted(trainers, key=lambda t: (t.trainer_index, t.peer_id))
    trainer_views = tuple(TrainerStatus(t.trainer_index, t.batches, t.step, t.loss, t.tokens_per_s, t.metrics_endpoint,
                                        t.eval_step, t.heldout_loss) for t in trainers)
    worker_targets, workers_left_out = _worker_targets(workers_by_stage, announced)
    known_hosts = {host_key(parse_endpoint(t.endpoint)[0]) for t in static_targets} | set(map(host_key, trainer_hosts))
    trainer_targets, trainers_left_out = _trainer_targets(trainers, known_hosts)
    return SwarmView(run_id, now, tuple(stages), trainer_views, static_targets, history, worker_targets,
                     trainer_targets, workers_left_out + trainers_left_out)


def _worker_targets(workers_by_stage: Mapping[int, Iterable[WorkerRecord]], n_stages: int):
    """(endpoint, stage, peer) of each metrics endpoint the scrape policy lists, and those it leaves out."""
    listed, left_out = [], []
    for stage in range(n_stages):
        for r in sorted(workers_by_stage.get(stage, ()), key=lambda r: r.peer_id):
            if not r.metrics_endpoint:
                continue
            refusal = worker_target_refusal(r.endpoint, r.metrics_endpoint)
            if refusal is None:
                listed.append((r.metrics_endpoint, stage, r.peer_id))
            else:
                left_out.append(LeftOutTarget("worker", r.peer_id, r.metrics_endpoint, refusal))
    return tuple(listed), tuple(left_out)


def _trainer_targets(trainers: Iterable[TrainerRecord], known_hosts: set[str]):
    """The trainers' metrics endpoints the scrape policy lists, and those it leaves out."""
    listed, left_out = [], []
    for t in trainers:
        if not t.metrics_endpoint:
            continue
        refusal = trainer_target_refusal(t.metrics_endpoint, known_hosts)
        if refusal is None:
            listed.append(t.metrics_endpoint)
        else:
            left_out.append(LeftOutTarget("trainer", t.peer_id, t.metrics_endpoint, refusal))
    return tuple(listed), tuple(left_out)


def scrape_targets(view: SwarmView) -> list[dict]:
    """Prometheus HTTP service discovery: every node's metrics endpoint with its role and stage."""
    groups = [{"targets": [endpoint], "labels": {"role": "worker", "stage": str(stage), "run": view.run_id}}
              for endpoint, stage, _ in view.worker_targets]
    groups += [{"targets": [endpoint], "labels": {"role": "trainer", "run": view.run_id}}
               for endpoint in view.trainer_targets]
    groups += [{"targets": [t.endpoint], "labels": {"role": t.role, "run": view.run_id}} for t in view.static_targets]
    return groups


class LossHistory:
    """The status page's curve: a point whenever the trainers' step moved, at most `capacity`."""

    def __init__(self, capacity: int = 5000):
        self._points: deque[HistoryPoint] = deque(maxlen=capacity)

    def add(self, view: SwarmView) -> tuple[HistoryPoint, ...]:
        """Add this view's point if the step moved; the curve so far."""
        live = [t for t in view.trainers if t.batches]
        if live:
            step = max(t.step for t in live)
            if not self._points or step > self._points[-1].step:
                self._points.append(HistoryPoint(round(view.updated_at, 3), step,
                                                 sum(t.loss for t in live) / len(live), view.tokens_per_s))
        return tuple(self._points)


class EvalHistory:
    """The status page's curve of held-out loss through the swarm: a point whenever the step of the
    trainers' latest evaluation moved (the mean over the trainers that evaluated at it), at most `capacity`."""

    def __init__(self, capacity: int = 1000):
        self._points: deque[EvalPoint] = deque(maxlen=capacity)

    def add(self, view: SwarmView) -> tuple[EvalPoint, ...]:
        evaluated = [t for t in view.trainers if t.eval_step]
        if evaluated:
            step = max(t.eval_step for t in evaluated)
            if not self._points or step > self._points[-1].step:
                losses = [t.heldout_loss for t in evaluated if t.eval_step == step]
                self._points.append(EvalPoint(round(view.updated_at, 3), step, sum(losses) / len(losses)))
        return tuple(self._points)
