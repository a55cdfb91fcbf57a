"""The OpenAI-compatible API (node/inference/openai_api.py) driven by the official `openai` client,
in front of real stage workers over loopback gRPC (one event loop, no DHT); and its text handling.

Greedy completions equal the same model generating in one process (bytes decoded as text);
streamed deltas add up to the same text; chat renders the plain template and stops at the next
turn; concurrent requests each get their own answer; errors come in OpenAI's shape, naming the field.
With an API key file, a wrong or missing key is the client's AuthenticationError and the right one
is served; completions over the per-key or the server's limit are its RateLimitError, with Retry-After.
"""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import openai
import pytest

from agora.node.inference.discovery import StaticReplicas
from agora.node.inference.api_keys import load_api_keys
from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
from agora.node.inference.openai_api import OpenAIServer
from agora.node.inference.options import ServeOptions
from agora.node.inference.routing import ReplicaView
from agora.node.inference.text import TextStream, render_chat, ChatMessage
from agora.node.rpc.server import run
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS
from agora.pipeline.inference import LocalGenerator
from agora.pipeline.stages import build_stage
from agora.pipeline.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(120)

CONFIG = PRESETS["tiny"].with_stages(2)
RUN = "api-run"
MODEL = "agora-tiny"
BYTES = ByteTokenizer()


def local_text(prompt: str, max_new: int) -> str:
    local = LocalGenerator([build_stage(CONFIG.model, i) for i in range(2)])
    return BYTES.decode(local.generate(list(prompt.encode()), max_new, stop_ids=(BYTES.eos_id,)))


KEYS = ["alice-3f9c0a7e5b1d4c2a", "bob-8e6f0b9d7c5a3e1f", "carol-0d5c2b9a8f7e6d1c"]


def with_api(body, *, keys=None, options=ServeOptions(), api_key="unused"):
    """Two workers, a generator and the HTTP API on 127.0.0.1:0; `body(client, server, workers)` on
    the loop (`client` sends `api_key`)."""
    async def main():
        workers = [StageWorker(CONFIG, i, run_id=RUN) for i in range(2)]
        for worker in workers:
            await worker.start()
        views = [ReplicaView(f"p{i}", w.address, i, w.phase) for i, w in enumerate(workers)]
        try:
            async with SwarmGenerator(CONFIG, StaticReplicas(views), GeneratorOptions(run_id=RUN)) as generator:
                server = OpenAIServer(generator, BYTES, model_name=MODEL, keys=keys, options=options)
                url = await server.start("127.0.0.1", 0)
                client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0)
                try:
                    return await body(client, server, workers)
                finally:
                    await client.close()
                    await server.stop()
        finally:
            for worker in workers:
                await worker.stop(0)
    return run(main())


def test_completions_streamed_or_not_equal_one_process_and_models_lists_the_model():
    async def body(client, server, workers):
        models = await client.models.list()
        whole = await client.completions.create(model=MODEL, prompt="import os\n", max_tokens=20, temperature=0)
        parts = []
        async for chunk in await client.completions.create(model=MODEL, prompt="import os\n", max_tokens=20,
                                                            temperature=0, stream=True):
            parts.append(chunk.choices[0])
        return models, whole, parts

    models, whole, parts = with_api(body)
    assert [m.id for m in models.data] == [MODEL]
    expected = local_text("import os\n", 20)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len("import os\n") and whole.usage.completion_tokens == 20
    assert "".join(p.text for p in parts) == expected
    assert parts[-1].finish_reason == "length" and all(p.finish_reason is None for p in parts[:-1])


