"""`ChoiceRunner`: one request's choices run through the swarm, as a sequence of `ChoiceDelta`s.

One path for both answers: a stream sends each delta as an event, a whole answer adds them up
per choice (`collect`). Choices come in OpenAI's order, prompt by prompt and `n` per prompt
(index = prompt * n + j), one after another: a request holds one place among the completions in
flight (openai_api.py), so it runs one session at a time through the swarm.

- Score only (`max_tokens` 0): nothing is generated. With `echo` and `logprobs` every prompt is
  scored in batched Prefills (SwarmGenerator.score: no decode loop); with `echo` alone the prompt
  is the text and nothing reaches the swarm.
- Generation: choice j of a prompt draws with the request's seed + j, so the choices differ when
  sampled and are equal when greedy. With `logprobs` every drawn token is scored; with `echo`
  too, the prompt is scored by the generation's own Prefill and its delta (the prompt's text and
  log-probabilities) comes first, once that Prefill has answered.
- A stop string ends the text before it (node/inference/text.TextStream); the log-probabilities
  cover every token drawn up to there, the one that completed the stop string included (as vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Optional, Sequence

from agora.node.inference.generator import Generation, GenerationFailed, SwarmGenerator
from agora.node.inference.logprobs import TokenLogprob, generated_logprobs, prompt_logprobs
from agora.node.inference.request_fields import ApiError, CompletionRequest, Prompt
from agora.node.inference.text import TextStream
from agora.pipeline.config import ConfigError
from agora.pipeline.tokenizer import Tokenizer

__all__ = ["ChoiceDelta", "Choice", "ChoiceRunner", "collect"]


@dataclass(frozen=True)
class ChoiceDelta:
    index: int
    text: str = ""
    logprobs: Optional[list[TokenLogprob]] = None  # the tokens of this delta, when logprobs were asked
    finish_reason: Optional[str] = None  # set on a choice's last delta
    text_start: int = 0  # where this delta's text begins in the choice's text (the prompt's end unless echoed)


@dataclass
class Choice:
    index: int
    text: str = ""
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None
    text_start: int = 0


def collect(deltas: Sequence[ChoiceDelta]) -> list[Choice]:
    """Whole choices from their deltas, by index."""
    choices: dict[int, Choice] = {}
    for delta in deltas:
        choice = choices.get(delta.index)
        if choice is None:
            choice = choices[delta.index] = Choice(delta.index, text_start=delta.text_start)
        choice.text += delta.text
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
        choice.finish_reason = delta.finish_reason or choice.finish_reason
    return [choices[index] for index in sorted(choices)]


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Pending:
    """A generated choice's text and tokens not yet handed out."""

    index: int
    at: int  # characters of the choice's text before what is pending
    logprobs: Optional[list[TokenLogprob]] = field(default=None)

    def delta(self, text: str, finish_reason: Optional[str] = None) -> ChoiceDelta:
        out = ChoiceDelta(self.index, text, self.logprobs, finish_reason, self.at)
        self.at += len(text)
        self.logprobs = None if self.logprobs is None else []
        return out


class ChoiceRunner:
    """Runs the choices of one request (see the module docstring); `usage` once they have run."""

    def __init__(self, generator: SwarmGenerator, tokenizer: Tokenizer, completion: CompletionRequest):
        self.generator = generator
        self.tokenizer = tokenizer
        self.completion = completion
        self.usage = _Usage()
        self.prompts = [self._ids(prompt) for prompt in completion.prompts]
        self.usage.prompt_tokens = sum(len(ids) for ids in self.prompts)

    def _ids(self, prompt: Prompt) -> list[int]:
        ids = [int(t) for t in self.tokenizer.encode(prompt)] if isinstance(prompt, str) else list(prompt)
        limit = self.generator.config.model.max_seq_len
        longest = limit if self.completion.max_tokens == 0 else limit - 1
        if not ids or len(ids) > longest:
            raise ApiError(400, f"prompt: {len(ids)} tokens, this model takes 1 to {longest} "
                                f"(model.max_seq_len {limit}, less one to generate)", param="prompt",
                           code="context_length_exceeded")
        return ids

    def _text(self, index: int) -> str:
        prompt = self.completion.prompts[index]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        try:
            if self.completion.max_tokens == 0:
                async for delta in self._scored():
                    yield delta
                return
            for prompt_index in range(len(self.prompts)):
                for j in range(self.completion.n):
                    async for delta in self._generated(prompt_index, j):
                        yield delta
        except ConfigError as error:
            raise ApiError(400, str(error), param="prompt") from None
        except GenerationFailed as error:
            raise ApiError(503, f"the swarm could not complete this request: {error}", kind="server_error") from None

    async def _scored(self) -> AsyncIterator[ChoiceDelta]:
        completion = self.completion
        scores = None
        if completion.echo and completion.logprobs is not None:
            scores = await self.generator.score(self.prompts, completion.logprobs)
        for prompt_index, ids in enumerate(self.prompts):
            text = self._text(prompt_index) if completion.echo else ""
            logprobs = None
            if completion.logprobs is not None:
                logprobs = prompt_logprobs(ids, scores[prompt_index]) if scores is not None else []
            for j in range(completion.n):
                start = 0 if completion.echo else len(self._text(prompt_index))
                yield ChoiceDelta(prompt_index * completion.n + j, text, logprobs, "length", start)

    async def _generated(self, prompt_index: int, j: int) -> AsyncIterator[ChoiceDelta]:
        completion = self.completion
        ids = self.prompts[prompt_index]
        prompt_text = self._text(prompt_index)
        wants = completion.logprobs is not None
        pending = _Pending(prompt_index * completion.n + j, 0 if completion.echo else len(prompt_text),
                           [] if wants else None)
        echo_due = completion.echo
        outcome = Generation()
        text = TextStream(self.tokenizer, completion.stop)
        sampling = replace(completion.sampling, seed=(completion.sampling.seed + j) % 2**63)
        tokens = self.generator.stream(ids, completion.max_tokens, sampling, (self.tokenizer.eos_id,), outcome,
                                       logprobs=completion.logprobs, score_prompt=echo_due and wants)
        scored = 0
        try:
            async for token in tokens:
                if echo_due:
                    yield self._echo(pending, ids, prompt_text, outcome)
                    echo_due = False
                delta = text.add(token)
                if wants:
                    pending.logprobs += generated_logprobs(outcome.tokens[scored:], outcome.token_scores[scored:])
                    scored = len(outcome.tokens)
                if delta:
                    yield pending.delta(delta)
                if text.stopped:
                    break
        finally:
            await tokens.aclose()
        if echo_due:
            yield self._echo(pending, ids, prompt_text, outcome)
        self.usage.completion_tokens += len(outcome.tokens)
        yield pending.delta(text.finish(), "stop" if text.stopped else outcome.finish_reason)

    @staticmethod
    def _echo(pending: _Pending, ids: list[int], prompt_text: str, outcome: Generation) -> ChoiceDelta:
        """The prompt as a choice's first delta (with its scores, from the generation's Prefill, when asked)."""
        logprobs = None
        if pending.logprobs is not None:
            logprobs = prompt_logprobs(ids, outcome.prompt_scores) if outcome.prompt_scores is not None else []
        delta = ChoiceDelta(pending.index, prompt_text, logprobs, None, pending.at)
        pending.at += len(prompt_text)
        return delta
