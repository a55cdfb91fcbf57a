"""A trainer's evaluations against the live swarm (node/trainer/evals.py): real StageWorkers on
loopback gRPC, one SwarmTrainer, in one process without a DHT.

- Evaluations due every 2 global batches start from the trainer's record hook and run while it
  trains: the first one's scoring is held back (its replica discovery waits on a gate) until the
  trainer has finished every batch, so the trainer cannot have waited for it; the one due meanwhile
  is skipped and counted. Its figures (held-out loss and perplexity, an lm-eval task's accuracy
  through `SwarmLM`) land in the JSON log beside the step lines and in the metrics, which lint clean.
- Held-out loss through the workers' inference path equals the trainer's own held-out evaluation
  (forward with targets) on the same batches and weights.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from agora.monitor.naming import lint
from agora.node.inference.discovery import StaticReplicas
from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
from agora.node.inference.routing import ReplicaView
from agora.node.rpc.server import run
from agora.node.trainer.discovery import StaticDiscovery
from agora.node.trainer.evals import SwarmEvaluator
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.routing import WorkerView
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.trainer import SwarmTrainer
from agora.pipeline.config import PRESETS, EvalsConfig
from agora.pipeline.data import build_data
from inference_swarm import start_stage_workers

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")
pytestmark = pytest.mark.timeout(240)

RUN = "evals-run"
TASKS = Path(__file__).resolve().parents[2] / "bench" / "evals" / "agora_code"
STEPS = 4


def _config():
    config = PRESETS["tiny"].with_stages(2)
    return replace(config, train=replace(config.train, batch_size=4, microbatches=2, seq_len=32, eval_every=0),
                   evals=EvalsConfig(every=2, heldout_batches=1, tasks=("agora_code_mc",), include_path=str(TASKS),
                                     limit=4))


class GatedReplicas(StaticReplicas):
    """The workers as replicas, read only while the gate is open."""

    def __init__(self, views: list[ReplicaView], gate: asyncio.Event):
        super().__init__(views)
        self.gate = gate

    async def replicas(self) -> list[ReplicaView]:
        await self.gate.wait()
        return await super().replicas()


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels)


def test_evaluations_run_against_the_live_swarm_while_the_trainer_trains():
    config = _config()
    data = build_data(config)
    registry = CollectorRegistry()
    log = io.StringIO()

    async def main():
        workers = await start_stage_workers(config, RUN)
        discovery = StaticDiscovery([WorkerView(f"w{i}", w.address, w.stage_index) for i, w in enumerate(workers)])
        gate = asyncio.Event()
        gate.set()  # open for the generator's first look
        replicas = GatedReplicas([ReplicaView(f"w{i}", w.address, w.stage_index, w.phase)
                                  for i, w in enumerate(workers)], gate)
        generator = SwarmGenerator(config, replicas, GeneratorOptions(run_id=RUN, refresh_s=0.0))
        try:
            async with SwarmEvaluator(config.evals, generator, data, registry=registry, log_json=log) as evaluator:
                gate.clear()  # the evaluation's scoring waits from here on
                async with SwarmTrainer(config, data, discovery, TrainerOptions(run_id=RUN), log_json=log,
                                        stats=TrainerStats(registry), on_record=evaluator.on_record) as trainer:
                    records = await trainer.run(STEPS)
                    started_before_the_end = evaluator.results == [] and evaluator.running
                    gate.set()
                    await evaluator.drain()
                    batches = data.heldout_batches(config.evals.heldout_batches, config.train.batch_size)
                    trainer_loss = await trainer.evaluate(batches)
                    swarm_loss = await evaluator.heldout_loss()
                return records, list(evaluator.results), started_before_the_end, trainer_loss, swarm_loss
        finally:
            for worker in workers:
                await worker.stop(0)

    records, results, started_before_the_end, trainer_loss, swarm_loss = run(main())
    assert len(records) == STEPS and started_before_the_end
    # The evaluation due after batch 2 ran (after every batch was trained); the one due after batch 4 was skipped.
    assert [r.step for r in results] == [records[1].step]
    figures = results[0].figures
    assert set(figures) >= {"heldout_loss", "heldout_perplexity", "agora_code_mc.acc"}
    assert math.isclose(figures["heldout_perplexity"], math.exp(figures["heldout_loss"]), rel_tol=1e-9)
    assert 0.0 <= figures["agora_code_mc.acc"] <= 1.0 and 0.0 < figures["heldout_loss"] < 10.0

    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    step_lines = [line for line in lines if "eval" not in line]
    eval_lines = [line for line in lines if "eval" in line]
    assert len(step_lines) == STEPS and lines[-1] == eval_lines[0]  # written after the last global batch
    assert eval_lines == [{"step": records[1].step, "eval": figures, "eval_s": round(results[0].seconds, 3)}]

    assert _sample(registry, "agora_trainer_eval_score", kind="heldout_loss") == figures["heldout_loss"]
    assert _sample(registry, "agora_trainer_eval_score", kind="agora_code_mc.acc") == figures["agora_code_mc.acc"]
    assert _sample(registry, "agora_trainer_eval_step") == records[1].step
    assert _sample(registry, "agora_trainer_evaluations_total", outcome="done") == 1
    assert _sample(registry, "agora_trainer_evaluations_total", outcome="skipped") == 1
    assert lint(registry.collect()) == []

    assert swarm_loss == pytest.approx(trainer_loss, abs=1e-4)
