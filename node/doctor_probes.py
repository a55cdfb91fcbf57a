"""What `agora-node doctor` measures of the stage it would join (node/doctor_stage.py judges it):
the round trips from this machine to a few of the stage's members, and this machine's compute
for the stage.

Design choices:

- A round trip is the time of a TCP connect to the member's announced port (the handshake is one
  round trip), the least of ``attempts`` connects, each bounded by ``timeout_s``; the members are
  timed at once (at most the authorizer's sample, auth/join_check.py ``MEMBERS_SHOWN``). The
  connection is closed at once: nothing is sent, so nothing needs the member to admit us. (With
  the dry run's probe credential, node/doctor_links.py measures each member's rates too.)
- Compute is timed as a worker spends it (node/replica/compute.py): the stage built as a worker
  builds it (pipeline/stages.py ``build_stage``, placed by the run's runtime: device, dtype,
  weights), at the run's microbatch shape, a Forward (no graph) and a Backward (the forward again
  with a graph, then the gradients of the input and the parameters) as separate jobs, or the
  tail's one job (its loss and backward). A worker's announced throughput is a moving average of
  its jobs' rates, so this machine's figure is the mean of the jobs' rates, in samples/s, each the
  best of ``repetitions`` after one warm-up (the first run of a shape pays for allocation).
"""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import torch

from agora.node.doctor_stage import MemberLink
from agora.pipeline.config import RunConfig
from agora.pipeline.runtime import Runtime
from agora.pipeline.stages import build_stage

__all__ = ["time_member_links", "stage_samples_per_s"]


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


async def _connect_ms(host: str, port: int, timeout_s: float) -> float:
    started = time.perf_counter()
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    elapsed = time.perf_counter() - started
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:  # the member reset it: the round trip was measured already
        pass
    return elapsed * 1e3


async def _time_link(address: str, attempts: int, timeout_s: float) -> MemberLink:
    try:
        host, port = _host_port(address)
        return MemberLink(address, min([await _connect_ms(host, port, timeout_s) for _ in range(attempts)]))
    except asyncio.TimeoutError:
        return MemberLink(address, None, f"no answer within {timeout_s:g} s")
    except (OSError, ValueError) as error:
        return MemberLink(address, None, str(error) or type(error).__name__)


async def time_member_links(addresses: Sequence[str], *, attempts: int = 3, timeout_s: float = 3.0
                            ) -> list[MemberLink]:
    """Each member's round trip from here (the module docstring), all at once, in the given order."""
    return list(await asyncio.gather(*(_time_link(address, attempts, timeout_s) for address in addresses)))


def _timed(job, runtime: Runtime) -> float:
    timer = runtime.timer()
    timer.start()
    job()
    return timer.seconds()


def stage_samples_per_s(config: RunConfig, stage_index: int, runtime: Runtime, *, repetitions: int = 3) -> float:
    """This machine's compute for stage ``stage_index`` of ``config`` in samples/s per job (the module
    docstring)."""
    model = config.model
    stage = runtime.place_stage(build_stage(model, stage_index))
    rows, seq = config.train.microbatch_size, config.train.seq_len
    device = runtime.device
    tokens = torch.randint(0, model.vocab_size, (rows, seq), device=device)
    wire = None if stage.is_head else torch.randn(rows, seq, model.wire_dim, device=device)
    parameters = [p for p in stage.parameters() if p.requires_grad]

    def forward() -> None:
        with torch.no_grad(), runtime.autocast():
            stage(tokens, wire)

    def backward() -> None:
        leaf = None if wire is None else wire.detach().requires_grad_(True)
        with torch.enable_grad():
            with runtime.autocast():
                output = stage(tokens, leaf)
            inputs = ([leaf] if leaf is not None else []) + parameters
            torch.autograd.grad(output, inputs, grad_outputs=torch.randn_like(output), allow_unused=True)

    def tail() -> None:
        leaf = None if wire is None else wire.detach().requires_grad_(True)
        with torch.enable_grad():
            with runtime.autocast():
                loss = stage(tokens, leaf, tokens)
            torch.autograd.grad(loss, ([leaf] if leaf is not None else []) + parameters, allow_unused=True)

    jobs = [tail] if stage.is_tail else [forward, backward]
    rates = []
    for job in jobs:
        job()  # warm-up
        rates.append(rows / min(_timed(job, runtime) for _ in range(repetitions)))
    return sum(rates) / len(rates)