def test_chat_concurrency_and_stop_strings():
    prompts = ["def f(x):\n", "class A:\n", "# comment\n", "for i in "]

    async def body(client, server, workers):
        answers = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=p, max_tokens=12,
                                                                   temperature=0) for p in prompts])
        chat = await client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                    messages=[{"role": "user", "content": "hello"}])
        streamed = []
        async for chunk in await client.chat.completions.create(
                model=MODEL, max_tokens=8, temperature=0, stream=True,
                messages=[{"role": "user", "content": "hello"}]):
            streamed.append(chunk.choices[0].delta.content or "")
        free = (await client.completions.create(model=MODEL, prompt="x = ", max_tokens=12, temperature=0)).choices[0]
        stopped = (await client.completions.create(model=MODEL, prompt="x = ", max_tokens=12, temperature=0,
                                                   stop=[free.text[3:5]])).choices[0]
        return answers, chat, "".join(streamed), free, stopped, server.generator.stats

    answers, chat, streamed, free, stopped, stats = with_api(body)
    assert [a.choices[0].text for a in answers] == [local_text(p, 12) for p in prompts]
    reply = local_text(render_chat([ChatMessage("user", "hello")]), 8)
    for role in ("\nuser:", "\nassistant:", "\nsystem:"):
        reply = reply.split(role)[0]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == reply
    assert streamed == reply
    assert stopped.text == free.text[:3] and stopped.finish_reason == "stop"
    assert stats.sessions == 8 and stats.retries == 0


def test_errors_come_in_openais_shape_naming_the_field():
    async def body(client, server, workers):
        errors = {}
        for name, call in {
            "model": lambda: client.completions.create(model="gpt-4", prompt="a", max_tokens=1),
            "temperature": lambda: client.completions.create(model=MODEL, prompt="a", temperature=5.0),
            "prompt": lambda: client.completions.create(model=MODEL, prompt="", max_tokens=1),
            "length": lambda: client.completions.create(model=MODEL, prompt="a" * 300, max_tokens=1),
            "messages": lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "robot",
                                                                                        "content": "hi"}]),
            "n": lambda: client.completions.create(model=MODEL, prompt="a", n=0),
            "logprobs": lambda: client.completions.create(model=MODEL, prompt="a", logprobs=21),
            "ids": lambda: client.completions.create(model=MODEL, prompt=[[1, 2], [3, 256]]),
            "top_logprobs": lambda: client.chat.completions.create(model=MODEL, top_logprobs=2, messages=[
                {"role": "user", "content": "hi"}]),
        }.items():
            try:
                await call()
            except openai.APIStatusError as error:
                errors[name] = (error.status_code, error.body)
        return errors

    errors = with_api(body)
    status, error = errors["model"]
    assert status == 404 and error["code"] == "model_not_found" and "gpt-4" in error["message"]
    assert errors["temperature"][0] == 400 and errors["temperature"][1]["param"] == "temperature"
    assert errors["prompt"][1]["param"] == "prompt" and errors["prompt"][1]["type"] == "invalid_request_error"
    assert errors["length"][1]["code"] == "context_length_exceeded"
    assert errors["messages"][1]["param"] == "messages[0]"
    assert errors["n"][1]["param"] == "n" and errors["logprobs"][1]["param"] == "logprobs"
    assert errors["ids"][0] == 400 and "prompt[1]" in errors["ids"][1]["message"]
    assert errors["top_logprobs"][1]["param"] == "top_logprobs"


def local_scores(prompt: bytes, top_k: int):
    return LocalGenerator([build_stage(CONFIG.model, i) for i in range(2)]).score(list(prompt), top_k)


