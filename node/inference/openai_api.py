"""`OpenAIServer`: an OpenAI-compatible HTTP API in front of a `SwarmGenerator` (`agora-node serve`).

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both with
`stream: true` as server-sent events ending in `data: [DONE]`), and `GET /v1/agora/stats` (this
server's generator counters: sessions, tokens, retries, replays, failovers; not OpenAI's).

Design choices:
- aiohttp's server runs on the process's one event loop, beside the gRPC channels of the
  generator; each request is its own task, so concurrent requests are concurrent generations
  (each its own session and route through the swarm).
- Fields: `model` (must be the served one), `prompt` (a string, or a list of one string) or
  `messages` (rendered by node/inference/text.render_chat), `max_tokens` (`max_completion_tokens`
  for chat; default 16 as OpenAI's completions), `temperature` (default 1.0 as OpenAI's; 0 is
  greedy), `top_p`, `seed` (default: a random one per request), `stop` (a string or up to 4),
  `n` (only 1), `stream`. Unknown fields are ignored as OpenAI's API does with optional ones.
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
from agora.node.inference.generator import Generation, GenerationFailed, SwarmGenerator
from agora.node.inference.options import ServeOptions
from agora.node.inference.request_fields import ApiError, CompletionRequest, parse_chat, parse_completion
from agora.node.inference.text import TextStream
from agora.node.rpc.call_slots import CallPool
from agora.pipeline.config import ConfigError
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
                        web.post("/v1/chat/completions", self._chat), web.get("/v1/agora/stats", self._stats)])
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

    def _prompt_ids(self, text: str) -> list[int]:
        ids = [int(t) for t in self.tokenizer.encode(text)]
        limit = self.generator.config.model.max_seq_len
        if len(ids) >= limit:
            raise ApiError(400, f"prompt: {len(ids)} tokens, this model takes fewer than {limit} (model.max_seq_len)",
                           param="prompt", code="context_length_exceeded")
        return ids

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "agora"}]})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "in_flight": self.in_flight.in_use,
                                  "refused": dict(self.refused), **vars(self.generator.stats)})

    # ------------------------------------------------------------------ completions

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted(request):
            body = await self._body(request)
            self._check_model(body)
            completion = parse_completion(body)
            return await self._respond(request, completion, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        async with self._admitted(request):
            body = await self._body(request)
            self._check_model(body)
            completion, _ = parse_chat(body)
            return await self._respond(request, completion, chat=True)

    async def _respond(self, request: web.Request, completion: CompletionRequest, chat: bool) -> web.StreamResponse:
        self.requests += 1
        prompt = self._prompt_ids(completion.prompt)
        ident = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(self._clock())
        text = TextStream(self.tokenizer, completion.stop)
        outcome = Generation()
        tokens = self.generator.stream(prompt, completion.max_tokens, completion.sampling,
                                       (self.tokenizer.eos_id,), outcome)
        if not completion.stream:
            try:
                async for token in tokens:
                    text.add(token)
                    if text.stopped:
                        break
            except ConfigError as error:
                raise ApiError(400, str(error), param="prompt") from None
            except GenerationFailed as error:
                raise ApiError(503, f"the swarm could not complete this request: {error}", kind="server_error") from None
            finally:
                await tokens.aclose()
            text.finish()
            reason = "stop" if text.stopped else outcome.finish_reason
            choice = ({"index": 0, "message": {"role": "assistant", "content": text.text}, "finish_reason": reason}
                      if chat else {"index": 0, "text": text.text, "logprobs": None, "finish_reason": reason})
            return web.json_response({
                "id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": self.model_name, "choices": [choice], "usage": self._usage(outcome)})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(delta: Optional[str], reason: Optional[str]) -> None:
            if chat:
                content = {} if delta is None else {"content": delta}
                event = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": [{"index": 0, "delta": content, "finish_reason": reason}]}
            else:
                event = {"id": ident, "object": "text_completion", "created": created, "model": self.model_name,
                         "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}]}
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        try:
            if chat:
                event = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            async for token in tokens:
                delta = text.add(token)
                if delta:
                    await send(delta, None)
                if text.stopped:
                    break
            tail = text.finish()
            if tail:
                await send(tail, None)
            await send(None, "stop" if text.stopped else outcome.finish_reason)
        except (GenerationFailed, ConfigError) as error:
            failure = ApiError(503, f"the swarm could not complete this request: {error}", kind="server_error")
            await response.write(b"data: " + json.dumps(failure.body()).encode() + b"\n\n")
        finally:
            await tokens.aclose()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    def _usage(outcome: Generation) -> dict:
        return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": len(outcome.tokens),
                "total_tokens": outcome.prompt_tokens + len(outcome.tokens)}
