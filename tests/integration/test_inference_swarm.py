"""Inference through real stage workers over grpc.aio on 127.0.0.1:0, one event loop per test, no DHT.

- Greedy generation through three workers equals the same model generating in one process, token
  for token; so does a seeded sampled one.
- With two replicas of the body, stopping the one on the route mid-generation moves the session
  to the other (replayed by one Prefill) and the output is unchanged.
- A worker that evicts a session (more sessions than it holds) makes the client replay it there:
  unchanged output again.
- The session calls' statuses: NOT_FOUND naming an unknown session, FAILED_PRECONDITION for a
  call after positions not held, OUT_OF_RANGE over the bounds, INVALID_ARGUMENT naming a bad frame, and a serve-only
  worker refuses training calls while serving inference.
- The sessions' caches kept within the worker's byte budget: a session that would pass it, opening
  or growing, is refused with RESOURCE_EXHAUSTED and counted while the open one keeps decoding.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import torch

from agora.node.inference.client import InferenceClient
from agora.node.inference.discovery import StaticReplicas
from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
from agora.node.inference.routing import ReplicaView
from agora.node.inference.service import InferenceOptions
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import StageCallError, StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.inference import LocalGenerator, Sampling
from agora.pipeline.stages import build_stage
from inference_swarm import generator_over, start_stage_workers

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(3)
RUN = "infer-run"
FINGERPRINT = run_fingerprint(CONFIG)
PROMPT = list(b"def main():\n    ")


def local_tokens(max_new: int, sampling: Sampling = Sampling()) -> list[int]:
    return LocalGenerator([build_stage(CONFIG.model, i) for i in range(3)]).generate(PROMPT, max_new, sampling)


async def start_workers(replicas: dict[int, int] | None = None, **options) -> list[StageWorker]:
    return await start_stage_workers(CONFIG, RUN, replicas, WorkerOptions(**options))


def generator_for(workers: list[StageWorker], **options) -> SwarmGenerator:
    return generator_over(CONFIG, RUN, workers, **options)


async def stop_all(workers: list[StageWorker]) -> None:
    for worker in workers:
        await worker.stop(0)


def test_greedy_and_seeded_generation_through_the_workers_equal_one_process():
    sampled = Sampling(temperature=0.8, top_p=0.9, seed=5)

    async def main():
        workers = await start_workers()
        try:
            async with generator_for(workers) as generator:
                greedy = await generator.generate(PROMPT, 24)
                hot = await generator.generate(PROMPT, 24, sampled)
                stats = generator.stats
            sessions = [w.info().sessions for w in workers]
        finally:
            await stop_all(workers)
        return greedy, hot, stats, sessions

    greedy, hot, stats, sessions = run(main())
    assert greedy.tokens == local_tokens(24) and greedy.finish_reason == "length"
    assert hot.tokens == local_tokens(24, sampled) and hot.tokens != greedy.tokens
    assert stats.retries == 0 and stats.tokens == 48
    assert sessions == [0, 0, 0]  # every session was closed when its generation ended


def test_a_replica_stopped_mid_generation_moves_the_session_and_changes_nothing():
    async def main():
        workers = await start_workers({1: 2})
        bodies = [w for w in workers if w.stage_index == 1]
        try:
            async with generator_for(workers) as generator:
                tokens = []
                async for token in generator.stream(PROMPT, 30):
                    tokens.append(token)
                    if len(tokens) == 10:  # the route's body replica goes away
                        victim = next(w for w in bodies if w.info().sessions == 1)
                        await victim.stop(0)
                stats = generator.stats
            survivor = next(w for w in bodies if w is not victim)
        finally:
            await stop_all(workers)
        return tokens, stats, survivor.info().sessions

    tokens, stats, left = run(main())
    assert tokens == local_tokens(30)
    assert stats.failovers == 1 and stats.replays == 1 and stats.retries >= 1
    assert left == 0


def test_an_evicted_session_is_replayed_where_it_was():
    """Each worker holds one session: two interleaved generations evict each other at every step."""
    async def main():
        workers = await start_workers(inference=InferenceOptions(max_sessions=1))
        try:
            async with generator_for(workers) as generator:
                first, second = await asyncio.gather(generator.generate(PROMPT, 12),
                                                     generator.generate(PROMPT[:-3], 12))
                stats = generator.stats
        finally:
            await stop_all(workers)
        return first, second, stats

    first, second, stats = run(main())
    local = LocalGenerator([build_stage(CONFIG.model, i) for i in range(3)])
    assert first.tokens == local.generate(PROMPT, 12)
    assert second.tokens == local.generate(PROMPT[:-3], 12)
    assert stats.replays >= 2 and stats.failovers == 0


def _code(coroutine) -> tuple[grpc.StatusCode, str]:
    async def main():
        try:
            await coroutine
        except StageCallError as error:
            return error.code, error.details
        return grpc.StatusCode.OK, ""
    return main()


def test_session_calls_are_refused_by_name():
    tokens = torch.tensor([PROMPT])

    async def main():
        head = StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions(
            inference=InferenceOptions(max_session_tokens=64)))
        body = StageWorker(CONFIG, 1, run_id=RUN, options=WorkerOptions(serve_only=True))
        await head.start()
        await body.start()
        client = InferenceClient(head.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=FINGERPRINT)
        other = InferenceClient(body.address, run_id=RUN, stage=1, model=CONFIG.model, fingerprint=FINGERPRINT)
        trainer = StageClient(body.address, run_id=RUN, stage=1, model=CONFIG.model, fingerprint=FINGERPRINT)
        try:
            results = {
                "unknown": await _code(client.decode("never-opened", 0, tokens)),
                "too_long": await _code(client.prefill("long", tokens, max_tokens=65)),
                "opened": await _code(client.prefill("s", tokens, max_tokens=len(PROMPT) + 2)),
                "behind": await _code(client.decode("s", len(PROMPT) + 1, tokens[:, :1])),
                "past_declared": await _code(client.decode("s", len(PROMPT), tokens[:, :3])),
                "not_at_zero": await _code(client._infer("Prefill", replace(
                    _request(client, "t", tokens), position=3), 1, len(PROMPT), None)),
                "bad_wire": await _code(other.prefill("w", tokens, torch.zeros(1, len(PROMPT), 7))),
                "serve_only": await _code(trainer.forward("m", tokens, torch.zeros(1, len(PROMPT), 16))),
                "body_serves": await _code(other.prefill("w", tokens, torch.zeros(1, len(PROMPT), 16))),
            }
            results["closed"] = (await client.close_session("s"), await client.close_session("s"))
            results["info"] = (head.info().phase, body.info().phase, head.info().sessions, body.info().sessions)
        finally:
            for c in (client, other, trainer):
                await c.close()
            await head.stop(0)
            await body.stop(0)
        return results

    results = run(main())
    code, details = results["unknown"]
    assert code == grpc.StatusCode.NOT_FOUND and "'never-opened'" in details and "replay" in details
    code, details = results["too_long"]
    assert code == grpc.StatusCode.OUT_OF_RANGE and "max_tokens: 65" in details and "at most 64" in details
    assert results["opened"][0] == grpc.StatusCode.OK
    code, details = results["behind"]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and f"holds {len(PROMPT)} positions" in details
    code, details = results["past_declared"]
    assert code == grpc.StatusCode.OUT_OF_RANGE and "max_tokens" in details
    code, details = results["not_at_zero"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "position" in details
    code, details = results["bad_wire"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "wire" in details and "16" in details
    code, details = results["serve_only"]
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "serves inference only" in details
    assert results["body_serves"][0] == grpc.StatusCode.OK
    assert results["closed"] == (True, False)
    assert results["info"] == ("member", "serving", 0, 1)


def test_sessions_past_the_kv_cache_budget_are_refused_and_the_open_ones_keep_working():
    """A head holding 24 positions of cache (1 KiB each on this stage, fp32), a 16-token prompt per
    session: a second session does not fit and is refused RESOURCE_EXHAUSTED, naming the budget, as
    is the first one growing past it; the first decodes on within it, nothing is evicted, each
    refusal is counted, and once the first closes the second opens."""
    tokens = torch.tensor([PROMPT])
    per_position = 2 * 2 * CONFIG.model.n_kv_heads * CONFIG.model.head_dim * 4  # keys and values, 2 blocks, fp32
    budget = 24 * per_position

    async def main():
        head = StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions(
            inference=InferenceOptions(max_kv_cache_gib=budget / 2**30)))
        await head.start()
        client = InferenceClient(head.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=FINGERPRINT)
        try:
            results = {
                "first": await _code(client.prefill("a", tokens)),
                "second": await _code(client.prefill("b", tokens)),
                "decoded": await _code(client.decode("a", len(PROMPT), tokens[:, :1])),
                "grown_past": await _code(client.decode("a", len(PROMPT) + 1, tokens[:, :8])),
                "decoded_again": await _code(client.decode("a", len(PROMPT) + 1, tokens[:, :7])),
                "sessions": head.info().sessions,
                "refused": head.refusals.snapshot().get("kv_cache_budget"),
                "closed": await client.close_session("a"),
                "second_again": await _code(client.prefill("b", tokens)),
            }
        finally:
            await client.close()
            await head.stop(0)
        return results

    results = run(main())
    code, details = results["second"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "session 'b'" in details
    assert f"to {32 * per_position:,} bytes, past the {budget:,}" in details and "--max-kv-cache-gib" in details
    code, details = results["grown_past"]
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "session 'a'" in details
    assert all(results[key][0] == grpc.StatusCode.OK for key in ("first", "decoded", "decoded_again", "second_again"))
    assert (results["sessions"], results["refused"], results["closed"]) == (1, 2, True)


def _request(client: InferenceClient, session_id: str, tokens: torch.Tensor):
    from agora.protos.stage_adapter import InferRequest

    return InferRequest(run_id=RUN, stage=client.stage, session_id=session_id, tokens=client._token_frame(tokens))


def test_the_pythia_geometry_through_the_workers_equals_one_process():
    """GPT-NeoX (partial rotary, parallel residual, dense wire of width 128, a 50k vocabulary)."""
    config = PRESETS["pythia-14m"].with_stages(3)
    prompt = torch.randint(0, config.model.vocab_size, (9,), generator=torch.Generator().manual_seed(2)).tolist()

    async def main():
        workers = [StageWorker(config, i, run_id=RUN) for i in range(3)]
        for worker in workers:
            await worker.start()
        views = [ReplicaView(f"p{i}", w.address, i, w.phase) for i, w in enumerate(workers)]
        try:
            async with SwarmGenerator(config, StaticReplicas(views), GeneratorOptions(run_id=RUN)) as generator:
                return (await generator.generate(prompt, 12)).tokens
        finally:
            await stop_all(workers)

    local = LocalGenerator([build_stage(config.model, i) for i in range(3)]).generate(prompt, 12)
    assert run(main()) == local and len(local) == 12