def test_echo_logprobs_and_prompt_lists_score_as_one_process_does():
    """What lm-eval's local-completions sends: token ids, a list of prompts, echo, logprobs; and
    max_tokens 0 (score only), n, chat logprobs, the tokenizer endpoints."""
    prompts = [b"def f(x):\n", b"import os", b"ab"]

    async def body(client, server, workers):
        scored = await client.completions.create(model=MODEL, prompt=[list(p) for p in prompts], max_tokens=0,
                                                 echo=True, logprobs=2, temperature=0)
        generated = await client.completions.create(model=MODEL, prompt=[p.decode() for p in prompts[:2]],
                                                    max_tokens=3, echo=True, logprobs=1, temperature=0, n=2)
        plain = await client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, logprobs=0,
                                                temperature=0)
        chat = await client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, logprobs=True,
                                                    top_logprobs=2, messages=[{"role": "user", "content": "hi"}])
        async with aiohttp.ClientSession() as http:
            root = server.url.removesuffix("/v1")
            info = await (await http.get(root + "/tokenizer_info")).json()
            tokens = await (await http.post(root + "/tokenize", json={"prompt": "hé"})).json()
            text = await (await http.post(root + "/detokenize", json={"tokens": tokens["tokens"]})).json()
        return scored, generated, plain, chat, (info, tokens, text), server.generator.stats

    scored, generated, plain, chat, (info, tokens, text), stats = with_api(body)
    assert [c.index for c in scored.choices] == [0, 1, 2] and scored.usage.completion_tokens == 0
    for prompt, choice in zip(prompts, scored.choices):
        local = local_scores(prompt, 2)
        logprobs = choice.logprobs
        assert choice.text == prompt.decode() and choice.finish_reason == "length"
        assert logprobs.tokens == [chr(b) for b in prompt] and logprobs.text_offset == list(range(len(prompt)))
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(local.token_logprobs[0, :-1].tolist(), abs=1e-4)
        for position, top in enumerate(logprobs.top_logprobs[1:]):
            likeliest = {BYTES.decode([i]) for i in local.top_ids[0, position].tolist()}
            assert set(top) >= likeliest and len(top) <= 3  # the two likeliest, and the token when it is not one
    assert stats.scored_prompts == 3  # one batch: max_tokens 0 never decodes
    assert [c.index for c in generated.choices] == [0, 1, 2, 3]
    first, again = generated.choices[:2]
    expected = local_text(prompts[0].decode(), 3)
    assert first.text == prompts[0].decode() + expected and again.text == first.text
    assert len(first.logprobs.tokens) == len(prompts[0]) + 3
    assert first.logprobs.token_logprobs[1:len(prompts[0])] == pytest.approx(
        local_scores(prompts[0], 1).token_logprobs[0, :-1].tolist(), abs=1e-4)
    drawn = LocalGenerator([build_stage(CONFIG.model, i) for i in range(2)]).generate(list(prompts[0]), 3)
    whole = local_scores(prompts[0] + bytes(drawn), 1)
    assert first.logprobs.token_logprobs[len(prompts[0]):] == pytest.approx(
        whole.token_logprobs[0, len(prompts[0]) - 1:-1].tolist(), abs=1e-4)
    assert plain.choices[0].logprobs.text_offset[0] == len("x = ") and len(plain.choices[0].logprobs.tokens) == 4
    assert all(len(top) == 1 for top in plain.choices[0].logprobs.top_logprobs)  # greedy: the token is the top
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert info["eos_token"] == "\x00" and tokens["tokens"] == list("hé".encode()) and text["prompt"] == "hé"


def test_streamed_choices_carry_their_index_echo_and_logprobs():
    async def body(client, server, workers):
        chunks = []
        async for chunk in await client.completions.create(model=MODEL, prompt=["ab", "cd"], max_tokens=5, echo=True,
                                                            logprobs=1, temperature=0, stream=True):
            chunks.append(chunk.choices[0])
        return chunks

    chunks = with_api(body)
    for index, prompt in enumerate(["ab", "cd"]):
        mine = [c for c in chunks if c.index == index]
        assert "".join(c.text for c in mine) == prompt + local_text(prompt, 5)
        assert sum(len(c.logprobs.tokens) for c in mine if c.logprobs) == len(prompt) + 5
        assert mine[-1].finish_reason == "length"


def test_text_stream_holds_back_cut_characters_and_stop_prefixes():
    stream = TextStream(BYTES, stop=["END"])
    out = [stream.add(b) for b in "é".encode()]  # two bytes: nothing until the character is whole
    assert out == ["", "é"]
    assert "".join(stream.add(b) for b in b"abEN") == "ab"
    assert stream.add(ord("D")) == "" and stream.stopped and stream.text == "éab"
    assert stream.add(ord("z")) == "" and stream.finish() == ""
    free = TextStream(BYTES, stop=["END"])
    assert "".join(free.add(b) for b in b"xEN") == "x" and free.finish() == "EN"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# the team's keys\n\n" + "\n".join(f"{key}   # {key.split('-')[0]}" for key in KEYS) + "\n")
    path.chmod(0o600)
    return load_api_keys(path)


