"""`SwarmEvaluator`: the run config's evaluations (`evals`), run by a trainer against the live swarm
every N of its global batches while it goes on training.

Where it runs. In the trainer's process, as a background task on its event loop: the trainer
already holds the DHT, the credential the workers admit for inference (a trainer may open
sessions), the JSON log and the metrics registry, and knows when a global batch is done. A separate
`evaluate` role would need all of those again and still learn the step from the DHT. The trainer
never waits for an evaluation: a global batch's record only starts one (or counts it skipped while
the previous one still runs).

How it reaches the model. Through the workers' inference path (`SwarmGenerator`: scored Prefills,
node/inference/generator.py), never a copy of the weights: the figures are the swarm's as it is,
between its optimizer steps. Inference sessions live in the workers' own cache budget and call
pool (node/inference/sessions.py, `max_kv_cache_gib`), apart from training's stash and credits, and
a scoring batch holds at most a microbatch's rows, which every worker accepts.

- Held-out loss and perplexity: the same held-out batches every time (`heldout_batches` of
  `train.batch_size` sequences), each sequence one prompt. Position i's log-probability of token
  i+1 is exactly what the trainer's own evaluation (`SwarmTrainer.evaluate`, a forward with targets)
  averages, so the two agree on the same weights (tested). A sequence longer than `max_seq_len`
  (`train.seq_len == model.max_seq_len`: one more id than a forward takes) loses its last target.
- lm-eval tasks: lm-eval's Python API (`simple_evaluate`) with `SwarmLM` as the model, on a thread
  of its own (its API is synchronous), `limit` examples a task, no bootstrapped stderr.

Each evaluation's figures go to the JSON log as one line (`{"step": S, "eval": {kind: value},
"eval_s": seconds}`, beside the trainer's step lines), to Prometheus (`EvalMetrics`: one gauge by
kind) and to the trainer's DHT record (the status page's curve of held-out loss). A failed
evaluation (no replica of a stage, an lm-eval error) is logged and counted, and training goes on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional, Sequence

import torch
from prometheus_client import CollectorRegistry

from agora.monitor.trainer_metrics import EvalMetrics
from agora.node.inference.generator import SwarmGenerator
from agora.pipeline.centralized import StepRecord
from agora.pipeline.config import ConfigError, EvalsConfig
from agora.pipeline.inference import PositionScores

__all__ = ["EvalResult", "SwarmEvaluator", "heldout_prompts", "mean_heldout_loss", "task_figures", "is_due"]

logger = logging.getLogger("agora.node.trainer")


@dataclass(frozen=True)
class EvalResult:
    step: int  # run-wide step of the global batch after which it began
    figures: dict[str, float]  # kind -> value: heldout_loss, heldout_perplexity, TASK.METRIC
    seconds: float

    def to_json(self) -> str:
        return json.dumps({"step": self.step, "eval": self.figures, "eval_s": round(self.seconds, 3)})


def is_due(batches_done: int, every: int) -> bool:
    """Whether this trainer's `batches_done`-th global batch starts an evaluation."""
    return every > 0 and batches_done > 0 and batches_done % every == 0


def heldout_prompts(batches: Sequence[torch.Tensor], max_seq_len: int) -> list[list[int]]:
    """Every held-out sequence as one prompt, cut to what one Prefill takes."""
    return [row[:max_seq_len].tolist() for batch in batches for row in batch]


def mean_heldout_loss(scores: Sequence[PositionScores]) -> float:
    """Mean negative log-likelihood of every scored prompt's tokens after its first (what a forward
    with targets averages: position i predicts token i+1)."""
    total, count = 0.0, 0
    for score in scores:
        targets = score.token_logprobs[0, :-1]  # the last position's next token is not in the prompt
        total -= float(targets.double().sum())
        count += targets.numel()
    if not count:
        raise ConfigError("evals.heldout_batches: the held-out sequences have no token to predict")
    return total / count


