"""Scoring throughput (what an lm-eval loglikelihood task costs): the swarm against one process and transformers.

A real serving swarm on loopback (`agora-node bootstrap`, one serve-only `join` per stage, `serve`:
bench/inference.py's `Swarm`) scores the same prompts, as token ids, through `/v1/completions`:

1. `max_tokens: 0, echo, logprobs: 1`, `--batch` prompts per request: each request's prompts go
   through the swarm as batched Prefills (rows of the run's microbatch size), no decode;
2. `max_tokens: 1, echo, logprobs: 1` (the request lm-eval's `local-completions` sends for a
   loglikelihood): a generation of one token per prompt, one Prefill each;

against the same checkpoint scored in this process, one prompt at a time
(`LocalGenerator.score`), and transformers on its `export-hf` model, `--batch` prompts per
right-padded forward with log-softmax. Reported: prompts/s and prompt tokens/s, each / one process,
and the largest difference of a token's log-probability from one process's (the swarm's answers).

    python bench/scoring.py --config tiny --stages 2 --prompts 64 --prompt-tokens 64 --batch 8

Writes bench/results/scoring_<preset>.md. On a 2-core machine every process of the swarm shares
the same cores; one process and transformers run with one thread, as each swarm process does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from agora.bench.inference import PROMPTS, Swarm, checkpoint_models, served_checkpoint
from agora.pipeline.config import load_config
from agora.pipeline.inference import LocalGenerator


def prompts_of(count: int, tokens: int) -> list[list[int]]:
    """`count` byte-token prompts of `tokens` ids each, cut from the bench's code snippets."""
    text = "".join(PROMPTS) * (tokens // 16 + 2)
    return [list(text[index:index + tokens * 2].encode())[:tokens] for index in range(count)]


async def swarm_scores(url: str, model: str, prompts: list[list[int]], batch: int,
                       max_tokens: int) -> tuple[float, list[list[float]]]:
    """Wall seconds to score every prompt through the server, and each prompt's token log-probabilities."""
    scores: list[list[float]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        started = time.perf_counter()
        for start in range(0, len(prompts), batch):
            body = {"model": model, "prompt": prompts[start:start + batch], "max_tokens": max_tokens, "echo": True,
                    "logprobs": 1, "temperature": 0}
            async with session.post(f"{url}/completions", json=body) as reply:
                data = await reply.json()
                if reply.status != 200:
                    raise RuntimeError(f"request failed: {reply.status} {data}")
            for choice, prompt in zip(data["choices"], prompts[start:start + batch]):
                scores.append(choice["logprobs"]["token_logprobs"][1:len(prompt)])
        return time.perf_counter() - started, scores


def local_scores(stages, prompts: list[list[int]]) -> tuple[float, list[list[float]]]:
    generator = LocalGenerator(stages)
    generator.score(prompts[0])  # warm-up
    started = time.perf_counter()
    scores = [generator.score(prompt).token_logprobs[0, :-1].tolist() for prompt in prompts]
    return time.perf_counter() - started, scores


def transformers_seconds(model, prompts: list[list[int]], batch: int) -> float:
    """Wall seconds of right-padded batched forwards and log-softmax over every prompt."""
    def forward(group: list[list[int]]) -> None:
        width = max(map(len, group))
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(group):
            ids[row, :len(prompt)], mask[row, :len(prompt)] = torch.tensor(prompt), 1
        torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)

    with torch.no_grad():
        forward(prompts[:batch])  # warm-up
        started = time.perf_counter()
        for start in range(0, len(prompts), batch):
            forward(prompts[start:start + batch])
    return time.perf_counter() - started


def largest_difference(left: list[list[float]], right: list[list[float]]) -> float:
    return max(abs(a - b) for x, y in zip(left, right) for a, b in zip(x, y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--train-steps", type=int, default=20, help="train-local steps for the served checkpoint")
    parser.add_argument("--checkpoint", default=None, help="serve this checkpoint instead of training one")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="prompts per request (and per transformers forward)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as every process of the swarm (`--threads 1`): the same cores, compared fairly
    work = Path(tempfile.mkdtemp(prefix="agora-bench-scoring-"))
    checkpoint = served_checkpoint(args, work)
    model = f"agora-{load_config(str(checkpoint)).name}"  # what `serve` calls it
    prompts = prompts_of(args.prompts, args.prompt_tokens)
    stages, hf = checkpoint_models(checkpoint, args.stages)
    local_s, local = local_scores(stages, prompts)
    rows = {"one process, one prompt at a time (LocalGenerator.score)": (local_s, 0.0),
            f"transformers on export-hf, {args.batch} per forward": (transformers_seconds(hf, prompts, args.batch),
                                                                      None)}
    swarm = Swarm(work / "swarm", checkpoint, args.stages, 1)
    try:
        asyncio.run(swarm_scores(swarm.url, model, prompts[:args.batch], args.batch, 0))  # warm-up
        for max_tokens, name in ((0, f"swarm, max_tokens 0, {args.batch} prompts per request (batched Prefills)"),
                                 (1, f"swarm, max_tokens 1 (lm-eval's request), {args.batch} prompts per request")):
            seconds, scores = asyncio.run(swarm_scores(swarm.url, model, prompts, args.batch, max_tokens))
            rows[name] = (seconds, largest_difference(scores, local))
    finally:
        swarm.close()
    tokens = sum(map(len, prompts))
    lines = [f"# Scoring throughput: {args.config}, {args.stages} stages, {args.prompts} prompts of "
             f"{args.prompt_tokens} tokens", "",
             f"Machine: {platform.machine()}, {platform.system()}, Python {platform.python_version()}, "
             f"{os.cpu_count()} cores shared by every process of the swarm; loopback; one torch thread each. "
             f"Served checkpoint: {'given' if args.checkpoint else f'train-local {args.train_steps} steps'}.", "",
             "| where | prompts/s | tokens/s | / one process | largest logprob difference from one process |",
             "|---|---:|---:|---:|---:|"]
    for name, (seconds, difference) in rows.items():
        shown = "-" if difference is None else f"{difference:.1e}"
        lines.append(f"| {name} | {len(prompts) / seconds:.1f} | {tokens / seconds:,.0f} | "
                     f"{local_s / seconds:.2f} | {shown} |")
    out = Path(args.out or Path(__file__).parent / "results" / f"scoring_{args.config}.md")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
