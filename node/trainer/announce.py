"""What a running trainer tells the swarm about itself: a `TrainerRecord` in the DHT, every beat.

The record (dht/records.py) carries its progress (global batches, the last run-wide step, that
batch's loss, tokens/s, its last evaluation's step and held-out loss) and its metrics endpoint, under `{run}.trainers`: the monitor reads it
for the swarm's loss curve and tokens/s and for Prometheus service discovery. It is rebuilt from
the trainer's own records at each beat (dht/heartbeat.py) and withdrawn when the trainer ends.
"""

from __future__ import annotations

from typing import Callable

# (step, held-out loss) of a trainer's last evaluation against the live swarm; (0, 0.0): none yet.
LastEvaluation = Callable[[], tuple[int, float]]

from agora.dht.heartbeat import Heartbeat
from agora.dht.records import TrainerRecord
from agora.dht.swarm import SwarmDHT
from agora.pipeline.centralized import StepRecord

__all__ = ["LastEvaluation", "trainer_heartbeat", "trainer_record"]


def trainer_record(*, peer_id: str, run_id: str, trainer_index: int, records: list[StepRecord],
                   metrics_endpoint: str, version: str, evaluation: tuple[int, float] = (0, 0.0)) -> TrainerRecord:
    last = records[-1] if records else None
    return TrainerRecord(peer_id=peer_id, run_id=run_id, trainer_index=trainer_index, batches=len(records),
                         step=last.step if last else 0, loss=max(0.0, last.loss) if last else 0.0,
                         tokens_per_s=last.tokens_per_s if last else 0.0, version=version, updated_at=0.0,
                         metrics_endpoint=metrics_endpoint, eval_step=evaluation[0],
                         heldout_loss=max(0.0, evaluation[1]))


def trainer_heartbeat(swarm: SwarmDHT, *, run_id: str, trainer_index: int, records: Callable[[], list[StepRecord]],
                      metrics_endpoint: str, version: str, interval_s: float,
                      evaluation: LastEvaluation = lambda: (0, 0.0)) -> Heartbeat:
    """A heartbeat announcing the trainer's record (start it with `await heartbeat.start()`)."""
    return Heartbeat(swarm, lambda: trainer_record(peer_id=swarm.peer_id, run_id=run_id, trainer_index=trainer_index,
                                                   records=records(), metrics_endpoint=metrics_endpoint,
                                                   version=version, evaluation=evaluation()), interval=interval_s)
