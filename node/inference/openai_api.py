"""`OpenAIServer`: an OpenAI-compatible HTTP API in front of a `SwarmGenerator` (`agora-node serve`).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events ending in `data: [DONE]`), `GET /v1/agora/stats` (this
server's generator counters: sessions, tokens, retries, replays, failovers, scored prompts; not
OpenAI's), and vLLM's tokenizer endpoints (below).

Design choices:
- aiohttp's server runs on the process's one event loop, beside the gRPC channels of the
  generator; each request is its own task, so concurrent requests are concurrent generations
  (each its own session and route through the swarm).
- Fields of `/v1/completions` (request_fields.py parses them; choices.py runs them):
  `model` (must be the served one); `prompt`: a string, a list of strings, a list of token ids,
  or a list of lists of token ids (each a prompt; ids in the model's vocabulary);
  `max_tokens` (default 16 as OpenAI's; 0: score only, nothing generated, the prompts scored in
  batched Prefills through the swarm); `echo` (the prompt leads each choice's text, and its
  tokens lead `logprobs`); `logprobs` (0..20: OpenAI's legacy object, `tokens`, `token_logprobs`
  (null for the first prompt token), `top_logprobs` (that many likeliest plus the token itself,
  text -> log-probability), `text_offset`; the model's log-softmax, not the temperature's);
  `n` (choices per prompt, index = prompt * n + j, choice j sampled with seed + j; prompts x n
  at most 2048); `temperature` (default 1.0 as OpenAI's; 0 is greedy), `top_p`, `seed`
  (default: a random one per request), `stop` (a string or up to 4), `stream` (each choice's
  deltas as events, with its `index`; with `echo` the prompt comes first). Chat completions:
  `messages` (rendered by node/inference/text.render_chat), `max_completion_tokens` or
  `max_tokens` (default 256), `logprobs` (true: `choices[].logprobs.content`, per token `token`,
  `logprob`, `bytes`, `top_logprobs`), `top_logprobs` (0..20, only with `logprobs`), and the
  sampling fields above. Unknown fields are ignored as OpenAI's API does with optional ones.
- vLLM's tokenizer endpoints at the root: `GET /tokenizer_info` (`eos_token`, `model_max_length`),
  `POST /tokenize` (`prompt` -> `tokens`, `count`), `POST /detokenize` (`tokens` -> `prompt`).
  lm-eval's `local-completions` finds them and tokenizes with the served tokenizer, so no
  tokenizer files are needed beside the URL.
- Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400
  invalid_request_error naming the field, 404 for another model, 503 when the swarm cannot serve
  (no replica of a stage, every attempt failed). A stream that fails after it started ends with
  one `data: {"error": ...}` event.
- Token ids come from the run's tokenizer; the end-of-text id always stops a generation.
- Keys (`keys`, node/inference/api_keys.py): with a key file, every request must carry one as
  `Authorization: Bearer KEY` (what OpenAI's clients send), else 401 with OpenAI's body
  (`invalid_request_error`, code `invalid_api_key`) and `WWW-Authenticate: Bearer`. Without one
  the API is open, as vLLM's is without `--api-key`.
- Load (`ServeOptions`): completions served at once, and by one key, are bounded; beyond, 429
  with OpenAI's body (type `requests`, code `rate_limit_exceeded`) and `Retry-After: 1`, which
  OpenAI's clients wait for before they retry. Each completion is a session on every stage, and
  workers evict the least recently used session when they hold too many, so admitting more than
  the swarm holds would make generations evict each other. A completion holds its place until its
  answer or its stream ends; a refusal comes before the body is read. Refusals are counted by
  reason (`/v1/agora/stats`) and logged (naming the key's line, never the key).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections import Counter
from typing import Any, AsyncIterator, Optional

from aiohttp import web

from agora.node.inference.api_keys import ApiKeys
from agora.node.inference.choices import Choice, ChoiceDelta, ChoiceRunner, collect
from agora.node.inference.generator import SwarmGenerator
from agora.node.inference.logprobs import chat_logprobs, completion_logprobs
from agora.node.inference.options import ServeOptions
from agora.node.inference.request_fields import ApiError, CompletionRequest, parse_chat, parse_completion
from agora.node.rpc.call_slots import CallPool
from agora.pipeline.tokenizer import Tokenizer

__all__ = ["OpenAIServer"]

logger = logging.getLogger("agora.node.inference")

_MAX_BODY_BYTES = 1 << 20
_RETRY_AFTER_S = 1
_OPEN = "anyone"  # who every completion counts for without keys


class OpenAIServer:
    """`keys`: the accepted API keys (None: open to anyone); `options`: the bounds on load."""

    def __init__(self, generator: SwarmGenerator, tokenizer: Tokenizer, *, model_name: str,
                 keys: Optional[ApiKeys] = None, options: ServeOptions = ServeOptions(), clock=time.time):
        self.generator = generator
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.keys = keys
        self._clock = clock
        self._created = int(clock())
        self.requests = 0
        self.refused: Counter[str] = Counter()  # refused requests by reason (/v1/agora/stats)
        capacity = options.max_concurrent_requests
        self.in_flight = CallPool("completions", capacity, options.requests_per_key if keys else capacity,
                                  "serve.max_concurrent_requests")
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._errors, self._authenticate])
        app.add_routes([web.get("/v1/models", self._models), web.post("/v1/completions", self._completions),
                        web.post("/v1/chat/completions", self._chat), web.get("/v1/agora/stats", self._stats),
                        web.get("/tokenizer_info", self._tokenizer_info), web.post("/tokenize", self._tokenize),
                        web.post("/detokenize", self._detokenize)])
        self._runner = web.AppRunner(app, access_log=None)
        self.url: Optional[str] = None

    async def start(self, host: str, port: int) -> str:
        """Listen; the API's base URL (`http://host:port/v1`, the real port for port 0)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # aiohttp exposes the bound port only this way
        shown = f"[{host}]" if ":" in host else host
        self.url = f"http://{shown}:{bound[1]}/v1"
        return self.url

    async def stop(self) -> None:
        await self._runner.cleanup()

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as error:
            return web.json_response(error.body(), status=error.status, headers=error.headers)
        except web.HTTPException as error:  # aiohttp's own: unknown route, wrong method, body too large
            body = ApiError(error.status, error.reason or "request refused", code=str(error.status)).body()
            return web.json_response(body, status=error.status)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler) -> web.StreamResponse:
        if self.keys is None or self._key_of(request) is not None:
            return await handler(request)
        presented = request.headers.get("Authorization", "")
        self._refuse(request, "invalid_api_key" if presented else "missing_api_key", None)
        message = ("Incorrect API key provided." if presented else
                   "No API key provided: send one as 'Authorization: Bearer KEY'.")
        raise ApiError(401, message + " This server takes the keys of its --api-key-file.",
                       code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="agora"'})

    def _key_of(self, request: web.Request) -> Optional[str]:
        """The name of the key the request carries (`Authorization: Bearer KEY`), None for none or a wrong one."""
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        return self.keys.match(presented.strip()) if scheme.lower() == "bearer" else None

    @contextlib.asynccontextmanager
    async def _admitted(self, request: web.Request) -> AsyncIterator[None]:
        """A place among the completions in flight for the request's key, for as long as it runs."""
        owner = _OPEN if self.keys is None else self._key_of(request)
        refusal = self.in_flight.refusal(owner)
        if refusal is not None:
            self._refuse(request, "rate_limit_exceeded", owner)
            held, limit = (self.in_flight.capacity, "serve.max_concurrent_requests") if refusal[0] == "full" else \
                (self.in_flight.per_caller, "serve.max_requests_per_key")
            whose = "this server" if refusal[0] == "full" else "this API key"
            raise ApiError(429, f"Rate limit reached: {whose} already has {held} completions in flight, the most "
                                f"it may ({limit}); retry when one ends", kind="requests",
                           code="rate_limit_exceeded", headers={"Retry-After": str(_RETRY_AFTER_S)})
        self.in_flight.take(owner)
        try:
            yield
        finally:
            self.in_flight.give_back(owner)

    def _refuse(self, request: web.Request, reason: str, key: Optional[str]) -> None:
        self.refused[reason] += 1
        level = logging.INFO if reason == "rate_limit_exceeded" else logging.WARNING
        logger.log(level, "serve: %s %s from %s refused: %s%s", request.method, request.path, request.remote, reason,
                   f" ({key})" if key else "", extra={"milestone": "api_request_refused", "fields": {
                       "reason": reason, "path": request.path, "remote": request.remote, "key": key}})

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON") from None

    def _check_model(self, body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if model != self.model_name:
            raise ApiError(404, f"model: {model!r:.80} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "agora"}]})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "in_flight": self.in_flight.in_use,
                                  "refused": dict(self.refused), **vars(self.generator.stats)})

    # ------------------------------------------------------------------ tokenizer (vLLM's endpoints)

    async def _tokenizer_info(self, request: web.Request) -> web.Response:
        return web.json_response({"eos_token": self.tokenizer.decode([self.tokenizer.eos_id]), "bos_token": None,
                                  "pad_token": None, "model_max_length": self.generator.config.model.max_seq_len,
                                  "tokenizer_class": type(self.tokenizer).__name__})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise ApiError(400, "prompt: expected a string", param="prompt")
        tokens = [int(t) for t in self.tokenizer.encode(text)]
        return web.json_response({"count": len(tokens), "max_model_len": self.generator.config.model.max_seq_len,
                                  "tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        vocab = self.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ApiError(400, f"tokens: expected a list of token ids in [0, {vocab})", param="tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # ------------------------------------------------------------------ completions

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted(request):
            body = await self._body(request)
            self._check_model(body)
            completion = parse_completion(body, self.generator.config.model.vocab_size)
            return await self._respond(request, completion, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted(request):
            body = await self._body(request)
            self._check_model(body)
            completion, _ = parse_chat(body)
            return await self._respond(request, completion, chat=True)

    def _logprobs(self, delta: ChoiceDelta | Choice, chat: bool) -> Optional[dict]:
        if delta.logprobs is None:
            return None
        decode = self._token_text
        return chat_logprobs(delta.logprobs, decode) if chat else completion_logprobs(delta.logprobs, decode,
                                                                                      delta.text_start)

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    async def _respond(self, request: web.Request, completion: CompletionRequest, chat: bool) -> web.StreamResponse:
        self.requests += 1
        runner = ChoiceRunner(self.generator, self.tokenizer, completion)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12), "created": int(self._clock()),
                "model": self.model_name}
        if not completion.stream:
            deltas = [delta async for delta in runner.deltas()]
            choices = [self._choice(choice, chat) for choice in collect(deltas)]
            return web.json_response({**head, "object": "chat.completion" if chat else "text_completion",
                                      "choices": choices, "usage": self._usage(runner)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        started: set[int] = set()
        try:
            async for delta in runner.deltas():
                if chat and delta.index not in started:
                    started.add(delta.index)
                    await self._event(response, {**head, "object": "chat.completion.chunk", "choices": [
                        {"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}]})
                if delta.text or delta.finish_reason or delta.logprobs:
                    await self._event(response, {**head, "object": "chat.completion.chunk" if chat
                                                 else "text_completion", "choices": [self._chunk(delta, chat)]})
        except ApiError as error:
            await self._event(response, error.body())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    async def _event(response: web.StreamResponse, event: dict) -> None:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

    def _choice(self, choice: Choice, chat: bool) -> dict:
        if chat:
            return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                    "logprobs": self._logprobs(choice, chat), "finish_reason": choice.finish_reason}
        return {"index": choice.index, "text": choice.text, "logprobs": self._logprobs(choice, chat),
                "finish_reason": choice.finish_reason}

    def _chunk(self, delta: ChoiceDelta, chat: bool) -> dict:
        if chat:
            return {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
                    "logprobs": self._logprobs(delta, chat), "finish_reason": delta.finish_reason}
        return {"index": delta.index, "text": delta.text, "logprobs": self._logprobs(delta, chat),
                "finish_reason": delta.finish_reason}

    @staticmethod
    def _usage(runner: ChoiceRunner) -> dict:
        usage = runner.usage
        return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.prompt_tokens + usage.completion_tokens}
