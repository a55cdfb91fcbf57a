"""A worker's link probes (node/worker/link_probe.py) and the doctor's rates from them
(node/doctor_links.py), without sockets: the bounds of one probe, who may probe which stage, the
per-caller rate, and the arithmetic of a rate. Over gRPC with mutual TLS:
tests/integration/test_link_probe.py."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from agora.auth.credentials import Identity
from agora.node.doctor_links import transfer_mbit
from agora.node.rpc.auth_check import Caller
from agora.node.worker.link_probe import (MAX_PINGS, MAX_PROBE_BYTES, PROBE_BURST, PROBE_EVERY_S, LinkProbeService,
                                          ProbeBudget, probe_caller_refusal)
from agora.protos.link_probe_adapter import PROBE_CHUNK_BYTES, LinkProbe
from agora.protos.stage_adapter import StageRefusal


def caller(role: str, stage=None, owner: str = "QmProber") -> Caller:
    return Caller(owner, role, Identity("run", role, stage, owner, 0.0, 1e12, 1))


def refusal_of(spend) -> StageRefusal:
    with pytest.raises(StageRefusal) as refused:
        spend()
    return refused.value


def test_one_probe_is_bounded_each_way_and_in_round_trips():
    budget = ProbeBudget(max_bytes=100, max_pings=2)
    budget.spend(LinkProbe("ping"))
    budget.spend(LinkProbe("ping"))
    refused = refusal_of(lambda: budget.spend(LinkProbe("ping")))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 round trips" in refused.message
    budget.spend(LinkProbe("upload", data=bytes(60)))
    refused = refusal_of(lambda: budget.spend(LinkProbe("upload", data=bytes(41))))
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "upload: more than the 100 bytes" in refused.message
    budget.spend(LinkProbe("download", number=100))
    refused = refusal_of(lambda: budget.spend(LinkProbe("download", number=1)))  # asked in all, not per ask
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "100 already sent" in refused.message
    for step in ("received", "payload"):
        refused = refusal_of(lambda: budget.spend(LinkProbe(step)))
        assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and f"{step} is the worker's to send" in refused.message
    assert MAX_PROBE_BYTES == 4 << 20 and MAX_PINGS == 16 and PROBE_CHUNK_BYTES == 32 << 10


def test_a_probe_credential_probes_only_the_stage_it_names():
    assert probe_caller_refusal(caller("probe", 1), 1) is None
    assert "of stage 0 may not probe a worker of stage 1" in probe_caller_refusal(caller("probe", 0), 1)
    assert probe_caller_refusal(caller("operator"), 1) is None  # an operator's own tools
    assert probe_caller_refusal(Caller.anonymous_from_peer("ipv4:10.0.0.5:4000"), 1) is None  # --insecure: open
    assert probe_caller_refusal(None, 1) is not None


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def probe(service: LinkProbeService, steps: list[LinkProbe]) -> list[LinkProbe]:
    async def requests():
        for step in steps:
            yield step
    sent = []

    async def send(answer: LinkProbe) -> None:
        sent.append(answer)
    await service.probe_link(requests(), send, None)
    return sent


def test_the_service_answers_each_step_and_rate_limits_each_caller():
    clock, refused = FakeClock(), []
    who = {"caller": caller("probe", 2)}
    service = LinkProbeService(2, logger=logging.getLogger("test"), refused=refused.append,
                               caller=lambda: who["caller"], clock=clock)
    steps = [LinkProbe("ping", number=7), LinkProbe("upload", data=bytes(10)), LinkProbe("upload_done"),
             LinkProbe("download", number=PROBE_CHUNK_BYTES + 5)]
    answers = asyncio.run(probe(service, steps))
    assert [(answer.step, answer.number, len(answer.data)) for answer in answers] == [
        ("ping", 7, 0), ("received", 10, 0), ("payload", 0, PROBE_CHUNK_BYTES), ("payload", 0, 5)]
    for _ in range(PROBE_BURST - 1):
        asyncio.run(probe(service, []))
    with pytest.raises(StageRefusal) as limited:
        asyncio.run(probe(service, []))
    assert limited.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in 30 s" in limited.value.message
    who["caller"] = caller("probe", 2, owner="QmAnother")  # another caller has its own bucket
    asyncio.run(probe(service, []))
    who["caller"] = caller("probe", 2)
    clock.now += PROBE_EVERY_S
    asyncio.run(probe(service, []))
    who["caller"] = caller("probe", 0, owner="QmElsewhere")
    with pytest.raises(StageRefusal) as wrong:
        asyncio.run(probe(service, []))
    assert wrong.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert refused == ["link_probe_rate", "link_probe_wrong_stage"]


def test_a_rate_is_the_transfer_less_one_round_trip_and_at_least_a_tenth_of_it():
    assert transfer_mbit(1_000_000, 1.1, 0.1) == pytest.approx(8.0)
    assert transfer_mbit(1_000_000, 0.2, 0.5) == pytest.approx(400.0)  # the round trip dwarfs it: a tenth
