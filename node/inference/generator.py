"""`SwarmGenerator`: generation through one worker per stage, surviving the loss of any of them.

A generation is a session: a random id, a route of one replica per stage (node/inference/routing.py
picks each by measured latency and load, and the route is kept for the whole session), and on
every replica of the route that session's attention cache. The prompt goes through as a Prefill
on each stage, then one Decode per generated token; the tail answers the last position's logits
and the token is drawn here (pipeline/inference.TokenChooser), so a seeded sampling does not
depend on which replicas served it.

Failover. The client keeps what it sent each stage: the token ids and, for every stage after the
head, the wire it fed it (the subspace coordinates: k floats per token, so a 4096-token session
costs 4096 * k * 4 bytes per boundary). When a call fails, that stage alone moves:
- the replica is unreachable, timed out, or answered garbage: ban it (backoff), pick another
  replica of that stage, replay the session's inputs there with one Prefill, take its output for
  the positions of the failed call, and go on; the other stages keep their caches;
- the replica lost the session (NOT_FOUND: evicted, expired, restarted; FAILED_PRECONDITION:
  behind): replay it on the same replica;
- the replica is busy (RESOURCE_EXHAUSTED): wait a little and ask again (its cache is there);
  when what is full is its attention caches' byte budget (`kv_cache_budget`) and the stage has
  another replica, move there instead, without a ban (the replica is healthy, only full), and
  replay the session there: a refused call changed nothing, and waiting would only help once
  another session on it ends.
Calls at a position the worker already holds cut its cache back first (pipeline/inference.py), so
a retry after a reply was lost is exact. A step gives up after `max_attempts` failed calls on one
stage. The output is unchanged: the replayed cache holds what the lost one held (a prefill and
the decodes it replaces compute the same positions on the same weights; float rounding may differ
in the last bits, which does not move a greedy choice short of an exact tie).

Scoring (`score`, and a generation's `score_prompt`): the tail answers every position's
log-probability and top-k alternatives (pipeline/inference.score_positions) for the calls that ask,
only ever a Prefill at position 0, so a scoring call that fails is simply made again, here or on
another replica, by the same failover. `score` puts several prompts in one session of several
rows, right-padded to the longest (attention is causal: padding after a prompt changes none of its
positions); a batch holds at most `score_rows` rows, by default the run's microbatch size, which
every worker accepts (--max-rows only raises it). Prompts are batched longest first, so the
padding stays small. A generation's own tokens are scored here from the logits each step brings
back, with the same log-softmax.

Sessions are closed on every replica that holds them when the generation ends (best effort: a
worker also drops idle sessions after its TTL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Sequence

import grpc
import torch

from agora.node.inference.client import InferenceClient, InferResult
from agora.node.inference.discovery import ReplicaDiscovery
from agora.node.inference.routing import ReplicaRoster, ReplicaView
from agora.node.inference.sessions import CACHE_FULL_MARK
from agora.node.rpc.tls import ChannelFactory
from agora.node.trainer.stage_client import StageCallError, WorkerBusy
from agora.pipeline.config import ConfigError, RunConfig
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.inference import (GREEDY, PositionScores, Sampling, TokenChooser, new_token_budget,
                                      score_next)

__all__ = ["GeneratorOptions", "GeneratorStats", "Generation", "GenerationFailed", "SwarmGenerator",
           "plan_score_batches"]

logger = logging.getLogger("agora.node.inference")

# The replica no longer holds the session (or holds fewer positions): replay it there.
_SESSION_LOST = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


class GenerationFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class GeneratorOptions:
    run_id: str
    max_attempts: int = 6  # failed calls on one stage within one step before the generation fails
    call_timeout_s: float = 30.0
    refresh_s: float = 2.0  # how often the roster is read from the DHT (and at once after a failure)
    wait_for_replicas_s: float = 30.0  # how long a stage may have no serving replica
    busy_pause_s: float = 0.05  # first pause before asking a busy replica again (doubles)
    close_timeout_s: float = 5.0
    score_rows: Optional[int] = None  # prompts scored in one call; None: the run's train.microbatch_size


@dataclass
class GeneratorStats:
    sessions: int = 0
    tokens: int = 0
    retries: int = 0  # failed calls, whatever followed
    replays: int = 0  # Prefills that rebuilt a session mid-generation
    failovers: int = 0  # route moves to another replica
    busy: int = 0
    cache_full_moves: int = 0  # route moves off a replica whose caches were full (kv_cache_budget)
    scored_prompts: int = 0  # prompts scored by `score`
    scored_tokens: int = 0


@dataclass
class Generation:
    """One generation's outcome (filled as it goes when passed to `stream`)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop": a stop id ended it; "length": the token budget did
    prompt_tokens: int = 0
    retries: int = 0
    route: dict[int, str] = field(default_factory=dict)  # stage -> endpoint, at the end
    prompt_scores: Optional[PositionScores] = None  # with `score_prompt`: the prompt's, rows 1
    token_scores: list[PositionScores] = field(default_factory=list)  # with `logprobs`: each token's, n 1


