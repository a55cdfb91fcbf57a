"""Metrics of a trainer: what it pushed through the swarm, what it cost, what it learned.

- Global batches, microbatches and tokens done (`rate(agora_trainer_tokens_total[...])` is the
  trainer's tokens/s), the last global batch's loss and learning rate, the held-out loss.
- Each call to a stage, by stage and method: its round trip (histogram), and the worker's own
  account of it summed (time waiting for and on its compute thread), so the time split per
  stage (compute / queued / the rest: wire, serialization, gRPC) is a PromQL division.
- Routing: reroutes (a failed route rerun elsewhere), busy retries (a full worker, no penalty),
  bans (a peer benched with backoff), aborts by the worker's answer, completed-batch reports a
  worker did not answer or refused (outside its window).
- Trust in what workers compute: replies refused for values far beyond their stage's recent ones,
  by stage and frame kind, workers blamed for values a worker downstream refused, by stage, and
  workers flagged by the trainer's verifier (their replies unlike their stage's), by stage and kind,
  and the reports of them to the run's authorizer, sent or failed.
- Flow control (node/worker/flow.py): the microbatches in flight the trainer allows itself now,
  the workers' in-flight credits that bound it, the calls each stage's workers let it have
  outstanding, and the time its calls waited here for a credit, by stage.
- Spot checks (node/trainer/spot_checks.py), by stage: sent (each an extra Forward on a second
  replica), their compute there, skipped for want of a free replica, and disagreements.
- Gradient checks (node/trainer/gradient_checks.py), by stage: sent (two held-out Forwards each),
  their compute, skipped for want of a replica with two credits free, and checks out of band.
- Receipts of accepted work (node/trainer/receipts.py) by outcome: signed, delivered to the
  ledger, refused by it, failed to post, dropped unsent; and their deliveries to the workers they
  name (node/trainer/receipt_delivery.py): kept, duplicate, refused, failed, no_route.
- `RpcClientMetrics`: payload bytes (tensor frames) sent and received, by method.
- `EvalMetrics`: the evaluations run against the live swarm while training (node/trainer/evals.py):
  each figure of the last one by `kind` (`heldout_loss`, `heldout_perplexity`, `TASK.METRIC`: the
  operator's configured list, so few series), the step it was taken at, evaluations by outcome
  (done, failed, skipped: the previous one still ran), and the time spent evaluating.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agora.monitor.worker_metrics import DURATION_BUCKETS

__all__ = ["EvalMetrics", "RpcClientMetrics", "TrainerMetrics"]


class RpcClientMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.sent = Counter("agora_rpc_client_sent_bytes", "Payload bytes (tensor frames) sent to workers, by method",
                            ["method"], registry=registry)
        self.received = Counter("agora_rpc_client_received_bytes",
                                "Payload bytes (tensor frames) received from workers, by method", ["method"],
                                registry=registry)

    def exchanged(self, method: str, sent: int, received: int) -> None:
        self.sent.labels(method=method).inc(sent)
        self.received.labels(method=method).inc(received)


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.global_batches = Counter("agora_trainer_global_batches", "Global batches this trainer completed",
                                      registry=registry)
        self.microbatches = Counter("agora_trainer_microbatches", "Training microbatches completed (forward and "
                                    "backward through every stage)", registry=registry)
        self.tokens = Counter("agora_trainer_tokens", "Training tokens of the completed global batches",
                              registry=registry)
        self.loss = Gauge("agora_trainer_loss", "Mean training loss of the last completed global batch",
                          registry=registry)
        self.learning_rate = Gauge("agora_trainer_learning_rate", "Learning rate of the last completed global batch",
                                   registry=registry)
        self.heldout_loss = Gauge("agora_trainer_heldout_loss", "Held-out loss of the last evaluation",
                                  registry=registry)
        for unknown in (self.loss, self.heldout_loss):  # NaN (no value) until measured, never a loss of 0
            unknown.set(float("nan"))
        # method: Forward or Backward of training, HeldOut for a held-out Forward (evaluation, checks' probes).
        self.calls = Histogram("agora_trainer_call_seconds", "Round trip of a call to a stage worker",
                               ["stage", "method"], buckets=DURATION_BUCKETS, registry=registry)
        self.call_compute = Counter("agora_trainer_call_compute_seconds",
                                    "Workers' compute-thread time of this trainer's calls", ["stage", "method"],
                                    registry=registry)
        self.call_queued = Counter("agora_trainer_call_queued_seconds",
                                   "Time this trainer's calls waited for workers' compute threads",
                                   ["stage", "method"], registry=registry)
        self.call_wire_queued = Counter("agora_trainer_call_wire_queued_seconds",
                                        "Time this trainer's calls took on the wire beyond the least their link "
                                        "took lately: frames waiting behind others, on its uplink or the worker's",
                                        ["stage", "method"], registry=registry)
        self.reroutes = Counter("agora_trainer_reroutes", "Microbatch routes abandoned and rerun on another route",
                                registry=registry)
        self.repeats = Counter("agora_trainer_repeats", "Stage calls whose worker had applied that work already (a "
                               "reclaimed unit's microbatch: computed, not applied again)", ["stage"], registry=registry)
        self.busy_retries = Counter("agora_trainer_busy_retries", "Calls a full worker refused (RESOURCE_EXHAUSTED)",
                                    registry=registry)
        self.bans = Counter("agora_trainer_bans", "Workers benched by this trainer after a failed call",
                            registry=registry)
        self.extreme_replies = Counter("agora_trainer_extreme_replies", "Replies refused for values far beyond "
                                       "their stage's recent ones (kind: output wire or input gradient)",
                                       ["stage", "kind"], registry=registry)
        self.blamed = Counter("agora_trainer_blamed", "Workers blamed for values they produced that a worker "
                              "downstream refused, by the producer's stage", ["stage"], registry=registry)
        self.flagged = Counter("agora_trainer_flagged_workers", "Workers excluded for the rest of the run because "
                               "their replies drifted away from their stage's (by stage and frame kind)",
                               ["stage", "kind"], registry=registry)
        self.worker_reports = Counter("agora_trainer_worker_reports", "Flagged workers reported to the run's "
                                      "authorizer: sent, or failed (refused, or unreachable through every retry)",
                                      ["outcome"], registry=registry)
        self.receipts = Counter("agora_trainer_receipts", "Receipts of accepted work for workers (node/trainer/"
                                "receipts.py): signed, then delivered to the ledger, refused by it, failed to post "
                                "(kept and posted again), or dropped unsent", ["outcome"], registry=registry)
        self.receipt_deliveries = Counter("agora_trainer_receipt_deliveries", "Receipts handed to the workers they "
                                          "name (node/trainer/receipt_delivery.py): kept, duplicate (it had it), "
                                          "refused (with the worker's reason), failed (unreachable), no_route (gone)",
                                          ["outcome"], registry=registry)
        self.in_flight_limit = Gauge("agora_trainer_in_flight_limit", "Microbatches this trainer allows itself in "
                                     "flight now (the adaptive depth, within its caps)", registry=registry)
        self.in_flight_credits = Gauge("agora_trainer_in_flight_credits", "Microbatches the workers keep for this "
                                       "trainer between Forward and Backward (the tightest stage; NaN: unbounded)",
                                       registry=registry)
        self.in_flight_credits.set(float("nan"))
        self.stage_credits = Gauge("agora_trainer_stage_credits", "Calls this trainer may have outstanding on a "
                                   "stage, over its replicas (their credits)", ["stage"], registry=registry)
        self.credit_wait = Counter("agora_trainer_credit_wait_seconds", "Time this trainer's calls waited for a "
                                   "worker's credit before being sent", ["stage"], registry=registry)
        self.aborts = Counter("agora_trainer_aborts", "Aborts sent for abandoned routes, by the worker's answer",
                              ["outcome"], registry=registry)
        self.reports_failed = Counter("agora_trainer_batch_reports_failed",
                                      "Completed-batch reports a worker did not answer, its last send included",
                                      registry=registry)
        self.reports_retried = Counter("agora_trainer_batch_reports_retried",
                                       "Completed-batch reports sent again after a worker did not answer",
                                       registry=registry)
        self.reports_refused = Counter("agora_trainer_batch_reports_refused",
                                       "Completed-batch reports outside a replica's window (it lags or runs ahead)",
                                       registry=registry)
        self.units = Counter("agora_trainer_units", "Work units (global batches) by what happened to them here: "
                             "claimed, committed, reclaimed (another trainer's lease had run out), duplicate "
                             "(also committed by another), conflict (a claim another trainer won), released",
                             ["outcome"], registry=registry)
        self.spot_checks = Counter("agora_trainer_spot_checks", "Forwards also sent to a second replica of the "
                                   "stage and compared (each an extra held-out Forward), by stage", ["stage"],
                                   registry=registry)
        self.spot_check_compute = Counter("agora_trainer_spot_check_compute_seconds", "The second replicas' compute "
                                          "on spot checks, by stage", ["stage"], registry=registry)
        self.spot_checks_skipped = Counter("agora_trainer_spot_checks_skipped", "Sampled spot checks not sent: no "
                                           "other replica of the stage had a credit free", ["stage"], registry=registry)
        self.spot_check_disagreements = Counter("agora_trainer_spot_check_disagreements", "Spot checks whose two "
                                                "answers lay beyond the stage's honest drift, by stage", ["stage"],
                                                registry=registry)
        self.gradient_checks = Counter("agora_trainer_gradient_checks", "Input gradients checked by finite "
                                       "differences (two held-out Forwards each), by the checked worker's stage",
                                       ["stage"], registry=registry)
        self.gradient_check_compute = Counter("agora_trainer_gradient_check_compute_seconds", "The probing "
                                              "replicas' compute on gradient checks, by stage", ["stage"],
                                              registry=registry)
        self.gradient_checks_skipped = Counter("agora_trainer_gradient_checks_skipped", "Sampled gradient checks "
                                               "not sent: no replica of the stage had two credits free", ["stage"],
                                               registry=registry)
        self.gradient_check_failures = Counter("agora_trainer_gradient_check_failures", "Gradient checks whose "
                                               "ratio lay out of band (a wrong sign or scale), by stage", ["stage"],
                                               registry=registry)


class EvalMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.score = Gauge("agora_trainer_eval_score", "Figures of the last evaluation against the live swarm, by kind "
                           "(heldout_loss, heldout_perplexity, TASK.METRIC of an lm-eval task)", ["kind"],
                           registry=registry)
        self.step = Gauge("agora_trainer_eval_step", "Run-wide step of the global batch after which the last "
                          "evaluation began", registry=registry)
        self.evaluations = Counter("agora_trainer_evaluations", "Evaluations against the live swarm by outcome: done, "
                                   "failed, skipped (the previous one was still running)", ["outcome"],
                                   registry=registry)
        self.busy = Counter("agora_trainer_eval_seconds", "Time spent evaluating against the live swarm (training "
                            "goes on meanwhile)", registry=registry)

    def finished(self, step: int, figures: dict[str, float], seconds: float) -> None:
        for kind, value in figures.items():
            self.score.labels(kind=kind).set(value)
        self.step.set(step)
        self.busy.inc(seconds)
        self.evaluations.labels(outcome="done").inc()
