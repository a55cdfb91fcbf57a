"""`agora-node doctor`'s view of the stage it would join, against a real authorizer on 127.0.0.1:0
(tests/helpers/authorizer_world.py): the members the dry run shows, every stage's capacity, the
round trips to the members over real TCP, the rates to a member over its link probe (mutual TLS
with the dry run's probe credential), the share of the stage this machine would take and the
pipeline's bottleneck with it.

The members are a real StageWorker and a real listening TCP server in the test's event loop (a
connect is all the doctor asks of a member it cannot probe), plus an announced port where nothing
listens; the doctor is a child process. The link probe's own bounds and refusals:
tests/integration/test_link_probe.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from agora.auth.admission import hardware_report
from agora.auth.join_check import MEMBERS_SHOWN, check_join
from agora.dht.records import Phase
from agora.dht.swarm import SwarmDHT
from agora.node.authorizer import read_stage_members
from agora.node.rpc.server import run
from agora.protos.authorizer_adapter import StageCapacity, StageMember
import authorizer_world as world
from record_samples import SAMPLES
from authorizer_world import fingerprint_from_config, free_port, join, serving, serving_worker
from doctor_run import run_doctor, write_join_file

pytestmark = pytest.mark.timeout(180)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


@contextlib.asynccontextmanager
async def listening_members(count: int):
    """``count`` TCP servers on 127.0.0.1:0 that accept and close; yields their host:port."""
    servers = [await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0) for _ in range(count)]
    try:
        yield [f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers]
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()


def test_without_a_dht_the_dry_run_shows_the_admitted_workers_of_the_stage(authority, nodes):
    """Two workers admitted to stage 0 by real Joins, one to stage 1: a dry run for stage 0 shows
    the two addresses they announced, their compute unknown (0)."""
    announced = [("127.0.0.1", free_port()) for _ in range(3)]

    async def main():
        async with serving(authority) as (_, address):
            for index, stage in enumerate((0, 0, 1)):
                await join(address, nodes(index), authority, stage=stage, announce=announced[index])
            return await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                    hardware=hardware_report(), announce=("127.0.0.1", free_port()), stage=0)

    check = run(main()).check
    assert check.stage == 0
    assert sorted(member.address for member in check.members) == sorted(f"{h}:{p}" for h, p in announced[:2])
    assert check.member_samples_per_s == (0.0, 0.0)
    assert check.stage_capacities == (StageCapacity(0, 2, 2, 0.0), StageCapacity(1, 1, 1, 0.0), StageCapacity(2))


def test_the_dry_run_shows_a_sample_of_the_members_the_authorizer_reads(authority):
    """With a source of members (the DHT's records on a serving authorizer), at most MEMBERS_SHOWN
    addresses and every member's compute, and every stage summed up from the same source."""
    members = [StageMember(f"127.0.0.1:{7100 + index}", 10.0 + index) for index in range(MEMBERS_SHOWN + 2)]
    asked = []

    async def stage_members(stage: int):
        asked.append(stage)
        return members

    async def main():
        async with serving(authority, stage_members=stage_members) as (_, address):
            return await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                    hardware=hardware_report(), announce=("127.0.0.1", free_port()), stage=1)

    check = run(main()).check
    assert sorted(asked) == [0, 1, 2]  # each stage once
    assert len(check.members) == MEMBERS_SHOWN and set(check.members) <= set(members)
    assert check.member_samples_per_s == tuple(member.samples_per_s for member in members)
    total = sum(member.samples_per_s for member in members)
    assert check.stage_capacities == tuple(StageCapacity(stage, len(members), 0, total) for stage in range(3))


