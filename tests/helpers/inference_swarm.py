"""Inference tests' swarm: real stage workers on 127.0.0.1:0 and a generator over a fixed list of
them (no DHT); and a checkpoint whose weights are away from their initialisation, for the
process-level tests that serve one."""

from __future__ import annotations

from pathlib import Path

import torch

from agora.node.demo.processes import ProcessGroup, agora_node_command
from agora.node.inference.discovery import StaticReplicas
from agora.node.inference.generator import GeneratorOptions, SwarmGenerator
from agora.node.inference.routing import ReplicaView
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.checkpoint import StageState, save_checkpoint
from agora.pipeline.config import RunConfig
from agora.pipeline.stages import build_stage

__all__ = ["start_stage_workers", "generator_over", "perturbed_checkpoint", "node_command", "serving_swarm"]


async def start_stage_workers(config: RunConfig, run_id: str, replicas: dict[int, int] | None = None,
                              options: WorkerOptions = WorkerOptions()) -> list[StageWorker]:
    """`replicas[stage]` workers of each stage (default one), started, in stage order."""
    workers = []
    for stage in range(len(config.layer_split)):
        for _ in range((replicas or {}).get(stage, 1)):
            worker = StageWorker(config, stage, run_id=run_id, options=options)
            await worker.start()
            workers.append(worker)
    return workers


def generator_over(config: RunConfig, run_id: str, workers: list[StageWorker], **options) -> SwarmGenerator:
    """A generator whose roster is these workers, as peers `peer-0`, `peer-1`, ... in list order."""
    views = [ReplicaView(f"peer-{i}", w.address, w.stage_index, w.phase) for i, w in enumerate(workers)]
    return SwarmGenerator(config, StaticReplicas(views), GeneratorOptions(run_id=run_id, **options))


def perturbed_checkpoint(directory: Path, config: RunConfig, seed: int, step: int = 7):
    """Every stage's weights plus seeded noise, saved as a train-local checkpoint; (path, stages)."""
    stages = [build_stage(config.model, i) for i in range(len(config.layer_split))]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in stages:
            for parameter in stage.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    path = save_checkpoint(directory, step, config, [StageState(i, s.state_dict()) for i, s in enumerate(stages)])
    return path, stages


def node_command(*args: str) -> list[str]:
    return agora_node_command("--log-level", "INFO", "--threads", "1", *args)


def serving_swarm(group: ProcessGroup, workdir: Path, checkpoint: Path, run_id: str,
                  replicas: list[tuple[int, int]]) -> tuple[str, list, dict[str, str]]:
    """`agora-node` processes in `group`: a bootstrap, a serve-only worker per (stage, replica) named
    `s<stage>r<replica>`, and `serve`; (the API's URL, the workers, their gRPC endpoints by name)."""
    boot = group.spawn("bootstrap", node_command("bootstrap", "--insecure", "--ready-file", str(workdir / "boot.ready")),
                       workdir / "boot.ready")
    peers = group.wait_ready([boot], 60)["bootstrap"]
    swarm = ["--run-id", run_id, "--initial-peers", *peers, "--insecure"]
    workers = []
    for stage, replica in replicas:
        name = f"s{stage}r{replica}"
        workers.append(group.spawn(name, node_command("join", "--serve-only", "--checkpoint", str(checkpoint),
                                                      "--stage", str(stage), *swarm, "--heartbeat", "0.5",
                                                      "--ready-file", str(workdir / f"{name}.ready")),
                                   workdir / f"{name}.ready"))
    endpoints = {name: lines[0] for name, lines in group.wait_ready(workers, 120).items()}
    serve = group.spawn("serve", node_command("serve", "--checkpoint", str(checkpoint), *swarm, "--port", "0",
                                              "--ready-file", str(workdir / "serve.ready")), workdir / "serve.ready")
    return group.wait_ready([serve], 60)["serve"][0], workers, endpoints