def test_a_wrong_or_missing_key_is_refused_and_a_listed_one_is_served(key_file):
    async def body(client, server, workers):
        with pytest.raises(openai.AuthenticationError) as wrong:
            await client.completions.create(model=MODEL, prompt="import os\n", max_tokens=4, temperature=0)
        async with aiohttp.ClientSession() as session:  # no Authorization header at all
            async with session.get(str(client.base_url) + "models") as missing:
                missing_reply = (missing.status, missing.headers.get("WWW-Authenticate"), await missing.json())
        right = client.with_options(api_key=KEYS[1])
        served = await right.completions.create(model=MODEL, prompt="import os\n", max_tokens=12, temperature=0)
        models = await right.models.list()
        return wrong.value, missing_reply, served, models, dict(server.refused)

    wrong, (status, challenge, missing), served, models, refused = with_api(body, keys=key_file,
                                                                           api_key="not-" + KEYS[0])
    assert wrong.status_code == 401 and wrong.body["code"] == "invalid_api_key"
    assert wrong.body["type"] == "invalid_request_error" and "Incorrect API key" in wrong.body["message"]
    assert status == 401 and challenge.startswith("Bearer")
    assert missing["error"]["code"] == "invalid_api_key" and "No API key" in missing["error"]["message"]
    assert served.choices[0].text == local_text("import os\n", 12) and [m.id for m in models.data] == [MODEL]
    assert refused == {"invalid_api_key": 1, "missing_api_key": 1}


def test_completions_over_the_key_or_the_server_limit_are_rate_limited_with_retry_after(key_file):
    """One completion per key, two at once in all: with the first stage's compute thread held,
    alice's completion and bob's are in flight; alice's second is over her key's limit, carol's
    first over the server's. Both are 429s the client raises as RateLimitError; once the two
    finish, carol is served."""
    release = threading.Event()

    async def body(client, server, workers):
        as_key = [client.with_options(api_key=key) for key in KEYS]
        held = asyncio.ensure_future(workers[0].on_compute(lambda _: release.wait(30)))

        def complete(who: int):
            return asyncio.ensure_future(as_key[who].completions.create(model=MODEL, prompt="def f(x):\n",
                                                                        max_tokens=8, temperature=0))

        async def in_flight(count: int) -> None:  # readiness: the server admitted them
            for _ in range(2000):
                if server.in_flight.in_use == count:
                    return
                await asyncio.sleep(0.005)
            raise AssertionError(f"{server.in_flight.in_use} completions in flight, expected {count}")

        refusals = []
        try:
            alice = complete(0)
            await in_flight(1)
            for who in (0, 2):
                if who == 2:
                    bob = complete(1)
                    await in_flight(2)
                with pytest.raises(openai.RateLimitError) as limited:
                    await complete(who)
                refusals.append(limited.value)
        finally:
            release.set()
            await held
        answers = [(await alice).choices[0].text, (await bob).choices[0].text]
        carol = (await complete(2)).choices[0].text
        return refusals, answers, carol, dict(server.refused), server.in_flight.in_use

    (own, full), answers, carol, refused, left = with_api(
        body, keys=key_file, options=ServeOptions(max_concurrent_requests=2, max_requests_per_key=1))
    for error in (own, full):
        assert error.status_code == 429 and error.response.headers["Retry-After"] == "1"
        assert error.body["code"] == "rate_limit_exceeded" and error.body["type"] == "requests"
    assert "this API key" in own.body["message"] and "serve.max_requests_per_key" in own.body["message"]
    assert "this server" in full.body["message"] and "serve.max_concurrent_requests" in full.body["message"]
    assert answers == [local_text("def f(x):\n", 8)] * 2 and carol == answers[0]
    assert refused == {"rate_limit_exceeded": 2} and left == 0
