"""`TrainerStats`: a trainer's counters, kept in the process's metrics registry.

The trainer (node/trainer/trainer.py) records what happens here; the numbers live in the
Prometheus series of monitor/trainer_metrics.py (one bookkeeping), and the trainer's summary
(`time_split()`, the counts) reads them back. What is per peer (failures by peer id) is not a
metric (peer ids are unbounded label values) and stays a dict for the summary. Without a
registry (tests) the stats keep a private one.
"""

from __future__ import annotations

import threading
from typing import Optional

from prometheus_client import CollectorRegistry

from agora.monitor.metrics import sample_value
from agora.monitor.trainer_metrics import TrainerMetrics

__all__ = ["TrainerStats", "UNIT_OUTCOMES", "TRAINING_METHODS", "HELD_OUT"]

UNIT_OUTCOMES = ("claimed", "committed", "reclaimed", "duplicate", "conflict", "released", "lost")
# The `method` of a call's metrics: a training call's RPC, or a held-out Forward's (evaluation, checks' probes).
TRAINING_METHODS = ("Forward", "Backward")
HELD_OUT = "HeldOut"


class TrainerStats:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.metrics = TrainerMetrics(self.registry)
        self.failures_by_peer: dict[str, int] = {}
        # Replies refused for values beyond their stage's bound, and refusals downstream blamed on the
        # worker whose output they refused (node/trainer/blame.py), per peer.
        self.extreme_replies_by_peer: dict[str, int] = {}
        self.blamed_by_peer: dict[str, int] = {}
        # Workers the verifier flagged (node/trainer/verification.py), with the evidence, per peer.
        self.flagged_by_peer: dict[str, str] = {}
        # Where a training microbatch's time goes on the trainer's side (evaluation not counted): this
        # process's CPU time during `run`, each microbatch's wall time from its first pick to its loss,
        # and the part of that spent in calls (round trips); the rest is picking a route, waiting for
        # completed-batch reports, reruns' pauses and the trainer's own work between calls.
        self.cpu_s = 0.0
        # The CPU seconds of this process's tree during `run`: the process, its p2pd, its other descendants.
        self.process_cpu_s: dict[str, float] = {}
        self.microbatch_s = 0.0
        self.calls_s = 0.0
        # Of the time outside calls: waits for a credit, and for the completed-batch report a replica was owed.
        self.credit_wait_s = 0.0
        self.report_wait_s = 0.0
        self.depth_max = 0  # the most microbatches the (adaptive) limit allowed in flight
        self._stages: set[int] = set()
        self._abort_outcomes: set[str] = set()
        self._lock = threading.Lock()

    def _value(self, name: str, **labels: str) -> float:
        return sample_value(self.registry, name, labels)

    # ------------------------------------------------------------------ recording

    def call(self, stage: int, method: str, seconds: float, compute_s: float, queued_s: float,
             wire_queued_s: float = 0.0) -> None:
        """A call answered: `method` is Forward or Backward of training, or `HELD_OUT`; `wire_queued_s`:
        its time on the wire beyond its link's floor (node/trainer/inflight.py, `WireFloor`)."""
        metrics, label = self.metrics, str(stage)
        metrics.calls.labels(stage=label, method=method).observe(seconds)
        metrics.call_compute.labels(stage=label, method=method).inc(compute_s)
        metrics.call_queued.labels(stage=label, method=method).inc(queued_s)
        metrics.call_wire_queued.labels(stage=label, method=method).inc(wire_queued_s)
        self._stages.add(stage)

    def microbatch_done(self) -> None:
        self.metrics.microbatches.inc()

    def repeated(self, stage: int) -> None:
        self.metrics.repeats.labels(stage=str(stage)).inc()

    def busy_retry(self) -> None:
        self.metrics.busy_retries.inc()

    def rerouted(self, peer: str) -> None:
        self.metrics.reroutes.inc()
        with self._lock:
            self.failures_by_peer[peer] = self.failures_by_peer.get(peer, 0) + 1

    def banned(self) -> None:
        self.metrics.bans.inc()

    def extreme_reply(self, peer: str, stage: int, kind: str) -> None:
        """A reply of `peer` (a worker of `stage`) whose `kind` frame lay beyond the stage's bound."""
        self.metrics.extreme_replies.labels(stage=str(stage), kind=kind).inc()
        with self._lock:
            self.extreme_replies_by_peer[peer] = self.extreme_replies_by_peer.get(peer, 0) + 1

    def blamed(self, peer: str, stage: int) -> None:
        """A worker downstream refused what `peer` (a worker of `stage`) produced; the failure is `peer`'s."""
        self.metrics.blamed.labels(stage=str(stage)).inc()
        with self._lock:
            self.blamed_by_peer[peer] = self.blamed_by_peer.get(peer, 0) + 1

    def flagged(self, peer: str, stage: int, kind: str, evidence: str) -> None:
        """The verifier flagged `peer` (a worker of `stage`) on its `kind` replies; it is excluded."""
        self.metrics.flagged.labels(stage=str(stage), kind=kind).inc()
        with self._lock:
            self.flagged_by_peer[peer] = evidence

    def worker_report(self, outcome: str) -> None:
        """A flagged worker's report to the authorizer (node/trainer/reports.py): "sent" or "failed"."""
        self.metrics.worker_reports.labels(outcome=outcome).inc()

    def receipts(self, outcome: str, count: int = 1) -> None:
        """Receipts of accepted work (node/trainer/receipts.py): signed, delivered, refused, failed, dropped."""
        self.metrics.receipts.labels(outcome=outcome).inc(count)

    def receipt_delivery(self, outcome: str) -> None:
        """A receipt handed to the worker it names (node/trainer/receipt_delivery.py), by the worker's answer."""
        self.metrics.receipt_deliveries.labels(outcome=outcome).inc()

    def depth(self, limit: int, credit_cap: int | None, stage_credits: list[int]) -> None:
        """The in-flight limit now, the workers' in-flight credits bounding it (None: none states one)
        and the calls each stage lets this trainer have outstanding."""
        self.depth_max = max(self.depth_max, limit)
        self.metrics.in_flight_limit.set(limit)
        self.metrics.in_flight_credits.set(float("nan") if credit_cap is None else credit_cap)
        for stage, credits in enumerate(stage_credits):
            self.metrics.stage_credits.labels(stage=str(stage)).set(credits)
            self.metrics.credit_wait.labels(stage=str(stage))  # a series from the start, 0 until a call waits

    def credit_wait(self, stage: int, seconds: float) -> None:
        if seconds > 0:
            self.credit_wait_s += seconds
            self.metrics.credit_wait.labels(stage=str(stage)).inc(seconds)

    def report_wait(self, seconds: float) -> None:
        """A training call waited this long for the completed-batch report its replica was owed."""
        self.report_wait_s += max(0.0, seconds)

    def spot_check(self, stage: int, compute_s: float) -> None:
        """A spot check's duplicate Forward answered on a second replica of `stage`."""
        self.metrics.spot_checks.labels(stage=str(stage)).inc()
        self.metrics.spot_check_compute.labels(stage=str(stage)).inc(compute_s)

    def spot_check_skipped(self, stage: int) -> None:
        self.metrics.spot_checks_skipped.labels(stage=str(stage)).inc()

    def spot_check_disagreement(self, stage: int) -> None:
        self.metrics.spot_check_disagreements.labels(stage=str(stage)).inc()

    def gradient_check(self, stage: int, compute_s: float) -> None:
        """A gradient check's two probes answered for a worker of `stage` (node/trainer/gradient_checks.py)."""
        self.metrics.gradient_checks.labels(stage=str(stage)).inc()
        self.metrics.gradient_check_compute.labels(stage=str(stage)).inc(compute_s)

    def gradient_check_skipped(self, stage: int) -> None:
        self.metrics.gradient_checks_skipped.labels(stage=str(stage)).inc()

    def gradient_check_failed(self, stage: int) -> None:
        self.metrics.gradient_check_failures.labels(stage=str(stage)).inc()

    def aborted(self, outcome: str) -> None:
        self.metrics.aborts.labels(outcome=outcome).inc()
        self._abort_outcomes.add(outcome)

    def report_failed(self) -> None:
        self.metrics.reports_failed.inc()

    def report_refused(self) -> None:
        self.metrics.reports_refused.inc()

    def report_retried(self) -> None:
        self.metrics.reports_retried.inc()

    def unit(self, outcome: str) -> None:
        """A work unit's fate here (node/trainer/units.py): claimed, committed, reclaimed, ..."""
        self.metrics.units.labels(outcome=outcome).inc()

    def batch_done(self, tokens: int, loss: float, learning_rate: float) -> None:
        self.metrics.global_batches.inc()
        self.metrics.tokens.inc(tokens)
        self.metrics.loss.set(loss)
        self.metrics.learning_rate.set(learning_rate)

    def heldout(self, loss: float) -> None:
        self.metrics.heldout_loss.set(loss)

    # ------------------------------------------------------------------ reading back

    @property
    def microbatches(self) -> int:
        return int(self._value("agora_trainer_microbatches_total"))

    @property
    def reroutes(self) -> int:
        return int(self._value("agora_trainer_reroutes_total"))

    @property
    def repeats(self) -> int:
        """Stage calls a worker computed without applying (it had applied that work already)."""
        return int(sum(self._value("agora_trainer_repeats_total", stage=str(stage)) for stage in self._stages))

    @property
    def busy(self) -> int:
        return int(self._value("agora_trainer_busy_retries_total"))

    @property
    def calls(self) -> int:
        """Training Forward and Backward calls answered (busy refusals and held-out Forwards not included)."""
        return sum(split["calls"] for split in self.time_split().values())

    @property
    def bans(self) -> int:
        return int(self._value("agora_trainer_bans_total"))

    @property
    def extreme_replies(self) -> int:
        return sum(self.extreme_replies_by_peer.values())

    @property
    def blames(self) -> int:
        return sum(self.blamed_by_peer.values())

    @property
    def batch_reports_failed(self) -> int:
        return int(self._value("agora_trainer_batch_reports_failed_total"))

    @property
    def batch_reports_refused(self) -> int:
        return int(self._value("agora_trainer_batch_reports_refused_total"))

    @property
    def batch_reports_retried(self) -> int:
        return int(self._value("agora_trainer_batch_reports_retried_total"))

    def units(self) -> dict[str, int]:
        return {outcome: int(self._value("agora_trainer_units_total", outcome=outcome))
                for outcome in UNIT_OUTCOMES}

    @property
    def aborts(self) -> dict[str, int]:
        return {outcome: int(self._value("agora_trainer_aborts_total", outcome=outcome))
                for outcome in sorted(self._abort_outcomes)}

    def spot_check_split(self) -> dict[str, dict[str, float]]:
        """Per stage with spot checks: sent, skipped, disagreements, and the second replicas' compute (s)."""
        return self._check_split("spot_check", "spot_checks", "disagreements", "spot_check_disagreements")

    def gradient_check_split(self) -> dict[str, dict[str, float]]:
        """Per stage with gradient checks: sent, skipped, failures (out of band), and the probes' compute (s)."""
        return self._check_split("gradient_check", "gradient_checks", "failures", "gradient_check_failures")

    def _check_split(self, check: str, checks: str, outcome: str, outcome_metric: str) -> dict[str, dict[str, float]]:
        split = {}
        for stage in sorted(self._stages):
            label = str(stage)
            sent = self._value(f"agora_trainer_{checks}_total", stage=label)
            skipped = self._value(f"agora_trainer_{checks}_skipped_total", stage=label)
            if sent or skipped:
                split[label] = {"sent": int(sent), "skipped": int(skipped),
                                outcome: int(self._value(f"agora_trainer_{outcome_metric}_total", stage=label)),
                                "compute_s": self._value(f"agora_trainer_{check}_compute_seconds_total", stage=label)}
        return split

    def time_split(self) -> dict[str, dict[str, float]]:
        """Per stage, of the training calls: calls, and mean milliseconds per call of the round trip, the
        worker's compute, its queue, and the rest (serialization, gRPC, the wire, decoding), with the part
        of that rest beyond its link's floor (`wire_queued_ms`: frames waiting behind others); and the time
        a call waited here for a worker's credit before it was sent (not part of the round trip).

        Held-out Forwards (evaluation, the checks' probes) are left out: an evaluation of `eval_batches`
        global batches is as many calls as that many batches of training, each without a Backward: mixed
        in, a 256-microbatch batch's tail read about a third less compute per call than its training takes."""
        split = {}
        for stage in sorted(self._stages):
            label = str(stage)

            def total(name: str) -> float:
                return sum(self._value(name, stage=label, method=m) for m in TRAINING_METHODS)

            calls = total("agora_trainer_call_seconds_count")
            round_trip = total("agora_trainer_call_seconds_sum")
            compute = total("agora_trainer_call_compute_seconds_total")
            queued = total("agora_trainer_call_queued_seconds_total")
            wire_queued = total("agora_trainer_call_wire_queued_seconds_total")
            credit_wait = self._value("agora_trainer_credit_wait_seconds_total", stage=label)
            per_call = 1e3 / max(1.0, calls)
            split[label] = {"calls": int(calls), "round_trip_ms": round_trip * per_call,
                            "compute_ms": compute * per_call, "queued_ms": queued * per_call,
                            "wire_ms": max(0.0, round_trip - compute - queued) * per_call,
                            "wire_queued_ms": wire_queued * per_call,
                            "credit_wait_ms": credit_wait * per_call}
        return split

    def trainer_split(self) -> dict[str, float]:
        """Per training microbatch, in ms: this process's CPU time, its wall time outside calls, and of
        that its calls' waits for a credit and for the completed-batch reports their replicas were owed
        (the rest: picking, the loop's other work, reruns' pauses)."""
        n = max(1, self.microbatches)
        return {"cpu_ms": round(1e3 * self.cpu_s / n, 3),
                "outside_calls_ms": round(1e3 * max(0.0, self.microbatch_s - self.calls_s) / n, 3),
                "credit_wait_ms": round(1e3 * self.credit_wait_s / n, 3),
                "report_wait_ms": round(1e3 * self.report_wait_s / n, 3)}
