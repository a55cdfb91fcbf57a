"""Scoring through real stage workers over grpc.aio on 127.0.0.1:0 (one event loop, no DHT).

- Prompts of different lengths, scored in batches of two rows through three stages, get the
  per-token log-probabilities and top-k alternatives `LocalGenerator.score` computes in one process
  (within 1e-4; the same top ids), and every session is closed afterwards.
- The body replica a scoring batch is routed to is gone: the batch moves to the other replica and
  the numbers do not change.
- A generation asked for logprobs scores its prompt in its own Prefill and each token it draws,
  as one process does.
- A worker refuses more alternatives than it gives (INVALID_ARGUMENT naming top_logprobs).
- A replica whose attention caches are full (RESOURCE_EXHAUSTED, kv_cache_budget) hands the
  session to another replica of its stage, without a ban.
- lm-eval's requests through `SwarmLM` (a trainer's evaluations, node/trainer/evals.py), made from
  lm-eval's own thread: loglikelihoods, a rolling loglikelihood and a generation cut at its stop
  string are what one process computes.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from agora.node.inference.client import InferenceClient
from agora.node.inference.generator import Generation, SwarmGenerator
from agora.node.inference.service import InferenceOptions
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import StageCallError
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.inference import LocalGenerator, PositionScores
from agora.pipeline.stages import build_stage
from agora.pipeline.tokenizer import ByteTokenizer
from inference_swarm import generator_over, start_stage_workers

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(3)
RUN = "score-run"
PROMPTS = [list(b"def main():\n    return 1\n"), list(b"import os"), list(b"x"), list(b"class A:\n    pass"),
           list(b"for i in range(10):")]
LOCAL = LocalGenerator([build_stage(CONFIG.model, i) for i in range(3)])


async def start_workers(body_replicas: int = 1) -> list[StageWorker]:
    return await start_stage_workers(CONFIG, RUN, {1: body_replicas})


def generator_for(workers: list[StageWorker], **options) -> SwarmGenerator:
    return generator_over(CONFIG, RUN, workers, **options)


def assert_scores_equal(swarm, local) -> None:
    torch.testing.assert_close(swarm.token_logprobs, local.token_logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(swarm.top_logprobs, local.top_logprobs, atol=1e-4, rtol=0)
    assert torch.equal(swarm.top_ids, local.top_ids)


def test_batched_scores_through_the_workers_equal_one_process():
    async def main():
        workers = await start_workers()
        try:
            async with generator_for(workers, score_rows=2) as generator:
                scores = await generator.score(PROMPTS, top_k=3)
                stats = generator.stats
            await generator.close()
            return scores, stats, [w.info().sessions for w in workers]
        finally:
            for worker in workers:
                await worker.stop(0)

    scores, stats, sessions = run(main())
    for prompt, swarm in zip(PROMPTS, scores):
        assert swarm.token_logprobs.shape == (1, len(prompt))
        assert_scores_equal(swarm, LOCAL.score(prompt, 3))
    assert stats.sessions == 3 and stats.scored_prompts == 5 and stats.scored_tokens == sum(map(len, PROMPTS))
    assert sessions == [0, 0, 0]


def test_a_scoring_batch_moves_off_a_lost_replica_unchanged():
    async def main():
        workers = await start_workers(body_replicas=2)
        try:
            generator = generator_for(workers)  # the roster still lists both body replicas
            await workers[1].stop(0)  # peer-1: the one a fresh roster routes to first
            async with generator:
                scores = await generator.score(PROMPTS[:2], top_k=2)
                return scores, generator.stats
        finally:
            for worker in workers:
                await worker.stop(0)

    scores, stats = run(main())
    assert stats.failovers == 1
    for prompt, swarm in zip(PROMPTS, scores):
        assert_scores_equal(swarm, LOCAL.score(prompt, 2))


def test_a_generation_scores_its_prompt_and_its_tokens_as_one_process_does():
    async def main():
        workers = await start_workers()
        try:
            async with generator_for(workers) as generator:
                outcome = Generation()
                async for _ in generator.stream(PROMPTS[0], 6, outcome=outcome, logprobs=4, score_prompt=True):
                    pass
                return outcome
        finally:
            for worker in workers:
                await worker.stop(0)

    outcome = run(main())
    assert outcome.tokens == LOCAL.generate(PROMPTS[0], 6)
    assert_scores_equal(outcome.prompt_scores, LOCAL.score(PROMPTS[0], 4))
    whole = LOCAL.score(PROMPTS[0] + outcome.tokens, 4)  # position i predicts token i+1
    for index, token_scores in enumerate(outcome.token_scores):
        at = len(PROMPTS[0]) - 1 + index
        assert_scores_equal(token_scores, PositionScores(whole.token_logprobs[:, at:at + 1],
                                                         whole.top_logprobs[:, at:at + 1], whole.top_ids[:, at:at + 1]))


def test_a_worker_refuses_more_alternatives_than_it_gives():
    async def main():
        workers = await start_workers()
        tail = workers[-1]
        client = InferenceClient(tail.address, run_id=RUN, stage=2, model=CONFIG.model,
                                 fingerprint=run_fingerprint(CONFIG))
        tokens = torch.tensor([PROMPTS[1]])
        wire = torch.zeros((1, len(PROMPTS[1]), CONFIG.model.wire_dim))
        try:
            await client.prefill("s1", tokens, wire, score=True, top_logprobs=21)
        except StageCallError as error:
            return error.code, error.details
        finally:
            await client.close()
            for worker in workers:
                await worker.stop(0)

    code, details = run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in details


def test_a_replica_whose_caches_are_full_hands_the_session_to_another_without_a_ban():
    """peer-1, the body replica a fresh roster routes to first, holds 4 positions of cache: the
    scoring batch it refuses (RESOURCE_EXHAUSTED, kv_cache_budget) goes to peer-2, unchanged."""
    per_position = 2 * 2 * CONFIG.model.n_kv_heads * CONFIG.model.head_dim * 4  # keys and values, 2 blocks, fp32

    async def main():
        small = WorkerOptions(inference=InferenceOptions(max_kv_cache_gib=4 * per_position / 2**30))
        workers = [StageWorker(CONFIG, 0, run_id=RUN), StageWorker(CONFIG, 1, run_id=RUN, options=small),
                   StageWorker(CONFIG, 1, run_id=RUN), StageWorker(CONFIG, 2, run_id=RUN)]
        for worker in workers:
            await worker.start()
        try:
            async with generator_for(workers) as generator:
                scores = await generator.score(PROMPTS[:2], top_k=2)
                stats = generator.stats
                banned = generator.roster.replicas["peer-1"].banned_until
            return scores, stats, banned, workers[1].refusals.snapshot().get("kv_cache_budget")
        finally:
            for worker in workers:
                await worker.stop(0)

    scores, stats, banned, refused = run(main())
    assert refused == 1 and stats.cache_full_moves == 1 and stats.failovers == 0 and banned == 0.0
    for prompt, swarm in zip(PROMPTS, scores):
        assert_scores_equal(swarm, LOCAL.score(prompt, 2))


def test_lm_eval_requests_through_the_swarm_are_what_one_process_computes():
    lm_eval = pytest.importorskip("lm_eval.api.instance", reason="lm-eval is in the test extra")
    from agora.node.inference.lmeval_model import SwarmLM

    def requests(kind: str, *arguments: tuple) -> list:
        return [lm_eval.Instance(kind, {}, args, index) for index, args in enumerate(arguments)]

    pairs = [("def main():", "\n    return 1"), ("", "x"), ("import", " os")]
    text = "for i in range(10):\n    print(i)\n"

    async def main():
        workers = await start_workers()
        try:
            async with generator_for(workers, score_rows=2) as generator:
                lm = SwarmLM(generator, ByteTokenizer(), asyncio.get_running_loop())
                return (await asyncio.to_thread(lm.loglikelihood, requests("loglikelihood", *pairs)),
                        await asyncio.to_thread(lm.loglikelihood_rolling, requests("loglikelihood_rolling", (text,))),
                        await asyncio.to_thread(lm.generate_until, requests(
                            "generate_until", ("def f(", {"until": ["\n"], "max_gen_toks": 6}))))
        finally:
            for worker in workers:
                await worker.stop(0)

    likelihoods, rolling, generated = run(main())
    for (context, continuation), (logprob, greedy) in zip(pairs, likelihoods):
        context_ids, continuation_ids = list(context.encode()) or [0], list(continuation.encode())
        local = LOCAL.score(context_ids + continuation_ids, 1)
        span = slice(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
        assert logprob == pytest.approx(float(local.token_logprobs[0, span].sum()), abs=1e-3)
        assert greedy == (local.top_ids[0, span, 0].tolist() == continuation_ids)
    whole = LOCAL.score([0] + list(text.encode()))  # the first token predicted from the separator
    assert rolling == [pytest.approx(float(whole.token_logprobs[0, :-1].sum()), abs=1e-3)]
    expected = bytes(LOCAL.generate(list(b"def f("), 6, stop_ids=(0,))).decode(errors="replace").split("\n")[0]
    assert generated == [expected]
