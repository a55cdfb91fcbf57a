"""What `agora-node doctor` measures of its links to the members of the stage it would join, with
the probe credential its dry run got (auth/join_check.py): each member's round trip and rates each
way, over mutual TLS (the member's side: node/worker/link_probe.py; node/doctor_stage.py judges).

Design choices:

- The channel presents the probe credential with the dry run's key, trusts the run's root alone,
  and expects the member's worker credential for the stage and the peer id the dry run named (the
  TLS target name, node/rpc/tls.py ``worker_server_name``): whoever answers is that member, or the
  probe fails. A member without a peer id (an authorizer that names none) is not probed.
- One link probe per member (`Stage/ProbeLink`, one call): ``pings`` round trips, each a gRPC
  message each way on the open connection (the least is the round trip: the first pays for the
  TCP and TLS handshakes), then an upload of ``probe_bytes`` (timed from its first piece to the
  member's count of the bytes received), then a download of ``probe_bytes`` (from the ask to the
  last byte). A transfer's time less one round trip (the ask's way out and the answer's way back;
  at least a tenth of it) is the transfer's: ``transfer_mbit``.
- The sizes are the member's bounds (``MAX_PROBE_BYTES``, ``MAX_PINGS``): the most a probe may
  carry, for the steadiest rate the member allows.
- Members are probed one after another: they share this machine's link, and probing them at once
  would show each a share of it. Each probe is bounded by ``timeout_s``; a probe that fails says
  why (the member's status, or what it answered out of turn) and the others go on.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Sequence

import grpc

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.node.doctor_stage import ProbedLink
from agora.node.rpc.tls import worker_server_name
from agora.node.worker.link_probe import MAX_PINGS, MAX_PROBE_BYTES
from agora.protos.authorizer_adapter import StageMember
from agora.protos.link_probe_adapter import PROBE_CHUNK_BYTES, LinkProbe, LinkProbeCall, LinkProbeStub

__all__ = ["PROBE_TIMEOUT_S", "transfer_mbit", "probe_members", "probe_member"]

PROBE_TIMEOUT_S = 20.0  # per member: five of them within the probe credential's two minutes


class _OutOfTurn(Exception):
    """The member answered something other than the step due."""


def transfer_mbit(size_bytes: int, elapsed_s: float, rtt_s: float) -> float:
    """The rate of a transfer of ``size_bytes`` timed at ``elapsed_s``, less one round trip (at least
    a tenth of it is the transfer's), in Mbit/s."""
    return size_bytes * 8 / 1e6 / max(elapsed_s - rtt_s, elapsed_s / 10, 1e-9)


async def probe_members(members: Sequence[StageMember], *, stage: int, credential_pem: bytes, key_pem: bytes,
                        root_pem: bytes, fingerprint: str, probe_bytes: int = MAX_PROBE_BYTES,
                        pings: int = MAX_PINGS, timeout_s: float = PROBE_TIMEOUT_S) -> list[ProbedLink]:
    """Each member's link probe, one after another (the module docstring), in the given order."""
    credentials = grpc.ssl_channel_credentials(root_pem, key_pem, credential_pem)
    return [await probe_member(member, stage=stage, credentials=credentials, fingerprint=fingerprint,
                               probe_bytes=probe_bytes, pings=pings, timeout_s=timeout_s) for member in members]


async def probe_member(member: StageMember, *, stage: int, credentials: grpc.ChannelCredentials, fingerprint: str,
                       probe_bytes: int = MAX_PROBE_BYTES, pings: int = MAX_PINGS,
                       timeout_s: float = PROBE_TIMEOUT_S) -> ProbedLink:
    """One member's link probe over mutual TLS: its figures, or why it measured none."""
    if not member.peer_id:
        return ProbedLink(error="the authorizer named no peer id for this member, so no TLS name to dial it by")
    options = [("grpc.ssl_target_name_override", worker_server_name(stage, member.peer_id))]
    async with grpc.aio.secure_channel(member.address, credentials, options=options) as channel:
        call = LinkProbeStub(channel).open(metadata=((FINGERPRINT_METADATA, fingerprint),))
        try:
            return await asyncio.wait_for(_measure(call, probe_bytes, pings), timeout_s)
        except asyncio.TimeoutError:
            return ProbedLink(error=f"no answer to the link probe within {timeout_s:g} s")
        except grpc.aio.AioRpcError as error:
            return ProbedLink(error=f"{error.code().name}: {error.details()}")
        except _OutOfTurn as error:
            return ProbedLink(error=str(error))
        finally:
            call.cancel()


async def _measure(call: LinkProbeCall, probe_bytes: int, pings: int) -> ProbedLink:
    rtt_s = min([await _round_trip(call, number) for number in range(pings)])
    upload_s = await _upload(call, probe_bytes)
    download_s = await _download(call, probe_bytes)
    await call.done_writing()
    await _expect(call, None)
    return ProbedLink(rtt_s * 1e3, transfer_mbit(probe_bytes, upload_s, rtt_s),
                      transfer_mbit(probe_bytes, download_s, rtt_s))


async def _expect(call: LinkProbeCall, step) -> LinkProbe:
    answer = await call.read()
    if (answer.step if answer is not None else None) != step:
        got = "the end of the stream" if answer is None else f"a {answer.step}"
        raise _OutOfTurn(f"the member answered {got} where {'the end' if step is None else 'a ' + step} was due")
    return answer


async def _round_trip(call: LinkProbeCall, number: int) -> float:
    started = time.perf_counter()
    await call.write(LinkProbe("ping", number=number))
    echo = await _expect(call, "ping")
    elapsed = time.perf_counter() - started
    if echo.number != number:
        raise _OutOfTurn(f"the member echoed ping {echo.number} for ping {number}")
    return elapsed


async def _upload(call: LinkProbeCall, size: int) -> float:
    piece = os.urandom(PROBE_CHUNK_BYTES)  # incompressible, as the member's download is
    started, left = time.perf_counter(), size
    while left > 0:
        await call.write(LinkProbe("upload", data=piece[:min(left, len(piece))]))
        left -= min(left, len(piece))
    await call.write(LinkProbe("upload_done"))
    received = await _expect(call, "received")
    elapsed = time.perf_counter() - started
    if received.number != size:
        raise _OutOfTurn(f"the member received {received.number} of the {size} bytes uploaded")
    return elapsed


async def _download(call: LinkProbeCall, size: int) -> float:
    started, got = time.perf_counter(), 0
    await call.write(LinkProbe("download", number=size))
    while got < size:
        got += len((await _expect(call, "payload")).data)
    return time.perf_counter() - started
