"""The authorizer under a flood of newcomers from one network: admissions/s and renewal latency
against the same run without the flood, side by side in one run (phases alternate).

`agora-node authorizer serve` runs in a process of its own with its default limits, except that
renewals are not rate limited (so their latency is measured, not their bucket). The measured side,
in this process, joins M monitors C at a time, each from a network of its own (127.1.i.1), and
renews one credential R times in turn from another (127.2.0.1): the node's own client code
(auth/admission.py), each call through a TCP relay that dials from that source address. The flood,
a second process, calls from K addresses of 127.0.0.0/24 as fast as it is answered, ignoring
retry-after: a third ask for join challenges and walk away, a third run worker preflights (a
download read to the end), a third join with a proof that does not verify. Reported per phase:
admissions/s, renewal latency p50/p95, the flood's calls answered per second and the share refused;
then the ratios flooded / unflooded. Writes bench/results/authorizer-flood.md.

    python bench/authorizer_flood.py            # M=40, C=4, R=200, K=32, 2 repeats
    python bench/authorizer_flood.py --quick    # a smoke run: M=6, R=20, K=8, 1 repeat
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

from agora.auth.admission import CredentialRenewer, admit
from agora.auth.authorizer_tls import authorizer_channel
from agora.auth.keys import generate_key
from agora.auth.node_state import NodeCredentials, public_key_pem
from agora.dht.bootstrap import write_ready_file
from agora.node.demo.processes import ProcessGroup, agora_node_command
from agora.protos import authorizer_adapter as adapter

RESULTS = Path(__file__).parent / "results" / "authorizer-flood.md"
FLOOD_NETWORK = "127.0.0.{}"  # the flooders: 127.0.0.2 ...
JOIN_SOURCE = "127.1.{}.1"  # each measured joiner from a /24 of its own
RENEW_SOURCE = "127.2.0.1"


class SourceRelay:
    """Forwards a local port to `upstream`, dialling from `source`: the authorizer sees that caller."""

    def __init__(self, upstream: str, source: str):
        host, port = upstream.rsplit(":", 1)
        self.upstream, self.source = (host, int(port)), source
        self._server = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream, local_addr=(self.source, 0))
        except OSError:
            writer.close()
            return
        pumps = {asyncio.create_task(self._pump(reader, up_writer)), asyncio.create_task(self._pump(up_reader, writer))}
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        self._tasks.difference_update(pumps)
        up_writer.close()
        writer.close()

    @staticmethod
    async def _pump(reader, writer) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


@contextlib.asynccontextmanager
async def relays(upstream: str, sources: list[str]):
    opened = [SourceRelay(upstream, source) for source in sources]
    try:
        yield [await relay.start() for relay in opened]
    finally:
        for relay in opened:
            await relay.close()


# ---- the flood (a process of its own)

async def _flood_caller(address: str, root_pem: bytes, kind: str, stop: asyncio.Event, calls: Counter) -> None:
    key_pem = public_key_pem(generate_key())
    async with authorizer_channel(address, root_pem) as channel:
        stub = adapter.AuthorizerStub(channel)
        while not stop.is_set():
            try:
                role = "worker" if kind == "preflight" else "monitor"
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role=role), timeout=30)
                calls["OK"] += 1
                if kind == "preflight":
                    await stub.download(challenge.nonce, max_bytes=challenge.download_bytes, timeout=30)
                elif kind == "forge":
                    await stub.join(adapter.JoinRequest(nonce=challenge.nonce, public_key_pem=key_pem, role="monitor",
                                                        fingerprint="x", signature=b"forged"), timeout=30)
                if kind != "ask":
                    calls["OK"] += 1
            except grpc.aio.AioRpcError as error:
                calls[error.code().name] += 1


async def flood(address: str, root_pem: bytes, sources: int, ready: str, stats: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    calls: Counter = Counter()
    kinds = ("ask", "preflight", "forge")
    async with relays(address, [FLOOD_NETWORK.format(2 + i) for i in range(sources)]) as relayed:
        callers = [asyncio.create_task(_flood_caller(relay, root_pem, kinds[i % 3], stop, calls))
                   for i, relay in enumerate(relayed)]
        write_ready_file(ready, ["flooding"])
        started = time.monotonic()
        await stop.wait()
        elapsed = time.monotonic() - started
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
    Path(stats).write_text(json.dumps({"elapsed_s": elapsed, "calls": dict(calls)}))


# ---- the measured side

@dataclass
class Phase:
    flooded: bool
    admissions_per_s: float
    renewal_ms: list[float]
    flood: dict | None = None

    def percentile(self, q: float) -> float:
        return statistics.quantiles(self.renewal_ms, n=100, method="inclusive")[int(q) - 1]


def _run_fingerprint(config: dict) -> str:
    from agora.pipeline.config import config_from_dict
    from agora.pipeline.fingerprint import run_fingerprint

    return run_fingerprint(config_from_dict(config)).text()


async def _joins(address: str, root_fingerprint: str, nodes: list[NodeCredentials], concurrency: int) -> float:
    """Admissions per second of `nodes` (monitors: admitted without a preflight, as strangers may be), `concurrency` at a time, each from its own network."""
    async with relays(address, [JOIN_SOURCE.format(i) for i in range(len(nodes))]) as relayed:
        gate = asyncio.Semaphore(concurrency)

        async def one(node: NodeCredentials, relay: str) -> None:
            async with gate:
                await admit(relay, root_fingerprint, node, role="monitor", fingerprint=_run_fingerprint)

        started = time.monotonic()
        await asyncio.gather(*(one(node, relay) for node, relay in zip(nodes, relayed)))
        return len(nodes) / (time.monotonic() - started)


async def _renewals(address: str, node: NodeCredentials, count: int) -> list[float]:
    async with relays(address, [RENEW_SOURCE]) as (relay,):
        renewer = CredentialRenewer(relay, node, on_revoked=lambda reason: None)
        latencies = []
        for _ in range(count):
            started = time.perf_counter()
            await renewer.renew_once()
            latencies.append((time.perf_counter() - started) * 1e3)
        return latencies


def _measure(address: str, root_fingerprint: str, nodes: list[NodeCredentials], renewing: NodeCredentials,
             args: argparse.Namespace) -> tuple[float, list[float]]:
    async def both() -> tuple[float, list[float]]:
        rate = await _joins(address, root_fingerprint, nodes, args.concurrency)
        return rate, await _renewals(address, renewing, args.renewals)
    return asyncio.run(both())


def _phase(group: ProcessGroup, work: Path, address: str, root_fingerprint: str, nodes, renewing, args,
           flooded: bool, index: int) -> Phase:
    if not flooded:
        rate, renewals = _measure(address, root_fingerprint, nodes, renewing, args)
        return Phase(False, rate, renewals)
    ready, stats = work / f"flood-{index}.ready", work / f"flood-{index}.json"
    child = group.spawn(f"flood-{index}", [sys.executable, __file__, "--flood", address, "--root",
                                           str(work / "authorizer" / "root.pem"), "--sources", str(args.flooders),
                                           "--ready", str(ready), "--stats", str(stats)], ready)
    group.wait_ready([child], 60)
    time.sleep(args.warmup)  # the flood at full pressure before anything is measured
    rate, renewals = _measure(address, root_fingerprint, nodes, renewing, args)
    group.stop([child])
    return Phase(True, rate, renewals, json.loads(stats.read_text()))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _report(phases: list[Phase], args: argparse.Namespace, command: str, loads: tuple[float, float]) -> str:
    lines = [f"# The authorizer under a flood from one network: {args.joins} admissions ({args.concurrency} at a "
             f"time) and {args.renewals} renewals per phase, {args.flooders} flooders, {args.repeats} repeats",
             "", f"`{command}`; commit {_commit()}, {datetime.datetime.now():%Y-%m-%d %H:%M}; {platform.machine()}, "
             f"{os.cpu_count()} cores shared by the authorizer, the flood and the measuring client; 1-minute load "
             f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end; loopback.", "",
             *(["A smoke run (`--quick`): too few samples to quote; `python bench/authorizer_flood.py` measures.", ""]
               if args.quick else []),
             "| phase | admissions/s | renewal p50 ms | renewal p95 ms | flood calls answered/s | flood refused |",
             "|---|---:|---:|---:|---:|---:|"]
    for phase in phases:
        flood = "-", "-"
        if phase.flood is not None:
            calls = phase.flood["calls"]
            total = sum(calls.values())
            codes = ", ".join(f"{code} {count}" for code, count in sorted(calls.items()))
            flood = f"{total / phase.flood['elapsed_s']:,.0f}", f"{1 - calls.get('OK', 0) / max(total, 1):.0%} ({codes})"
        lines.append(f"| {'flooded' if phase.flooded else 'unflooded'} | {phase.admissions_per_s:.2f} | "
                     f"{phase.percentile(50):.1f} | {phase.percentile(95):.1f} | {flood[0]} | {flood[1]} |")

    def mean(flooded: bool, value) -> float:
        return statistics.mean(value(phase) for phase in phases if phase.flooded == flooded)

    ratios = {name: mean(True, value) / mean(False, value) for name, value in (
        ("admissions/s", lambda p: p.admissions_per_s), ("renewal p50", lambda p: p.percentile(50)),
        ("renewal p95", lambda p: p.percentile(95)))}
    lines += ["", "| flooded / unflooded | ratio |", "|---|---:|"]
    lines += [f"| {name} | {ratio:.3f} |" for name, ratio in ratios.items()]
    lines += ["", "Measured joiners come from networks of their own (127.1.i.0/24), the renewing node from "
                  "127.2.0.0/24, the flood from 127.0.0.0/24: the flood is held to its network's share (rate "
                  "buckets, challenges outstanding, calls in flight), so what changes with it is the CPU and the "
                  "port they share."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--joins", type=int, default=40, help="monitors admitted per phase (M)")
    parser.add_argument("--concurrency", type=int, default=4, help="admissions at a time (C)")
    parser.add_argument("--renewals", type=int, default=200, help="renewals timed per phase (R)")
    parser.add_argument("--flooders", type=int, default=32, help="flooding addresses in 127.0.0.0/24 (K)")
    parser.add_argument("--repeats", type=int, default=2, help="unflooded and flooded phases, alternating")
    parser.add_argument("--preflight-bytes", type=int, default=1 << 20, help="each flooding preflight's download")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of flood before measuring")
    parser.add_argument("--quick", action="store_true", help="a smoke run: M=6, R=20, K=8, one repeat")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--flood", default=None, help=argparse.SUPPRESS)  # the flood process: the authorizer
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sources", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ready", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stats", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flood:
        asyncio.run(flood(args.flood, Path(args.root).read_bytes(), args.sources, args.ready, args.stats))
        return
    if args.quick:
        args.joins, args.renewals, args.flooders, args.repeats, args.warmup = 6, 20, 8, 1, 1.0
        args.preflight_bytes = 256 << 10
    command = "python bench/authorizer_flood.py " + " ".join(sys.argv[1:])
    loads = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="agora-bench-flood-"))
    group = ProcessGroup(work, env={"OMP_NUM_THREADS": "1"})
    try:
        ready = work / "authorizer.ready"
        child = group.spawn("authorizer", agora_node_command(
            "--threads", "1", "--log-level", "WARNING", "authorizer", "serve", "--state-dir", str(work / "authorizer"),
            "--run-id", "flood", "--ready-file", str(ready), "--config", "tiny", "--stages", "3", "--steps", "10",
            "--min-upload-mbit", "0", "--min-download-mbit", "0", "--max-rtt-ms", "inf", "--min-accelerator-gb", "0",
            "--min-ram-gb", "0", "--preflight-bytes", str(args.preflight_bytes), "--credential-lifetime", "3600",
            "--renew-rate", "1000000", "--renew-burst", "1000000"), ready)
        address, root_fingerprint = group.wait_ready([child], 120)["authorizer"]
        nodes = [NodeCredentials(work / f"joiner-{i}", clock=time.time) for i in range(args.joins)]
        renewing = NodeCredentials(work / "renewing", clock=time.time)
        asyncio.run(_joins(address, root_fingerprint, [renewing], 1))
        phases = []
        for repeat in range(args.repeats):
            for flooded in (False, True):
                phase = _phase(group, work, address, root_fingerprint, nodes, renewing, args, flooded, repeat)
                phases.append(phase)
                print(f"repeat {repeat} {'flooded' if flooded else 'unflooded'}: {phase.admissions_per_s:.2f} "
                      f"admissions/s, renewal p50 {phase.percentile(50):.1f} ms, p95 {phase.percentile(95):.1f} ms",
                      flush=True)
    finally:
        group.shutdown(grace_s=10.0)
    text = _report(phases, args, command, (loads, os.getloadavg()[0]))
    print(text)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
