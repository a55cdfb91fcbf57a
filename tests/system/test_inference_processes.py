"""Inference through a real swarm: `agora-node` processes (bootstrap, serve-only workers, serve)
over hivemind's DHT and gRPC on loopback, driven by the official `openai` client.

- Greedy completions through the swarm equal the same checkpoint generating in one process, token
  for token; so does a streamed one during which the body replica serving it is killed with
  SIGKILL (two replicas of that stage): the session moves to the other replica, is replayed there,
  and the text is unchanged; the server's counters show the failover.
- `demo --serve` comes up with admission on (an authorizer; workers and the API admitted, the API
  as a `client`, every call over mutual TLS), answers a chat completion equal to one process's,
  and stops cleanly on Ctrl-C (exit 0).

Readiness is every process's ready file (never a sleep); children run one torch thread and are
reaped by the ProcessGroup whatever happens.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import openai
import pytest

from agora.node.demo.processes import ProcessGroup
from agora.node.inference.text import ChatMessage, chat_stop_strings, render_chat
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import StageClient
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.pipeline.inference import LocalGenerator
from agora.pipeline.tokenizer import ByteTokenizer
from inference_swarm import perturbed_checkpoint, serving_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CONFIG = PRESETS["tiny"].with_stages(2)
MODEL = "agora-tiny"
BYTES = ByteTokenizer()
PROMPT = "def parse(text):\n    "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Stage weights away from their initialisation (so the text is not the init's), saved as a
    train-local checkpoint would be."""
    return perturbed_checkpoint(tmp_path_factory.mktemp("ckpt"), CONFIG, seed=9)


def _local(stages, prompt: str, max_new: int) -> str:
    return BYTES.decode(LocalGenerator(stages).generate(list(prompt.encode()), max_new, stop_ids=(0,)))


def _sessions(endpoint: str) -> int:
    async def info():
        client = StageClient(endpoint, run_id="serve-test", stage=1, model=CONFIG.model,
                             fingerprint=run_fingerprint(CONFIG))
        try:
            return (await client.info(timeout_s=10)).sessions
        finally:
            await client.close()
    return run(info())


def test_completions_through_the_swarm_equal_one_process_even_when_a_replica_is_killed(checkpoint, tmp_path):
    path, stages = checkpoint
    group = ProcessGroup(tmp_path)
    try:
        url, workers, endpoints = serving_swarm(group, tmp_path, path, "serve-test", [(0, 0), (1, 0), (1, 1)])
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)

        whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
        pieces = []
        victim = None
        # Long enough that the session is still open when its first text arrives (the server does not
        # wait for the reader), then kill -9 the body replica it runs on.
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0,
                                               stream=True):
            pieces.append(chunk.choices[0].text)
            if victim is None and "".join(pieces):
                holders = [w for w in workers if w.name.startswith("s1") and _sessions(endpoints[w.name]) == 1]
                assert len(holders) == 1, "the generation ended before a replica could be killed"
                victim = holders[0]
                group.kill(victim)
        with urllib.request.urlopen(f"{url}/agora/stats", timeout=10) as reply:
            stats = json.loads(reply.read())
    finally:
        group.shutdown()
    assert whole == _local(stages, PROMPT, 24)
    assert victim is not None
    assert "".join(pieces) == _local(stages, PROMPT, 200)
    assert stats["failovers"] >= 1 and stats["replays"] >= 1 and stats["retries"] >= 1


def test_demo_serve_answers_and_stops_on_ctrl_c(checkpoint, tmp_path):
    path, stages = checkpoint
    workdir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "agora.node", "demo", "--serve", "--checkpoint", str(path),
                             "--stages", "2", "--http-port", "0", "--heartbeat", "0.5",
                             "--workdir", str(workdir)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in demo.stdout:  # the demo prints its URL once serving: the readiness handshake
            lines.append(line)
            if "demo: serving" in line:
                break
        assert any("demo: serving" in line for line in lines), "".join(lines)
        url = (workdir / "serve.ready").read_text().split()[0]
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                               messages=[{"role": "user", "content": "hello"}]).choices[0]
        demo.send_signal(signal.SIGINT)
        code = demo.wait(60)
        rest = demo.stdout.read()
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    expected = _local(stages, render_chat([ChatMessage("user", "hello")]), 6)
    for stop in chat_stop_strings():
        expected = expected.split(stop)[0]
    assert reply.message.role == "assistant" and reply.message.content == expected
    assert code == 0 and "demo: stopping" in rest
