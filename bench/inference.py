"""Serving through the swarm, after seed 003's table: one vs two replicas per stage, and an outage.

Every phase is a real serving swarm on loopback (`agora-node bootstrap`, serve-only `join`s, `serve`)
driven over HTTP at a fixed concurrency with the same greedy requests:

1. one replica per stage;
2. two replicas per stage;
3. two replicas per stage, one replica of the middle stage killed with SIGKILL once a quarter of the
   requests have completed: every request must complete, with the same output tokens as in the
   other phases; the failed calls (retries), replays and route moves are counted by the server.

Reported per phase: requests/s, median and 95th-percentile latency, and whether every output
equals phase 1's. Then decode tokens/s of one generation (128 new tokens, greedy) through the
one-replica swarm, against the same checkpoint generating in one process (pipeline/inference.py)
and against transformers' `generate` on its `export-hf` model: the cost of the hops.

    python bench/inference.py --config tiny --stages 3 --requests 32 --concurrency 4 --max-tokens 32

Writes bench/results/inference_<preset>.md. On this 2-core machine every process of the swarm
shares the same cores, so two replicas add capacity only where one replica's stage waits on
another process.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from agora.node.demo.processes import ProcessGroup, agora_node_command
from agora.pipeline.checkpoint import load_checkpoint
from agora.pipeline.config import load_config
from agora.pipeline.inference import LocalGenerator
from agora.pipeline.interop import to_transformers
from agora.pipeline.stages import assemble_model, build_stage

PROMPTS = ["def main():\n    ", "import os\nimport sys\n", "class Parser:\n    def ", "for index in range(",
           "    return self.", "# Licensed under the", "if __name__ == ", "try:\n    value = "]


def _node(*args: str) -> list[str]:
    return agora_node_command("--log-level", "WARNING", "--threads", "1", *args)


class Swarm:
    """bootstrap + `replicas` serve-only workers per stage + serve, as processes in `workdir`."""

    def __init__(self, workdir: Path, checkpoint: Path, stages: int, replicas: int):
        workdir.mkdir(parents=True, exist_ok=True)
        self.group = ProcessGroup(workdir)
        boot = self.group.spawn("bootstrap", _node("bootstrap", "--insecure", "--ready-file",
                                                   str(workdir / "boot.ready")), workdir / "boot.ready")
        peers = self.group.wait_ready([boot], 120)["bootstrap"]
        run = ["--config", str(checkpoint), "--stages", str(stages), "--run-id", "bench", "--initial-peers", *peers,
               "--insecure"]
        self.workers = {}
        for stage in range(stages):
            for replica in range(replicas):
                name = f"s{stage}r{replica}"
                self.workers[name] = self.group.spawn(name, _node(
                    "join", "--serve-only", "--checkpoint", str(checkpoint), "--stage", str(stage), *run,
                    "--heartbeat", "1", "--ready-file", str(workdir / f"{name}.ready")), workdir / f"{name}.ready")
        self.group.wait_ready(list(self.workers.values()), 180)
        serve = self.group.spawn("serve", _node("serve", *run, "--port", "0", "--ready-file",
                                                str(workdir / "serve.ready")), workdir / "serve.ready")
        self.url = self.group.wait_ready([serve], 120)["serve"][0]

    def kill(self, name: str) -> None:
        self.group.kill(self.workers[name])

    def close(self) -> None:
        self.group.shutdown()


async def _complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    async with session.post(f"{url}/completions", json=body) as reply:
        data = await reply.json()
        if reply.status != 200:
            raise RuntimeError(f"request failed: {reply.status} {data}")
        return data


async def load(url: str, model: str, requests: int, concurrency: int, max_tokens: int,
               on_progress=None) -> tuple[list[float], list[str], float]:
    """`requests` completions, `concurrency` at a time: latencies, texts in request order, wall seconds."""
    queue = list(range(requests))
    latencies: list[float] = [0.0] * requests
    texts: list[str] = [""] * requests
    done = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            nonlocal done
            while queue:
                index = queue.pop(0)
                started = time.perf_counter()
                data = await _complete(session, url, model, PROMPTS[index % len(PROMPTS)], max_tokens)
                latencies[index] = time.perf_counter() - started
                texts[index] = data["choices"][0]["text"]
                done += 1
                if on_progress is not None:
                    on_progress(done)

        started = time.perf_counter()
        await asyncio.gather(*[client() for _ in range(concurrency)])
        return latencies, texts, time.perf_counter() - started


async def stats(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/agora/stats") as reply:
            return await reply.json()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def checkpoint_models(checkpoint: Path, stages: int):
    """The checkpoint as `stages` stages (re-split by global names) and as its transformers export."""
    _, config, states, _ = load_checkpoint(checkpoint)
    config = config.with_stages(stages)
    merged = {k: v for s in states for k, v in s.model.items()}
    built = []
    for index in range(stages):
        stage = build_stage(config.model, index)
        stage.load_state_dict({k: merged[k] for k in stage.state_dict()})
        built.append(stage)
    return built, to_transformers(assemble_model(config.model, [s.model for s in states]))


def served_checkpoint(args: argparse.Namespace, work: Path) -> Path:
    """`--checkpoint`, or a train-local run of `--train-steps` steps of `--config` in `work`."""
    if args.checkpoint:
        return Path(args.checkpoint)
    checkpoint = work / "ckpt"
    subprocess.run([sys.executable, "-m", "agora.node", "--log-level", "WARNING", "--threads", "1",
                    "train-local", "--config", args.config, "--stages", str(args.stages), "--steps",
                    str(args.train_steps), "--checkpoint-dir", str(checkpoint)], check=True, stdout=subprocess.DEVNULL)
    return checkpoint


def decode_rates(checkpoint: Path, stages: int, url: str, model: str, new_tokens: int) -> dict[str, float]:
    """Tokens/s of one greedy generation: through the swarm, in one process, with transformers."""
    local_stages, hf = checkpoint_models(checkpoint, stages)
    prompt = list(PROMPTS[0].encode())
    rates = {}
    generator = LocalGenerator(local_stages)
    generator.generate(prompt, 8)  # warm-up
    started = time.perf_counter()
    local = generator.generate(prompt, new_tokens)
    rates["one process (pipeline/inference.py)"] = len(local) / (time.perf_counter() - started)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        started = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    rates["transformers generate (export-hf)"] = (out.shape[1] - ids.shape[1]) / (time.perf_counter() - started)

    async def swarm_rate() -> float:
        async with aiohttp.ClientSession() as session:
            await _complete(session, url, model, PROMPTS[0], 8)
            started = time.perf_counter()
            data = await _complete(session, url, model, PROMPTS[0], new_tokens)
            return data["usage"]["completion_tokens"] / (time.perf_counter() - started)
    rates[f"swarm ({stages} stages, gRPC over loopback)"] = asyncio.run(swarm_rate())
    rates["same tokens"] = bool(local == out[0, ids.shape[1]:].tolist())
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=60, help="train-local steps for the served checkpoint")
    parser.add_argument("--checkpoint", default=None, help="serve this checkpoint instead of training one")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as every process of the swarm (`--threads 1`): the same cores, compared fairly
    work = Path(tempfile.mkdtemp(prefix="agora-bench-inference-"))
    checkpoint = served_checkpoint(args, work)
    model = f"agora-{load_config(str(checkpoint)).name}"  # what `serve` calls it
    rows, outputs, rates = [], {}, {}
    for phase, replicas, outage in (("1 replica per stage", 1, False), ("2 replicas per stage", 2, False),
                                    ("2 replicas, one killed", 2, True)):
        swarm = Swarm(work / f"phase-{len(rows)}", checkpoint, args.stages, replicas)
        try:
            before = asyncio.run(stats(swarm.url))
            victim = f"s{args.stages // 2}r0"
            killed = []

            def progress(done: int) -> None:
                if outage and not killed and done >= args.requests // 4:
                    swarm.kill(victim)
                    killed.append(victim)

            latencies, texts, wall = asyncio.run(load(swarm.url, model, args.requests, args.concurrency,
                                                      args.max_tokens, progress))
            after = asyncio.run(stats(swarm.url))
            if replicas == 1:
                rates = decode_rates(checkpoint, args.stages, swarm.url, model, args.decode_tokens)
        finally:
            swarm.close()
        outputs[phase] = texts
        counters = {k: after[k] - before[k] for k in ("retries", "replays", "failovers")}
        rows.append((phase, len(texts), args.requests / wall, statistics.median(latencies),
                     percentile(latencies, 0.95), texts == outputs["1 replica per stage"], counters, killed))
        print(f"{phase}: {args.requests / wall:.2f} requests/s, median {statistics.median(latencies):.2f} s, "
              f"p95 {percentile(latencies, 0.95):.2f} s, {counters}", flush=True)
    base = rows[0][2]
    lines = [
        f"# Serving through the swarm: {args.config}, {args.stages} stages, greedy completions of "
        f"{args.max_tokens} tokens, {args.requests} requests at concurrency {args.concurrency}", "",
        f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}, "
        f"{os.cpu_count()} cores shared by every process of the swarm; loopback. Served checkpoint: "
        f"{'given' if args.checkpoint else f'train-local {args.train_steps} steps'}.", "",
        "| phase | completed | requests/s | x 1 replica | median latency s | p95 latency s | same tokens as phase 1 "
        "| retries | replays | route moves | killed |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for phase, completed, rps, median, p95, same, counters, killed in rows:
        lines.append(f"| {phase} | {completed}/{args.requests} | {rps:.2f} | {rps / base:.2f} | {median:.2f} | "
                     f"{p95:.2f} | {'yes' if same else 'NO'} | {counters['retries']} | {counters['replays']} | "
                     f"{counters['failovers']} | {', '.join(killed) or '-'} |")
    swarm_rate = next(v for k, v in rates.items() if k.startswith("swarm"))
    local_rate = rates["one process (pipeline/inference.py)"]
    lines += ["", f"Decode tokens/s, one greedy generation of {args.decode_tokens} tokens (prompt "
              f"{len(PROMPTS[0].encode())} tokens; in-process and transformers' tokens are the same: "
              f"{'yes' if rates['same tokens'] else 'NO'}):", "",
              "| where | tokens/s | / one process |", "|---|---:|---:|"]
    for name, rate in rates.items():
        if name != "same tokens":
            lines.append(f"| {name} | {rate:.1f} | {rate / local_rate:.2f} |")
    lines += ["", f"The swarm decodes at {swarm_rate / local_rate:.2f} of one process: every token crosses "
              f"{args.stages} gRPC round trips (k floats and one id per boundary, the logits back from the tail) "
              "and the HTTP front."]
    out = Path(args.out or Path(__file__).parent / "results" / f"inference_{args.config}.md")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
