"""The OpenAI-compatible API (node/inference/openai_api.py) driven by the official `openai` client,
in front of real stage workers over loopback gRPC (one event loop, no DHT); and its text handling.

Greedy completions equal the same model generating in one process (bytes decoded as text);
streamed deltas add up to the same text; chat renders the plain template and stops at the next
turn; concurrent requests each get their own answer; errors come in OpenAI's shape, naming the field.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from agora.node.inference.discovery import StaticReplicas
from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
from agora.node.inference.openai_api import OpenAIServer
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


def with_api(body):
    """Two workers, a generator and the HTTP API on 127.0.0.1:0; `body(client, server)` on the loop."""
    async def main():
        workers = [StageWorker(CONFIG, i, run_id=RUN) for i in range(2)]
        for worker in workers:
            await worker.start()
        views = [ReplicaView(f"p{i}", w.address, i, w.phase) for i, w in enumerate(workers)]
        try:
            async with SwarmGenerator(CONFIG, StaticReplicas(views), GeneratorOptions(run_id=RUN)) as generator:
                server = OpenAIServer(generator, BYTES, model_name=MODEL)
                url = await server.start("127.0.0.1", 0)
                client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
                try:
                    return await body(client, server)
                finally:
                    await client.close()
                    await server.stop()
        finally:
            for worker in workers:
                await worker.stop(0)
    return run(main())


def test_completions_streamed_or_not_equal_one_process_and_models_lists_the_model():
    async def body(client, server):
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

    async def body(client, server):
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
    async def body(client, server):
        errors = {}
        for name, call in {
            "model": lambda: client.completions.create(model="gpt-4", prompt="a", max_tokens=1),
            "temperature": lambda: client.completions.create(model=MODEL, prompt="a", temperature=5.0),
            "prompt": lambda: client.completions.create(model=MODEL, prompt="", max_tokens=1),
            "length": lambda: client.completions.create(model=MODEL, prompt="a" * 300, max_tokens=1),
            "messages": lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "robot",
                                                                                        "content": "hi"}]),
            "n": lambda: client.completions.create(model=MODEL, prompt="a", n=2),
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
    assert errors["n"][1]["param"] == "n"


def test_text_stream_holds_back_cut_characters_and_stop_prefixes():
    stream = TextStream(BYTES, stop=["END"])
    out = [stream.add(b) for b in "é".encode()]  # two bytes: nothing until the character is whole
    assert out == ["", "é"]
    assert "".join(stream.add(b) for b in b"abEN") == "ab"
    assert stream.add(ord("D")) == "" and stream.stopped and stream.text == "éab"
    assert stream.add(ord("z")) == "" and stream.finish() == ""
    free = TextStream(BYTES, stop=["END"])
    assert "".join(free.add(b) for b in b"xEN") == "x" and free.finish() == "EN"
