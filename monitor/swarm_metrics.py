"""The monitor's `/metrics`: swarm-level gauges read from its current view at scrape time.

Nothing is stored twice: `SwarmCollector.collect()` reads the latest `SwarmView` (the last poll
of the DHT) and yields gauges from it. With every node scraped through `/sd` these duplicate
nothing a node exports: they are the swarm as the DHT shows it (who announces what), which is
also what an operator without access to the nodes' ports can see. `MonitorMetrics` counts the
monitor's own polls and the announced metrics endpoints `/sd` left out.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agora.monitor.swarm_view import SwarmView, scrape_targets
from agora.monitor.worker_metrics import DURATION_BUCKETS

__all__ = ["MonitorMetrics", "SwarmCollector"]


class MonitorMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.polls = Counter("agora_monitor_polls", "Reads of the swarm's records from the DHT, by outcome",
                             ["outcome"], registry=registry)
        self.poll_duration = Histogram("agora_monitor_poll_duration_seconds", "Time one read of the swarm took",
                                       buckets=DURATION_BUCKETS, registry=registry)
        self.left_out = Counter("agora_monitor_scrape_targets_left_out",
                                "Announced metrics endpoints /sd left out (monitor/scrape_policy.py), once per peer, "
                                "endpoint and reason, by role and reason", ["role", "reason"], registry=registry)


def _gauge(name: str, documentation: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=list(labels))


class SwarmCollector(Collector):
    def __init__(self, current: Callable[[], Optional[SwarmView]], registry: Optional[CollectorRegistry] = None):
        self._current = current
        if registry is not None:
            registry.register(self)

    def describe(self):
        return []  # the families depend on the view; registered without a describe-time check

    def collect(self):
        view = self._current()
        if view is None:
            return
        workers = _gauge("agora_swarm_workers", "Workers announced in the DHT, by stage and phase", ["stage", "phase"])
        throughput = _gauge("agora_swarm_stage_throughput_tokens_per_second",
                            "Sum of a stage's announced worker throughput", ["stage"])
        step = _gauge("agora_swarm_stage_step", "A stage's most advanced worker step", ["stage"])
        success = _gauge("agora_swarm_averaging_success_ratio",
                         "Committed averaging rounds over all rounds of a stage's workers", ["stage"])
        for stage in view.stages:
            label = str(stage.stage)
            for phase, count in stage.phases.items():
                workers.add_metric([label, phase], count)
            throughput.add_metric([label], stage.throughput)
            step.add_metric([label], stage.step)
            if stage.averaging_success is not None:
                success.add_metric([label], stage.averaging_success)
        yield from (workers, throughput, step, success)
        drift = _gauge("agora_swarm_step_drift_steps", "Highest minus lowest stage step")
        drift.add_metric([], view.step_drift)
        yield drift
        if view.bottleneck_stage is not None:
            bottleneck = _gauge("agora_swarm_bottleneck_stage", "The stage with the least throughput")
            bottleneck.add_metric([], view.bottleneck_stage)
            yield bottleneck
        trainers = _gauge("agora_swarm_trainers", "Trainers announced in the DHT")
        trainers.add_metric([], len(view.trainers))
        tokens = _gauge("agora_swarm_tokens_per_second", "Sum of the trainers' announced tokens/s")
        tokens.add_metric([], view.tokens_per_s)
        targets = _gauge("agora_swarm_scrape_targets", "Metrics endpoints listed for service discovery")
        targets.add_metric([], len(scrape_targets(view)))
        yield from (trainers, tokens, targets)
        if view.loss is not None:
            loss = _gauge("agora_swarm_loss", "Mean of the trainers' last announced training loss")
            loss.add_metric([], view.loss)
            yield loss