def task_figures(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's `results` table as flat figures `TASK.METRIC` (a filter other than `none` appended:
    `TASK.METRIC.FILTER`). Its metrics are the `METRIC,FILTER` keys; stderr, non-numeric values and
    the other keys (`alias`, `sample_len`) are left out."""
    figures = {}
    for task, metrics in sorted(results.items()):
        for key, value in metrics.items():
            metric, comma, applied = key.partition(",")
            if not comma or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            figures[".".join([task, metric] + ([applied] if applied not in ("", "none") else []))] = float(value)
    return figures


class SwarmEvaluator:
    """The run's evaluations for one trainer; `on_record` is the trainer's hook (`async with` it)."""

    def __init__(self, settings: EvalsConfig, generator: SwarmGenerator, data, *, registry: CollectorRegistry,
                 log_json: Optional[IO[str]] = None, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.generator = generator
        self.data = data
        self.metrics = EvalMetrics(registry)
        self.log_json = log_json
        self.clock = clock
        config = generator.config
        self.heldout = heldout_prompts(data.heldout_batches(settings.heldout_batches, config.train.batch_size),
                                       config.model.max_seq_len) if settings.heldout_batches else []
        self.results: list[EvalResult] = []
        self._batches = 0
        self._running: Optional[asyncio.Task] = None
        self._task_manager = None
        self._lm = None

    async def __aenter__(self) -> "SwarmEvaluator":
        if self.settings.tasks:
            self._task_manager = await asyncio.to_thread(self._load_tasks)
        await self.generator.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(wait=exc[0] is None)

    async def close(self, wait: bool = True) -> None:
        """Let a running evaluation finish (`wait`) or stop it; then close the generator's channels."""
        if not wait and self._running is not None:
            if self._lm is not None:
                self._lm.stop()
            self._running.cancel()
        await self.drain()
        await self.generator.close()

    async def drain(self) -> None:
        """Wait for the running evaluation, if any (its line is in the log when this returns)."""
        running, self._running = self._running, None
        if running is not None:
            await asyncio.gather(running, return_exceptions=True)

    @property
    def running(self) -> bool:
        """Whether an evaluation is under way now."""
        return self._running is not None and not self._running.done()

    def last_heldout(self) -> tuple[int, float]:
        """(step, held-out loss) of the last evaluation that measured one; (0, 0.0): none yet."""
        for result in reversed(self.results):
            if "heldout_loss" in result.figures:
                return result.step, result.figures["heldout_loss"]
        return 0, 0.0

    # ------------------------------------------------------------------ the trainer's hook

    def on_record(self, record: StepRecord) -> None:
        """A global batch of this trainer is done: start an evaluation when one is due (skip it, counted,
        while the previous one still runs)."""
        self._batches += 1
        if not is_due(self._batches, self.settings.every):
            return
        if self.running:
            self.metrics.evaluations.labels(outcome="skipped").inc()
            logger.info("evaluation due at step %d skipped: the previous one still runs", record.step)
            return
        self._running = asyncio.ensure_future(self._evaluate_logged(record.step))

    async def _evaluate_logged(self, step: int) -> Optional[EvalResult]:
        try:
            result = await self.evaluate(step)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an evaluation is never fatal to training
            self.metrics.evaluations.labels(outcome="failed").inc()
            logger.warning("evaluation at step %d failed: %s", step, error,
                           extra={"milestone": "evaluation_failed", "fields": {"step": step, "error": str(error)}})
            return None
        self.results.append(result)
        self.metrics.finished(step, result.figures, result.seconds)
        if self.log_json is not None:
            self.log_json.write(result.to_json() + "\n")
            self.log_json.flush()
        logger.info("evaluation at step %d: %s", step, ", ".join(f"{k} {v:.4g}" for k, v in result.figures.items()),
                    extra={"milestone": "evaluated", "fields": {"step": step, **result.figures}})
        return result

    # ------------------------------------------------------------------ one evaluation

    async def evaluate(self, step: int) -> EvalResult:
        started = self.clock()
        figures: dict[str, float] = {}
        if self.heldout:
            loss = await self.heldout_loss()
            figures.update(heldout_loss=loss, heldout_perplexity=math.exp(min(loss, 700.0)))
        if self.settings.tasks:
            figures.update(await self.lm_eval_tasks())
        return EvalResult(step, figures, self.clock() - started)

    async def heldout_loss(self) -> float:
        """Mean held-out loss through the swarm's inference path."""
        return mean_heldout_loss(await self.generator.score(self.heldout))

    async def lm_eval_tasks(self) -> dict[str, float]:
        """The configured lm-eval tasks through the swarm, as flat figures."""
        from agora.node.inference.lmeval_model import SwarmLM  # lm-eval is imported only when tasks are named

        self._lm = SwarmLM(self.generator, self.data.tokenizer, asyncio.get_running_loop())
        return task_figures(await asyncio.to_thread(self._run_tasks, self._lm))

    def _load_tasks(self):
        """lm-eval's task index; ConfigError naming an unknown task. `include_path` alone first: indexing
        lm-eval's own thousands of tasks takes seconds, so that happens only when a task is not there."""
        try:
            from lm_eval.tasks import TaskManager
        except ImportError:
            raise ConfigError("evals.tasks: lm-eval is not installed (pip install 'agora-node[evals]')") from None
        include = self.settings.include_path
        manager = TaskManager(include_path=include, include_defaults=False) if include else None
        if manager is None or not set(self.settings.tasks) <= set(manager.all_tasks):
            manager = TaskManager(include_path=include)
        unknown = [task for task in self.settings.tasks if task not in set(manager.all_tasks)]
        if unknown:
            raise ConfigError(f"evals.tasks: unknown lm-eval task(s) {', '.join(unknown)}"
                              + ("" if include else " (evals.include_path names a folder of more)"))
        return manager

    def _run_tasks(self, lm) -> dict[str, dict[str, Any]]:
        from lm_eval.evaluator import simple_evaluate

        outcome = simple_evaluate(model=lm, tasks=list(self.settings.tasks), limit=self.settings.limit,
                                  bootstrap_iters=0, log_samples=False, task_manager=self._task_manager,
                                  verbosity="ERROR")
        return outcome["results"] if outcome else {}
