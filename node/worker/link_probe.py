"""A worker answers link probes: a would-be member of its stage (`agora-node doctor`) times its link
to it before it is admitted, its round trips and its rates each way (`Stage/ProbeLink`,
protos/link_probe_adapter.py; the client is node/doctor_links.py).

Design choices:

- **Who**: a probe credential of this worker's stage, the two-minute credential a Join's dry run
  issues for the stage it would assign (auth/join_check.py), or an operator. The per-call check has
  let only those roles through (auth/grpc_policy.py: every other call refuses a probe credential,
  and so does the DHT); this handler holds a probe to this worker's stage (`wrong_stage`,
  PERMISSION_DENIED). Under --insecure every caller is anonymous and may call anything, this too.
- **What one probe may cost** (`ProbeBudget`, pure): at most `MAX_PROBE_BYTES` each way (4 MiB:
  a second at 32 Mbit/s, enough for a rate that means something), `MAX_PINGS` round trips,
  `PROBE_TIMEOUT_S` in all. Beyond is RESOURCE_EXHAUSTED naming the bound (DEADLINE_EXCEEDED past
  the time); a step only the worker sends is INVALID_ARGUMENT.
- **How many**: one probe per caller at a time and `LINK_PROBE_CALLS` in all, in a call pool of
  their own taken before the handler runs (node/rpc/call_slots.py), so probes never take a
  training call's place; and `PROBE_BURST` probes per caller at once, one more every
  `PROBE_EVERY_S` (a token bucket per peer id, auth/limits.py; RESOURCE_EXHAUSTED saying when to
  retry). A probe credential names the fresh key of one dry run and lasts two minutes, so a caller
  that wants more probes pays a CheckJoin for them (the authorizer's join rate limits and its
  preflight's transfers): what a probe credential costs a member is bounded per credential, and
  the number of credentials by the authorizer.
- The download's bytes are one random block drawn at start and sent piece by piece: no allocation
  per probe, and nothing on the path compresses random bytes into a flattering rate.
- A refusal is counted by reason in the worker's refusal counts (`link_probe_<reason>`); a probe
  answered is a debug line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import grpc

from agora.auth.credentials import PROBE_ROLE
from agora.auth.limits import TokenBuckets
from agora.node.rpc.auth_check import Caller, current_caller
from agora.protos.link_probe_adapter import PROBE_CHUNK_BYTES, LinkProbe
from agora.protos.stage_adapter import StageRefusal

__all__ = ["MAX_PROBE_BYTES", "MAX_PINGS", "PROBE_TIMEOUT_S", "PROBE_BURST", "PROBE_EVERY_S", "ProbeBudget",
           "probe_caller_refusal", "LinkProbeService"]

MAX_PROBE_BYTES = 4 << 20  # each way, per probe
MAX_PINGS = 16
PROBE_TIMEOUT_S = 30.0
PROBE_BURST, PROBE_EVERY_S = 2, 30.0  # per caller: probes at once, then one more every this many seconds


@dataclass
class ProbeBudget:
    """What one probe has spent of its bounds; `spend` refuses a step past them (pure)."""

    max_bytes: int = MAX_PROBE_BYTES
    max_pings: int = MAX_PINGS
    pings: int = 0
    uploaded: int = 0
    downloaded: int = 0

    def spend(self, probe: LinkProbe) -> None:
        """Count ``probe`` (a client's step); StageRefusal when it is past a bound or not a client's step."""
        if probe.step == "ping":
            self.pings += 1
            if self.pings > self.max_pings:
                raise _exhausted(f"ping: more than the {self.max_pings} round trips a link probe may time")
        elif probe.step == "upload":
            self.uploaded += len(probe.data)
            if self.uploaded > self.max_bytes:
                raise _exhausted(f"upload: more than the {self.max_bytes} bytes a link probe may carry each way")
        elif probe.step == "download":
            if self.downloaded + probe.number > self.max_bytes:
                raise _exhausted(f"download: {probe.number} bytes asked, {self.downloaded} already sent: more than "
                                 f"the {self.max_bytes} bytes a link probe may carry each way")
            self.downloaded += probe.number
        elif probe.step != "upload_done":
            raise StageRefusal(grpc.StatusCode.INVALID_ARGUMENT, f"step: {probe.step} is the worker's to send; a "
                                                                 "client sends ping, upload, upload_done or download")


def _exhausted(message: str) -> StageRefusal:
    return StageRefusal(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def probe_caller_refusal(caller: Optional[Caller], stage: int) -> Optional[str]:
    """Why ``caller`` may not probe a worker of ``stage``, or None (pure; the role is the per-call
    check's, this is the stage)."""
    if caller is None:
        return "no caller for this call: link probes come through the per-call check"
    if caller.role == PROBE_ROLE and caller.identity is not None and caller.identity.stage != stage:
        return (f"a probe credential of stage {caller.identity.stage} may not probe a worker of stage {stage}: "
                "it is for the members of the stage the dry run would assign")
    return None


class LinkProbeService:
    """The ProbeLink handler (protos/link_probe_adapter.LinkProbeHandler) of a worker of ``stage``."""

    def __init__(self, stage: int, *, logger: logging.Logger, refused: Callable[[str], None] = lambda reason: None,
                 caller: Callable[[], Optional[Caller]] = current_caller, clock: Callable[[], float] = time.monotonic,
                 random_bytes: Callable[[int], bytes] = os.urandom):
        self.stage = stage
        self._logger, self._refused, self._caller, self._clock = logger, refused, caller, clock
        self._block = random_bytes(PROBE_CHUNK_BYTES)
        self._rates = TokenBuckets(1.0 / PROBE_EVERY_S, PROBE_BURST)

    async def probe_link(self, probes: AsyncIterator[LinkProbe], send: Callable[[LinkProbe], Awaitable[None]],
                         context: Any) -> None:
        owner = self._admit()
        budget = ProbeBudget()
        try:
            await asyncio.wait_for(self._answer(probes, send, budget), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._refused("link_probe_timeout")
            raise StageRefusal(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"link probe: longer than the {PROBE_TIMEOUT_S:g} s a probe may take") from None
        except StageRefusal:
            self._refused("link_probe_bounds")
            raise
        self._logger.debug("link probe from %s: %d pings, %d bytes up, %d down", owner, budget.pings,
                           budget.uploaded, budget.downloaded)

    def _admit(self) -> str:
        """The caller's owner, its rate token spent; StageRefusal when it may not probe now."""
        caller = self._caller()
        problem = probe_caller_refusal(caller, self.stage)
        if problem is not None:
            self._refused("link_probe_wrong_stage")
            raise StageRefusal(grpc.StatusCode.PERMISSION_DENIED, f"link probe refused: {problem}")
        wait = self._rates.acquire(caller.owner, self._clock())
        if wait > 0:
            self._refused("link_probe_rate")
            raise _exhausted(f"link probe refused: at most {PROBE_BURST} probes per caller at once and one more "
                             f"every {PROBE_EVERY_S:g} s; retry in {wait:.0f} s")
        return caller.owner

    async def _answer(self, probes: AsyncIterator[LinkProbe], send: Callable[[LinkProbe], Awaitable[None]],
                      budget: ProbeBudget) -> None:
        async for probe in probes:
            budget.spend(probe)
            if probe.step == "ping":
                await send(probe)
            elif probe.step == "upload_done":
                await send(LinkProbe("received", number=budget.uploaded))
            elif probe.step == "download":
                await self._send_bytes(probe.number, send)

    async def _send_bytes(self, count: int, send: Callable[[LinkProbe], Awaitable[None]]) -> None:
        while count > 0:
            piece = self._block[:min(count, len(self._block))]
            await send(LinkProbe("payload", data=piece))
            count -= len(piece)