def test_the_doctor_times_the_members_and_predicts_its_share(authority, tmp_path):
    """A worker, a listening member the authorizer names no peer id for, and one gone: the worker's
    round trip and rates each way from its link probe, the listener's round trip from a connect (its
    rates unknown, saying why), one WARN with the fix; the share line (members announcing far more
    compute than any machine: this one is the stage's slowest by more than the slack, a WARN), every
    stage's capacity (each shows the same three members) and the bottleneck, stage 0, which this
    machine would slow (a WARN); warnings do not fail the exit code."""
    fast = 1e7  # samples/s
    worker_dir = authority.mint(tmp_path / "worker", role="worker", stage=0).directory

    async def main():
        async with listening_members(1) as (listener,), serving_worker(worker_dir) as worker:
            gone = f"127.0.0.1:{free_port()}"
            members = [StageMember(worker.address, fast, worker.credentials.peer_id), StageMember(listener, fast),
                       StageMember(gone, fast)]
            async with serving(authority, stage_members=lambda stage: members) as (_, address):
                outcome = await run_doctor(write_join_file(tmp_path, address, authority), tmp_path, "--json",
                                           "--stage", "0", "--host", "127.0.0.1", "--port", str(free_port()))
            return outcome, worker.address, listener, gone

    (code, out, err), worker, listener, gone = run(main())
    assert code == 0 and "Traceback" not in err, (out, err)
    checks = {check["name"]: check for check in json.loads(out)["checks"]}
    number_of = {checks[f"member {number}"]["detail"].split("member ")[1].split()[0]: number for number in (1, 2, 3)}
    line = {address: checks[f"member {number}"] for address, number in number_of.items()}
    for member in (worker, listener):
        assert line[member]["verdict"] == "ok" and line[member]["unit"] == "ms"
        assert isinstance(line[member]["value"], float) and line[member]["value"] >= 0
    assert "a gRPC message each way" in line[worker]["detail"] and "TCP connect" in line[listener]["detail"]
    for way in ("upload", "download"):
        rate = checks[f"member {number_of[worker]} {way}"]
        assert rate["verdict"] == "ok" and rate["unit"] == "Mbit/s" and rate["value"] > 0, rate
        assert "link probe over mutual TLS" in rate["detail"]
        for member in (listener, gone):
            unprobed = checks[f"member {number_of[member]} {way}"]
            assert unprobed["verdict"] == "unknown" and "named no peer id" in unprobed["detail"], unprobed
    missing = line[gone]
    assert missing["verdict"] == "WARN" and missing["value"] == gone and "outbound TCP" in missing["fix"]
    share = checks["share stage 0"]
    assert share["verdict"] == "WARN" and 0 <= share["value"] < 25 and share["unit"] == "%"
    assert "of stage 0's microbatches (3 members at 1e+07 samples/s; this machine" in share["detail"]
    assert "faster accelerator" in share["fix"]
    capacities = [checks[f"capacity stage {stage}"] for stage in range(3)]
    assert [line["verdict"] for line in capacities] == ["ok"] * 3
    assert capacities[0]["detail"] == "3 members at 3e+07 samples/s in all; the pipeline's bottleneck"
    bottleneck = checks["bottleneck"]  # the routing's probes of this machine hold up the batches they fall in
    assert bottleneck["verdict"] == "WARN" and bottleneck["unit"] == "microbatches/s"
    assert bottleneck["floor"] == capacities[0]["value"] and bottleneck["value"] < bottleneck["floor"]
    assert "stage 0 would go from 7.5e+06 to" in bottleneck["detail"]
    assert "remain the bottleneck" in bottleneck["detail"]
    assert list(checks)[-1] == "versions"


def test_a_serving_authorizer_reads_the_members_from_the_workers_records_in_a_real_dht():
    """A worker's record of stage 1 in a hivemind DHT, read as the serving authorizer reads it: its
    announced endpoint, and its tokens/s over the run's sequence length; a leaving worker is none."""
    node = SwarmDHT.start()
    try:
        reader = SwarmDHT.start(initial_peers=node.visible_maddrs(), client_mode=True)
        try:
            record = SAMPLES["worker"].model_copy(update=dict(
                peer_id=node.peer_id, run_id="test-run", fingerprint=world.FINGERPRINT.text(), stage=1,
                throughput=2560.0, endpoint="127.0.0.1:7100", updated_at=node.clock()))
            assert node.announce_worker(record, ttl=60)
            members = run(read_stage_members(reader, record.run_id, world.FINGERPRINT, 1, seq_len=128))
            assert node.announce_worker(record.model_copy(update=dict(phase=Phase.LEAVING.value,
                                                                      updated_at=node.clock())), ttl=60)
            leaving = run(read_stage_members(reader, record.run_id, world.FINGERPRINT, 1, seq_len=128))
        finally:
            reader.shutdown()
    finally:
        node.shutdown()
    assert members == [StageMember("127.0.0.1:7100", 20.0, node.peer_id)]
    assert leaving == []


def test_the_dry_run_sums_up_every_stage_from_the_workers_records_in_a_real_dht(authority):
    """Workers' records in a hivemind DHT (two peers: two members of stage 0, one of stage 1, one of
    stage 2 before its first job), read as the serving authorizer reads them and answered over a
    real CheckJoin: each stage's members and their compute in all (tokens/s over the sequence length)."""
    node = SwarmDHT.start()
    try:
        reader = SwarmDHT.start(initial_peers=node.visible_maddrs(), client_mode=True)
        try:
            for peer, stage, throughput in ((node, 0, 2560.0), (reader, 0, 640.0), (node, 1, 1280.0), (reader, 2, 0.0)):
                assert peer.announce_worker(SAMPLES["worker"].model_copy(update=dict(
                    peer_id=peer.peer_id, run_id="test-run", fingerprint=world.FINGERPRINT.text(), stage=stage,
                    throughput=throughput, endpoint=f"127.0.0.1:{7100 + stage}", updated_at=peer.clock())), ttl=60)

            async def main():
                def stage_members(stage: int):
                    return read_stage_members(reader, "test-run", world.FINGERPRINT, stage, seq_len=128)

                async with serving(authority, stage_members=stage_members) as (_, address):
                    return await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                            hardware=hardware_report(), announce=("127.0.0.1", free_port()), stage=0)

            check = run(main()).check
        finally:
            reader.shutdown()
    finally:
        node.shutdown()
    assert check.stage_capacities == (StageCapacity(0, 2, 0, 25.0), StageCapacity(1, 1, 0, 10.0),
                                      StageCapacity(2, 1, 1, 0.0))
    assert sorted(check.member_samples_per_s) == [5.0, 20.0]
