"""The trainer's CPU per microbatch as a relay: frames passed on as they came, or copied at every hop.

A trainer only relays: each stage's output frame goes to the next stage as it is. Until this
bench's fix, `StageClient` went through the generated protobuf classes (the frame copied into a
message and serialized out of it, parsed into another and copied out as `bytes`) and decoded every
reply into a float32 tensor to validate it (another copy and a pass) that nobody used. Now
Forward and Backward are encoded and parsed by protos/stage_relay_adapter.py (a frame arrives as a
view of what grpc received and leaves in one join) and checked in place (`WireCodec.check`). Both
clients exist (`StageClient(relay=False)` is the former) and are measured side by side in one run,
alternating.

The workers are canned (a child process serving `agora.v1.Stage` with fixed, valid frames of the
geometry and no compute), so this process's CPU time (`time.process_time`, every thread) is the
client side alone: the codec, protobuf, the adapter and grpc. One microbatch at a time goes forward
through every stage and backward through all but the tail, as the trainer's route does.

    python bench/trainer_relay.py --geometry tiny pluralis-8b --microbatches 200
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from agora.node.demo.processes import ProcessGroup
from agora.pipeline.codec import WireCodec, encode_tokens
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint

__all__ = ["GEOMETRIES", "measure", "main"]

# (preset, stages, rows per microbatch): one microbatch's frames are rows x seq_len x wire_dim floats.
GEOMETRIES = {"tiny": ("tiny", 3, 2), "small": ("small", 4, 4), "pluralis-8b": ("pluralis-8b", 7, 1)}


def _config(name: str):
    preset, stages, rows = GEOMETRIES[name]
    config = PRESETS[preset]
    return (config if len(config.layer_split) == stages else config.with_stages(stages)), rows


def _frames(name: str) -> tuple[bytes, bytes]:
    config, rows = _config(name)
    shape = (rows, config.train.seq_len, config.model.wire_dim)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, shape[:2], generator=generator)
    return WireCodec("fp32", max_bytes=2**30).encode(torch.randn(shape, generator=generator)), \
        encode_tokens(tokens, config.model.vocab_size)


async def _serve(name: str, ready_file: str) -> None:
    from agora.node.rpc.interceptors import interceptor_chain
    from agora.node.rpc.server import bind, create_server
    from agora.node.rpc.auth_check import CallerCheck
    from agora.protos.stage_adapter import BackwardReply, ForwardReply, add_stage_service

    config, _ = _config(name)
    frame, _ = _frames(name)
    last = len(config.layer_split) - 1

    class Handler:
        def __init__(self, stage: int):
            self.stage = stage

        async def forward(self, request, context, admission=None):
            if self.stage == last:
                return ForwardReply(loss=1.0, input_grad=frame, step=0)
            return ForwardReply(wire=frame, step=0)

        async def backward(self, request, context, admission=None):
            return BackwardReply(input_grad=b"" if self.stage == 0 else frame, step=0)

    servers, ports = [], []
    for stage in range(last + 1):
        check = CallerCheck(fingerprint=run_fingerprint(config), credentials=None)
        server = create_server(interceptors=interceptor_chain(check), max_message_bytes=64 * 2**20)
        add_stage_service(server, Handler(stage), max_stream_bytes=2**30, chunk_bytes=2**20)
        ports.append(bind(server, "127.0.0.1", 0))
        await server.start()
        servers.append(server)
    Path(ready_file + ".tmp").write_text(" ".join(map(str, ports)) + "\n")
    Path(ready_file + ".tmp").rename(ready_file)
    await asyncio.gather(*(server.wait_for_termination() for server in servers))


async def _relay(name: str, ports: list[int], microbatches: int, relay: bool) -> float:
    """CPU seconds of this process per microbatch relayed through the canned stages."""
    from agora.node.trainer.stage_client import StageClient

    config, rows = _config(name)
    _, token_frame = _frames(name)
    fingerprint = run_fingerprint(config)
    clients = [StageClient(f"127.0.0.1:{port}", run_id="relay", stage=stage, model=config.model,
                           fingerprint=fingerprint, codec=WireCodec("fp32", max_bytes=2**30),
                           max_message_bytes=64 * 2**20, relay=relay)
               for stage, port in enumerate(ports)]
    tokens = torch.zeros(rows, config.train.seq_len, dtype=torch.long)
    try:
        async def one(index: int) -> None:
            wire = None
            result = None
            for client in clients:
                result = await client.forward(f"m{index}", tokens, wire, tokens if client is clients[-1] else None)
                wire = result.wire_frame
            grad = result.grad_frame
            for client in reversed(clients[:-1]):
                back = await client.backward(f"m{index}", grad)
                grad = back.grad_frame

        await one(-1)  # channels up, caches warm
        started = time.process_time()
        for index in range(microbatches):
            await one(index)
        return (time.process_time() - started) / microbatches
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def measure(names: list[str], microbatches: int, repeats: int = 2) -> dict:
    """Per geometry: frame bytes, and CPU ms per microbatch for each variant (mean over repeats, A B A B)."""
    from agora.node.rpc.server import run

    results = {}
    for name in names:
        work = Path(tempfile.mkdtemp(prefix="agora-relay-"))
        group = ProcessGroup(work)
        ready = work / "ready"
        server = group.spawn("canned", [sys.executable, "-m", "agora.bench.trainer_relay", "serve", "--geometry",
                                        name, "--ready-file", str(ready)], ready)
        try:
            ports = [int(p) for p in group.wait_ready([server], 60)["canned"]]
            timings: dict[str, list[float]] = {"generated classes, decoded replies": [], "relay frames": []}
            for _ in range(repeats):
                for variant in timings:
                    timings[variant].append(run(_relay(name, ports, microbatches, variant == "relay frames")))
        finally:
            group.shutdown(grace_s=2.0)
        frame, _ = _frames(name)
        config, _ = _config(name)
        results[name] = {"frame_bytes": len(frame), "stages": len(config.layer_split),
                         "calls_per_microbatch": 2 * len(config.layer_split) - 1,
                         **{variant: 1e3 * sum(t) / len(t) for variant, t in timings.items()}}
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve")
    serve.add_argument("--geometry", required=True, choices=sorted(GEOMETRIES))
    serve.add_argument("--ready-file", required=True)
    parser.add_argument("--geometry", nargs="+", default=["tiny", "pluralis-8b"], choices=sorted(GEOMETRIES))
    parser.add_argument("--microbatches", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.command == "serve":
        from agora.node.rpc.server import run

        run(_serve(args.geometry, args.ready_file))
        return
    results = measure(args.geometry, args.microbatches)
    for line in table(results):
        print(line)


def table(results: dict) -> list[str]:
    lines = ["| geometry | frame bytes | calls / microbatch | before: generated classes, decoded replies (CPU ms / "
             "microbatch) | after: relayed frames | after / before |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        before, after = r["generated classes, decoded replies"], r["relay frames"]
        lines.append(f"| {name} | {r['frame_bytes']:,} | {r['calls_per_microbatch']} | {before:.2f} | {after:.2f} | "
                     f"{after / before:.3f} |")
    return lines


if __name__ == "__main__":
    main()
