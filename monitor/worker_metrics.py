"""Metrics of a stage worker and of any gRPC server: what the worker's hooks update.

Design choices:

- `RpcServerMetrics` is what a server interceptor (node/rpc/metrics_hook.py) feeds: calls by
  method and status code (refusals are the non-OK codes: RESOURCE_EXHAUSTED is a full worker,
  INVALID_ARGUMENT a bad request, ...), handling time per method, and the serialized message
  bytes each way (the wire bytes of every method, streams included).
- `WorkerMetrics` is the stage replica's own account: microbatches and tokens through each
  method (from the frames' declared shapes), time waiting for and on the compute thread (and the
  thread's CPU time in its jobs, which a host whose cores are shared shows apart from it), the
  optimizer's step, learning rate and gradient norm (from the step hook, on the compute thread),
  and at scrape time the queue depth, the phase and the announced throughput (read from the
  worker, not copied), the refusals it counts by reason, and its flow control: the callers it
  shares its queue among and the calls it lets them have outstanding in all (node/worker/flow.py).
  The bound on output gradients (a head's or body's, pipeline/wire_scale.py): the running scale it
  judges them by, and how far the largest it accepted came to the bound (refusals beyond are
  counted as `extreme_output_grad`).
  What it served each trainer (tokens of its training Forwards, by the caller's peer id, and since
  when): a contributor's own account of its share, and the figure the ledger holds the trainers'
  receipts to (monitor/ledger.py). What the trainers' receipts delivered to it vouch for
  (node/worker/receipts.py): microbatches and tokens by trainer, verified and kept since this
  process started, and the receipts it refused, by reason. The averaging rounds the other members
  of its rounds attest (node/worker/attestations.py): rounds newly attested (each stage and round
  once) and attestations kept since this process started, those refused by reason, and how its own
  attestations of the others fared on their way (node/averaging/round_attestations.py).
- Durations are histograms; buckets cover a CPU microbatch (milliseconds) to a slow 8B stage
  (tens of seconds).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from agora.auth.receipts import KEPT_REFUSALS
from agora.auth.round_attestations import KEPT_ATTESTATION_REFUSALS

__all__ = ["ATTESTATION_DELIVERIES", "DURATION_BUCKETS", "MAX_SERVED_TRAINERS", "RpcServerMetrics", "WorkerMetrics"]

MAX_SERVED_TRAINERS = 64  # trainers are operator-issued: a handful per run
# How a worker's attestation of another member's round fared: kept by it, already kept (a retry), refused
# (its reason), not delivered (unreachable, the deadline), or no endpoint known for it.
ATTESTATION_DELIVERIES = ("kept", "duplicate", "refused", "failed", "no_route")
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def short_method(full_method: str) -> str:
    """'/agora.v1.Stage/Forward' -> 'Forward' (the label value; a handful per service)."""
    return full_method.rsplit("/", 1)[-1] or full_method


class RpcServerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.handled = Counter("agora_rpc_server_handled", "gRPC calls this server finished, by method and status code",
                               ["method", "code"], registry=registry)
        self.handling = Histogram("agora_rpc_server_handling_seconds", "Time from a call's arrival to its status",
                                  ["method"], buckets=DURATION_BUCKETS, registry=registry)
        self.received = Counter("agora_rpc_server_received_bytes", "Serialized request bytes received, by method",
                                ["method"], registry=registry)
        self.sent = Counter("agora_rpc_server_sent_bytes", "Serialized reply bytes sent, by method",
                            ["method"], registry=registry)

    def finished(self, full_method: str, code: str, seconds: float) -> None:
        method = short_method(full_method)
        self.handled.labels(method=method, code=code).inc()
        self.handling.labels(method=method).observe(seconds)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.microbatches = Counter("agora_worker_microbatches", "Microbatches computed, by method",
                                    ["method"], registry=registry)
        self.tokens = Counter("agora_worker_tokens", "Tokens computed, by method", ["method"], registry=registry)
        self.compute = Histogram("agora_worker_compute_seconds", "Time a job spent on the stage's compute thread",
                                 ["method"], buckets=DURATION_BUCKETS, registry=registry)
        self.compute_cpu = Counter("agora_worker_compute_cpu_seconds", "CPU time the compute thread spent in its jobs, "
                                   "by method (beside agora_worker_compute_seconds' wall time: where other processes "
                                   "share the host's cores, the difference is the job's waits for one)", ["method"],
                                   registry=registry)
        self.queue_wait = Histogram("agora_worker_queue_wait_seconds",
                                    "Time an admitted job waited for the compute thread", ["method"],
                                    buckets=DURATION_BUCKETS, registry=registry)
        self.queue_depth = Gauge("agora_worker_queue_depth", "Forward/Backward jobs admitted and not finished",
                                 registry=registry)
        self.queue_capacity = Gauge("agora_worker_queue_capacity", "Jobs admitted at most (max_queue)",
                                    registry=registry)
        self.flow_callers = Gauge("agora_worker_flow_callers", "Callers the worker shares its queue among (heard from "
                                  "in the last few seconds)", registry=registry)
        self.flow_queue_target = Gauge("agora_worker_flow_queue_target", "Calls outstanding the worker grants its "
                                       "callers in all: its queue sized to their round trips", registry=registry)
        self.step = Gauge("agora_worker_optimizer_step", "The replica's optimizer step (the stage's shared epoch)",
                          registry=registry)
        self.steps = Counter("agora_worker_optimizer_steps", "Optimizer steps this process took (or advanced)",
                             registry=registry)
        self.learning_rate = Gauge("agora_worker_learning_rate", "Learning rate of the last step", registry=registry)
        self.grad_norm = Gauge("agora_worker_grad_norm", "Gradient norm before clipping at the last step",
                               registry=registry)
        self.grad_norm.set(float("nan"))  # no step yet: no value, rather than a norm of 0
        self.throughput = Gauge("agora_worker_throughput_tokens_per_second",
                                "Compute throughput the worker announces (moving average)", registry=registry)
        self.phase = Gauge("agora_worker_phase", "1 for the phase the worker is in, 0 for the others", ["phase"],
                           registry=registry)
        self.output_grad_scale = Gauge("agora_worker_output_grad_scale", "Median largest |value| of the output "
                                       "gradients the replica accepted lately; refused beyond gradient_bound_factor "
                                       "times it (NaN: none yet, or the tail)", registry=registry)
        self.output_grad_scale.set(float("nan"))
        self.output_grad_peak_ratio = Gauge("agora_worker_output_grad_peak_ratio", "Largest accepted output "
                                            "gradient over that scale since the bound applies (honest headroom: "
                                            "refusals start at gradient_bound_factor)", registry=registry)
        self.watchdog_trips = Counter("agora_worker_watchdog_trips", "Times the watchdog made the worker leave, by "
                                      "the rule that tripped", ["reason"], registry=registry)
        self.served_tokens = Counter("agora_worker_served_tokens", "Tokens of training microbatches this process "
                                     "served, by the trainer that sent them: what the trainers' receipts for it may "
                                     "claim at most (monitor/ledger.py)", ["trainer"], registry=registry)
        self.served_since = Gauge("agora_worker_served_since_seconds", "When this process began counting "
                                  "agora_worker_served_tokens (seconds since the epoch)", registry=registry)
        self.served_since_s = time.time()
        self.served_since.set(self.served_since_s)
        self._served_trainers: set[str] = set()
        self._served: dict[str, int] = {}  # the same counts, read back for the receipts' log line
        self.receipted_tokens = Counter("agora_worker_receipted_tokens", "Tokens the trainers' receipts delivered "
                                        "to this worker vouch for, verified and kept, by trainer",
                                        ["trainer"], registry=registry)
        self.receipted_microbatches = Counter("agora_worker_receipted_microbatches", "Microbatches the trainers' "
                                              "receipts delivered to this worker vouch for, verified and kept, by "
                                              "trainer", ["trainer"], registry=registry)
        self.receipts_refused = Counter("agora_worker_receipts_refused", "Receipts delivered to this worker and "
                                        "refused, by reason", ["reason"], registry=registry)
        for reason in KEPT_REFUSALS:
            self.receipts_refused.labels(reason=reason)
        self.attested_rounds = Counter("agora_worker_attested_rounds", "Averaging rounds of this worker that another "
                                       "member of the round attests, verified and kept (each stage and round once)",
                                       registry=registry)
        self.round_attestations = Counter("agora_worker_round_attestations", "Round attestations other members "
                                          "delivered to this worker, verified and kept", registry=registry)
        self.round_attestations_refused = Counter("agora_worker_round_attestations_refused", "Round attestations "
                                                  "delivered to this worker and refused, by reason", ["reason"],
                                                  registry=registry)
        for reason in KEPT_ATTESTATION_REFUSALS:
            self.round_attestations_refused.labels(reason=reason)
        self.attestation_deliveries = Counter("agora_worker_round_attestation_deliveries", "This worker's "
                                              "attestations of the other members of its rounds, by how their "
                                              "delivery ended", ["outcome"], registry=registry)
        for outcome in ATTESTATION_DELIVERIES:
            self.attestation_deliveries.labels(outcome=outcome)
        self._registry = registry

    def _trainer_label(self, trainer: str) -> str:
        """`trainer`, or "other" past `MAX_SERVED_TRAINERS` distinct trainers (bounded series)."""
        if trainer not in self._served_trainers:
            if len(self._served_trainers) >= MAX_SERVED_TRAINERS:
                trainer = "other"
            self._served_trainers.add(trainer)
        return trainer

    def served(self, trainer: str, tokens: int) -> None:
        """A training microbatch of `tokens` served to `trainer` (its Forward; its Backward is the same work)."""
        label = self._trainer_label(trainer)
        self.served_tokens.labels(trainer=label).inc(tokens)
        self._served[label] = self._served.get(label, 0) + tokens

    def served_tokens_of(self, trainer: str) -> int | None:
        """Tokens served to `trainer` since `served_since_s`; None when it is counted among "other"."""
        if trainer not in self._served_trainers and len(self._served_trainers) >= MAX_SERVED_TRAINERS:
            return None
        return self._served.get(trainer, 0)

    def receipted(self, trainer: str, microbatches: int, tokens: int) -> None:
        """A receipt of `trainer` for this worker, verified and kept."""
        label = self._trainer_label(trainer)
        self.receipted_microbatches.labels(trainer=label).inc(microbatches)
        self.receipted_tokens.labels(trainer=label).inc(tokens)

    def receipt_refused(self, reason: str) -> None:
        self.receipts_refused.labels(reason=reason).inc()

    def attestation_kept(self, new_round: bool) -> None:
        """A round attestation for this worker, verified and kept; `new_round`: the first of its round."""
        self.round_attestations.inc()
        if new_round:
            self.attested_rounds.inc()

    def attestation_refused(self, reason: str) -> None:
        self.round_attestations_refused.labels(reason=reason).inc()

    def attestation_delivered(self, outcome: str) -> None:
        self.attestation_deliveries.labels(outcome=outcome).inc()

    def watchdog_tripped(self, rule: str) -> None:
        self.watchdog_trips.labels(reason=rule).inc()

    def observe_job(self, method: str, tokens: int, queued_s: float, compute_s: float, cpu_s: float = 0.0) -> None:
        self.microbatches.labels(method=method).inc()
        self.tokens.labels(method=method).inc(tokens)
        self.queue_wait.labels(method=method).observe(queued_s)
        self.compute.labels(method=method).observe(compute_s)
        self.compute_cpu.labels(method=method).inc(max(0.0, cpu_s))

    def stepped(self, learning_rate: float, grad_norm: float | None) -> None:
        """From the compute thread's step hook (prometheus_client's values are thread-safe)."""
        self.steps.inc()
        self.learning_rate.set(learning_rate)
        if grad_norm is not None:
            self.grad_norm.set(grad_norm)

    def watch(self, *, load: Callable[[], int], capacity: int, step: Callable[[], int],
              throughput: Callable[[], float], phase: Callable[[], str], phases: Iterable[str],
              refusals: Callable[[], Mapping[str, int]], callers: Callable[[], int] = lambda: 0,
              queue_target: Callable[[], int] = lambda: 0) -> None:
        """Read the worker's own state at scrape time (nothing is copied)."""
        self.queue_depth.set_function(load)
        self.queue_capacity.set(capacity)
        self.flow_callers.set_function(callers)
        self.flow_queue_target.set_function(queue_target)
        self.step.set_function(step)
        self.throughput.set_function(throughput)
        for name in phases:
            self.phase.labels(phase=name).set_function(lambda name=name: float(phase() == name))
        self._registry.register(_Refusals(refusals))

    def watch_output_grads(self, *, scale: Callable[[], float], peak_ratio: Callable[[], float]) -> None:
        """A head's or body's bound on output gradients, read at scrape time."""
        self.output_grad_scale.set_function(scale)
        self.output_grad_peak_ratio.set_function(peak_ratio)


class _Refusals(Collector):
    """`agora_worker_refusals_total{reason}`: the worker's RefusalCounts, read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, int]]):
        self._read = read

    def collect(self):
        family = CounterMetricFamily("agora_worker_refusals", "Calls refused by the worker's checks, by reason",
                                     labels=["reason"])
        for reason, count in sorted(self._read().items()):
            family.add_metric([reason], count)
        yield family

    def describe(self):
        yield CounterMetricFamily("agora_worker_refusals", "Calls refused by the worker's checks, by reason",
                                  labels=["reason"])
