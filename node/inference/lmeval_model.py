"""`SwarmLM`: lm-evaluation-harness's model interface over a `SwarmGenerator`, for evaluations run
inside a process that already holds the swarm (a trainer's, node/trainer/evals.py).

Why a model object rather than lm-eval's `local-completions` against an in-process `serve`: the
generator already scores and generates; an HTTP server, its port, JSON encoding of every request
and a tokenizer endpoint would sit between two objects of one process and add nothing. This module
is the whole adapter: tokenization with the run's tokenizer, and three request kinds.

- `loglikelihood`: context and continuation tokenized apart and joined (what the continuation's
  tokens are does not depend on the context's), cut from the left to the model's `max_seq_len`;
  one scored Prefill per batch of requests (`SwarmGenerator.score`), the continuation's summed
  log-probability and whether each of its tokens was the likeliest.
- `loglikelihood_rolling`: the text in lm-eval's rolling windows of at most `max_seq_len` ids, the
  first token of the text predicted from the end-of-sequence id (the run's document separator).
- `generate_until`: greedy, up to `max_gen_toks` tokens, cut at the first stop string.

lm-eval's API is synchronous: it runs on a thread of its own, and each request batch is handed to
the event loop that owns the generator (`run_coroutine_threadsafe`), so the loop keeps training
meanwhile. `stop()` makes the next request fail at once (the process is leaving).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from agora.node.inference.generator import SwarmGenerator
from agora.pipeline.inference import GREEDY
from agora.pipeline.tokenizer import Tokenizer

__all__ = ["SwarmLM", "EvaluationStopped"]

# Alternatives asked per position: one tells whether the continuation's token was the likeliest.
_TOP_K = 1
# Requests handed to the loop at once: the generator batches their prompts into scored Prefills.
_REQUESTS_PER_CALL = 64


class EvaluationStopped(RuntimeError):
    pass


class SwarmLM(LM):
    def __init__(self, generator: SwarmGenerator, tokenizer: Tokenizer, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.generator = generator
        self.tokenizer = tokenizer
        self.loop = loop
        self.max_len = generator.config.model.max_seq_len
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def _await(self, coroutine) -> Any:
        """Run `coroutine` on the generator's loop and wait for it here (lm-eval's thread)."""
        if self._stopped.is_set():
            coroutine.close()
            raise EvaluationStopped("the evaluation was stopped")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def _encode(self, text: str) -> list[int]:
        return [int(token) for token in self.tokenizer.encode(text)]

    # ------------------------------------------------------------------ scoring

    def _continuation_scores(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(summed log-probability of the continuation, greedy) for each (context, continuation) ids."""
        prompts, spans = [], []
        for context, continuation in pairs:
            tokens = (context + continuation)[-self.max_len:]
            start = max(1, len(tokens) - len(continuation))  # position `start - 1` predicts token `start`
            prompts.append(tokens)
            spans.append((tokens, start))
        out = []
        for first in range(0, len(prompts), _REQUESTS_PER_CALL):
            batch = prompts[first:first + _REQUESTS_PER_CALL]
            scores = self._await(self.generator.score(batch, top_k=_TOP_K))
            for (tokens, start), score in zip(spans[first:first + len(batch)], scores):
                logprobs = score.token_logprobs[0, start - 1:len(tokens) - 1]
                predicted = score.top_ids[0, start - 1:len(tokens) - 1, 0].tolist()
                out.append((float(logprobs.sum()), predicted == tokens[start:]))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            context_ids = self._encode(context) or [self.tokenizer.eos_id]
            pairs.append((context_ids, self._encode(continuation)))
        return self._continuation_scores(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            # lm-eval's own windows (as its hf model cuts them), each at most max_len ids in all.
            windows = [make_disjoint_window(window) for window in get_rolling_token_windows(
                token_list=self._encode(request.args[0]), prefix_token=self.tokenizer.eos_id,
                max_seq_len=self.max_len - 1, context_len=1)]
            out.append(sum(logprob for logprob, _ in self._continuation_scores(windows)))
        return out

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests) -> list[str]:
        out = []
        for request in requests:
            context, options = request.args
            options = dict(options or {})
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            prompt = (self._encode(context) or [self.tokenizer.eos_id])[-(self.max_len - 1):]
            max_new = int(options.get("max_gen_toks", 32))
            generation = self._await(self.generator.generate(prompt, max_new, GREEDY,
                                                             stop_ids=(self.tokenizer.eos_id,)))
            text = self.tokenizer.decode(generation.tokens)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out