def plan_score_batches(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """The prompts' indices in batches of at most `max_rows`, longest first (least padding)."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [order[start:start + max_rows] for start in range(0, len(order), max_rows)]


class _Session:
    def __init__(self, n_stages: int, max_tokens: int):
        self.id = secrets.token_hex(16)
        self.max_tokens = max_tokens
        self.route: dict[int, ReplicaView] = {}
        self.held: set[int] = set()  # stages whose routed replica holds the session
        self.fed: list[int] = []  # token ids of the positions fed so far
        self.inputs: list[list[torch.Tensor]] = [[] for _ in range(n_stages)]  # wire fed to each stage
        self.retries = 0


class SwarmGenerator:
    """Generates through the swarm's serving replicas; use inside one event loop (`async with`)."""

    def __init__(self, config: RunConfig, discovery: ReplicaDiscovery, options: GeneratorOptions, *,
                 channels: Optional[ChannelFactory] = None, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.n_stages = len(config.layer_split)
        self.discovery = discovery
        self.options = options
        self.channels = channels
        self.fingerprint = run_fingerprint(config)
        self.roster = ReplicaRoster()
        self.stats = GeneratorStats()
        self._clock = clock
        self._clients: dict[tuple[str, str], InferenceClient] = {}
        self._refreshed_at = -float("inf")
        self._closing: set[asyncio.Task] = set()

    async def __aenter__(self) -> "SwarmGenerator":
        await self.refresh(force=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    # ------------------------------------------------------------------ routing

    async def refresh(self, force: bool = False) -> None:
        now = self._clock()
        if not force and now - self._refreshed_at < self.options.refresh_s:
            return
        self._refreshed_at = now
        try:
            self.roster.refresh(await self.discovery.replicas())
        except Exception as error:  # a DHT hiccup: keep the roster we have
            logger.warning("could not refresh the serving replicas: %s", error)

    def _client(self, view: ReplicaView) -> InferenceClient:
        key = (view.endpoint, view.peer_id)
        client = self._clients.get(key)
        if client is None or client.stage != view.stage:
            client = InferenceClient(view.endpoint, run_id=self.options.run_id, stage=view.stage,
                                     model=self.config.model, fingerprint=self.fingerprint, peer_id=view.peer_id,
                                     channels=self.channels, timeout_s=self.options.call_timeout_s)
            self._clients[key] = client
        return client

    async def _choose(self, stage: int, exclude: frozenset[str]) -> ReplicaView:
        deadline = self._clock() + self.options.wait_for_replicas_s
        while True:
            view = self.roster.choose(stage, self._clock(), exclude)
            if view is None and exclude:
                view = self.roster.choose(stage, self._clock())  # only the excluded are left: one may be back
            if view is not None:
                return view
            if self._clock() > deadline:
                raise GenerationFailed(f"no replica of stage {stage} serves run {self.options.run_id!r} "
                                       f"(waited {self.options.wait_for_replicas_s:g} s)")
            await asyncio.sleep(0.2)  # a replica's ban runs out, or a new one announces itself
            await self.refresh(force=True)

    # ------------------------------------------------------------------ one stage, one step

    async def _on_stage(self, session: _Session, stage: int, tokens: torch.Tensor, wire: Optional[torch.Tensor],
                        position: int, score: Optional[int]) -> InferResult:
        """The stage's output for the positions `position`.. (failover in the module docstring)."""
        failures = 0
        exclude: set[str] = set()
        while True:
            view = session.route.get(stage)
            if view is None:
                view = await self._choose(stage, frozenset(exclude))
                session.route[stage] = view
                self.roster.opened(view.peer_id)
            client = self._client(view)
            started = self._clock()
            try:
                output = await self._call(client, session, stage, tokens, wire, position, score)
                self.roster.succeeded(view.peer_id, self._clock() - started)
                return output
            except StageCallError as error:
                failures += 1
                session.retries += 1
                self.stats.retries += 1
                if failures >= self.options.max_attempts:
                    raise GenerationFailed(f"stage {stage}: {failures} failed calls in one step; last: {error}") from None
                if isinstance(error, WorkerBusy) and CACHE_FULL_MARK in error.details and \
                        len(self.roster.of_stage(stage)) > len(exclude) + 1:
                    logger.info("stage %d replica %s has no room for session %s: moving it to another replica (%s)",
                                stage, view.endpoint, session.id[:8], error.details)
                    self.stats.busy += 1
                    self.stats.cache_full_moves += 1
                    self._leave(session, stage, view, exclude)
                elif isinstance(error, WorkerBusy):
                    self.stats.busy += 1
                    await asyncio.sleep(self.options.busy_pause_s * 2 ** (failures - 1))
                elif error.code in _SESSION_LOST and stage in session.held:
                    logger.info("stage %d replica %s lost session %s: replaying it there (%s)", stage, view.endpoint,
                                session.id[:8], error.details)
                    session.held.discard(stage)
                else:
                    logger.warning("stage %d replica %s failed (%s): moving session %s to another replica", stage,
                                   view.endpoint, error, session.id[:8])
                    self.roster.failed(view.peer_id, self._clock())
                    session.held.discard(stage)  # nothing to close on a replica that failed
                    self._leave(session, stage, view, exclude)
                    self.stats.failovers += 1
                    await self.refresh(force=True)

    def _leave(self, session: _Session, stage: int, view: ReplicaView, exclude: set[str]) -> None:
        """Take the session's route for `stage` off `view` (the next call picks another replica); what
        the replica still holds of the session is closed there, in the background."""
        self.roster.closed(view.peer_id)
        exclude.add(view.peer_id)
        del session.route[stage]
        if stage in session.held:
            session.held.discard(stage)
            self._close_on(view, session.id)

    async def _call(self, client: InferenceClient, session: _Session, stage: int, tokens: torch.Tensor,
                    wire: Optional[torch.Tensor], position: int, score: Optional[int]) -> InferResult:
        """The stage's reply for the positions `position`..; `score` (top-k): a scored Prefill (position 0)."""
        if score is not None:
            result = await client.prefill(session.id, tokens, wire, max_tokens=session.max_tokens, score=True,
                                          top_logprobs=score)
            session.held.add(stage)
            return result
        if stage in session.held:
            return await client.decode(session.id, position, tokens, wire)
        replay = position > 0
        if replay:  # everything this stage was fed, then the new positions
            tokens = torch.cat((torch.tensor([session.fed], dtype=torch.long), tokens), dim=1)
            if wire is not None:
                wire = torch.cat((*session.inputs[stage], wire), dim=1)
        result = await client.prefill(session.id, tokens, wire, max_tokens=session.max_tokens)
        session.held.add(stage)
        if replay:
            self.stats.replays += 1
        return result if client.is_tail or not replay else dataclasses.replace(result,
                                                                                output=result.output[:, position:])

    async def _forward(self, session: _Session, tokens: torch.Tensor, score: Optional[int]) -> InferResult:
        """Feed `tokens` (rows, n) through every stage; the tail's reply."""
        position = len(session.fed)
        wire = None
        for stage in range(self.n_stages):
            result = await self._on_stage(session, stage, tokens, wire, position, score)
            if stage > 0:
                session.inputs[stage].append(wire)
            wire = result.output
        return result

    async def _step(self, session: _Session, new: Sequence[int], score: Optional[int] = None) -> InferResult:
        """Feed `new` through every stage (`score`: scored, top-k); the tail's reply."""
        result = await self._forward(session, torch.tensor([list(new)], dtype=torch.long), score)
        session.fed.extend(new)
        return result

    def _close(self, session: _Session) -> None:
        """Close the session on every replica that holds it, in the background."""
        for stage, view in session.route.items():
            self.roster.closed(view.peer_id)
            if stage in session.held:
                self._close_on(view, session.id)

    def _close_on(self, view: ReplicaView, session_id: str) -> None:
        client = self._client(view)

        async def close() -> None:
            try:
                await client.close_session(session_id, timeout_s=self.options.close_timeout_s)
            except StageCallError:
                pass  # gone already: its TTL drops the session anyway

        task = asyncio.ensure_future(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # ------------------------------------------------------------------ generation

    async def stream(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY,
                     stop_ids: Sequence[int] = (), outcome: Optional[Generation] = None, *,
                     logprobs: Optional[int] = None, score_prompt: bool = False) -> AsyncIterator[int]:
        """The generated token ids one by one (a stop id ends it and is not yielded); `outcome` is
        filled as it goes (finish reason, retries, route). `logprobs` (top-k): each generated token's
        scores in `outcome.token_scores`; `score_prompt`: the prompt's in `outcome.prompt_scores`
        (top-k `logprobs` or 0), from the generation's own Prefill."""
        outcome = outcome if outcome is not None else Generation()
        outcome.prompt_tokens = len(prompt)
        budget = new_token_budget(len(prompt), max_new_tokens, self.config.model.max_seq_len)
        chooser = TokenChooser(sampling)
        if budget == 0:
            return
        await self.refresh()
        session = _Session(self.n_stages, max_tokens=len(prompt) + budget - 1)
        self.stats.sessions += 1
        new: Sequence[int] = list(prompt)
        score = (logprobs or 0) if score_prompt else None
        try:
            for _ in range(budget):
                result = await self._step(session, new, score)
                if score is not None:
                    outcome.prompt_scores, score = result.scores, None
                logits = result.output[0, -1]
                token = chooser.choose(logits)
                if token in stop_ids:
                    outcome.finish_reason = "stop"
                    return
                if logprobs is not None:
                    outcome.token_scores.append(score_next(logits.view(1, 1, -1), torch.tensor([[token]]), logprobs))
                outcome.tokens.append(token)
                self.stats.tokens += 1
                yield token
                new = [token]
        finally:
            outcome.retries = session.retries
            outcome.route = {stage: view.endpoint for stage, view in session.route.items()}
            self._close(session)

    async def score(self, prompts: Sequence[Sequence[int]], top_k: int = 0) -> list[PositionScores]:
        """Each prompt's scores (rows 1, its length), from one scored Prefill per batch of prompts
        through the swarm, without a decode; ConfigError for a prompt empty or too long."""
        limit = self.config.model.max_seq_len
        for prompt in prompts:
            if not 1 <= len(prompt) <= limit:
                raise ConfigError(f"prompt: {len(prompt)} tokens, scoring takes 1 to {limit} (model.max_seq_len)")
        await self.refresh()
        lengths = [len(prompt) for prompt in prompts]
        scores: list[Optional[PositionScores]] = [None] * len(prompts)
        for batch in plan_score_batches(lengths, self.options.score_rows or self.config.train.microbatch_size):
            width = lengths[batch[0]]
            tokens = torch.zeros((len(batch), width), dtype=torch.long)  # padding: id 0, never scored
            for row, index in enumerate(batch):
                tokens[row, :lengths[index]] = torch.as_tensor(list(prompts[index]), dtype=torch.long)
            session = _Session(self.n_stages, max_tokens=width)
            self.stats.sessions += 1
            try:
                batch_scores = (await self._forward(session, tokens, top_k)).scores
            finally:
                self._close(session)
            for row, index in enumerate(batch):
                scores[index] = batch_scores.row(row, lengths[index])
            self.stats.scored_prompts += len(batch)
            self.stats.scored_tokens += sum(lengths[index] for index in batch)
        return scores

    async def generate(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = GREEDY,
                       stop_ids: Sequence[int] = ()) -> Generation:
        outcome = Generation()
        async for _ in self.stream(prompt, max_new_tokens, sampling, stop_ids, outcome):
            pass
        return outcome
