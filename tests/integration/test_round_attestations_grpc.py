"""Round attestations over real gRPC and mutual TLS: a worker's attester delivers its attestation of another
member's round, which that worker verifies, keeps and exports; forged, another stage's, self-attested and
repeated ones are refused by name while it serves on. Then two admitted replicas average one round through
hivemind and each keeps the other's attestation, found through the other's DHT worker record."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass, replace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.auth.node_state import NodeCredentials
from agora.auth.round_attestations import RoundAttestation, attestation_to_json, sign_attestation
from agora.dht import SwarmDHT
from agora.dht.averaging import RoundResult, SliceAverager
from agora.dht.averaging_admission import AveragingAdmission
from agora.dht.round_board import RoundBoard
from agora.dht.keys import averaging_prefix
from agora.dht.records import WorkerRecord
from agora.dht.security import DHTSecurity
from agora.monitor.metrics import sample_value
from agora.monitor.worker_metrics import WorkerMetrics
from agora.node.averaging.loop import AveragingLoop
from agora.node.averaging.round_attestations import RoundAttester, attest_rounds
from agora.node.averaging.sparta import SlicePartition, averaged_vector_size, stage_parameter_numels
from agora.node.cli import main as agora_node
from agora.node.rpc.tls import TlsChannels, worker_server_name
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker
from agora.pipeline.config import PRESETS
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos.attestation_adapter import AttestationDelivery, AttestationStub
from polling import eventually
from run_pki import build_pki

pytestmark = pytest.mark.timeout(120)

RUN = "rounds-run"
CONFIG = PRESETS["tiny"].with_stages(3)
FINGERPRINT = run_fingerprint(CONFIG)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    made = build_pki(tmp_path_factory.mktemp("pki"), RUN)
    second = made.authority.mint(made.workers[0].parent / "worker0b", role="worker", stage=0).directory
    return made, second


def fresh(state, tmp_path, name):
    """A copy of a state dir without the receipts.sqlite an earlier test left there."""
    target = tmp_path / name
    shutil.copytree(state, target, ignore=shutil.ignore_patterns("receipts.sqlite*"))
    return target


@dataclass(frozen=True)
class Announced:
    """What an attester reads of a member's DHT worker record."""

    peer_id: str
    endpoint: str


def records_of(*workers: StageWorker):
    """The stage's records as the DHT would give them, naming `workers`."""
    async def read():
        return [Announced(w.credentials.peer_id, w.address) for w in workers]

    return read


async def carried(by: NodeCredentials, worker: StageWorker, signed) -> tuple[grpc.StatusCode, str]:
    """Deliver `signed` to `worker` over a channel presenting `by`'s credential; the status it answers."""
    channel = TlsChannels(by).open(worker.address, target_name=worker_server_name(0, worker.credentials.peer_id))
    try:
        await AttestationStub(channel).deliver(AttestationDelivery(json.dumps(attestation_to_json(signed))),
                                               timeout=10, metadata=((FINGERPRINT_METADATA, FINGERPRINT.text()),))
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details()
    finally:
        await channel.close()


def test_an_attestation_is_delivered_kept_and_exported_and_bad_ones_are_refused_by_name(pki, tmp_path):
    made, second = pki
    a_dir, b_dir = fresh(made.workers[0], tmp_path, "a"), fresh(second, tmp_path, "b")
    registry = CollectorRegistry()
    a_node, b_node = NodeCredentials(a_dir, clock=time.time), NodeCredentials(b_dir, clock=time.time)

    async def main():
        a = StageWorker(CONFIG, 0, run_id=RUN, credentials=a_node)
        b = StageWorker(CONFIG, 0, run_id=RUN, credentials=b_node, metrics=WorkerMetrics(registry))
        async with a, b:
            b.attestations.rounds = lambda: 10  # b's schedule: rounds up to 10 (64 back)
            attester = RoundAttester(run_id=RUN, stage=0, credentials=a_node, channels=TlsChannels(a_node),
                                     fingerprint=FINGERPRINT, stage_records=records_of(a, b))
            committed = RoundResult("committed", 7, None, participants=(a_node.peer_id, b_node.peer_id),
                                    weights=(1.0, 1.0))
            attester.on_round(committed, 0, True)
            attester.on_round(replace(committed, outcome="failed"), 0, False)  # attests nothing
            await attester.close()
            again = RoundAttester(run_id=RUN, stage=0, credentials=a_node, channels=TlsChannels(a_node),
                                  fingerprint=FINGERPRINT, stage_records=records_of(a))  # b not in a's records
            again.on_round(committed, 0, True)
            await again.close()
            replay = RoundAttester(run_id=RUN, stage=0, credentials=a_node, channels=TlsChannels(a_node),
                                   fingerprint=FINGERPRINT, stage_records=records_of(a, b))
            replay.on_round(committed, 0, True)
            await replay.close()

            chain = a_node.current()[0]
            genuine = sign_attestation(RoundAttestation(RUN, 0, 8, a_node.peer_id, b_node.peer_id, time.time()),
                                       a_node.key, chain)
            forged = replace(genuine, attestation=replace(genuine.attestation, round=9))
            own = sign_attestation(RoundAttestation(RUN, 0, 8, b_node.peer_id, b_node.peer_id, time.time()),
                                   b_node.key, b_node.current()[0])
            trainer, other_stage = NodeCredentials(made.trainer, clock=time.time), \
                NodeCredentials(made.workers[1], clock=time.time)
            answers = {"forged": await carried(a_node, b, forged), "self": await carried(a_node, b, own),
                       "by a stage-1 worker": await carried(other_stage, b, genuine),
                       "by a trainer": await carried(trainer, b, genuine), "genuine": await carried(a_node, b, genuine)}
            client = StageClient(b.address, run_id=RUN, stage=0, model=CONFIG.model, fingerprint=FINGERPRINT,
                                 peer_id=b_node.peer_id, channels=TlsChannels(trainer), timeout_s=10)
            async with client:
                info = await client.info()  # still serving
            return attester.outcomes, again.outcomes, replay.outcomes, answers, info, b.attestations.kept.totals()

    delivered, unrouted, replayed, answers, info, totals = asyncio.run(main())
    assert delivered == {"kept": 1} and unrouted == {"no_route": 1} and replayed == {"duplicate": 1}
    assert answers["genuine"] == (grpc.StatusCode.OK, "")
    assert answers["forged"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert answers["forged"][1].startswith("attestation refused (bad_signature): signature:")
    assert answers["self"][0] == grpc.StatusCode.INVALID_ARGUMENT and "(self_attested)" in answers["self"][1]
    assert answers["by a stage-1 worker"][0] == grpc.StatusCode.PERMISSION_DENIED
    assert "(wrong_stage)" in answers["by a stage-1 worker"][1]
    assert answers["by a trainer"][0] == grpc.StatusCode.PERMISSION_DENIED  # the per-call policy: workers only
    assert info.stage == 0 and totals == (2, 2, 1)  # rounds 7 and 8, attested by a
    for reason in ("bad_signature", "self_attested", "wrong_stage", "duplicate"):
        assert sample_value(registry, "agora_worker_round_attestations_refused_total", {"reason": reason}) == 1
    assert sample_value(registry, "agora_worker_attested_rounds_total", {}) == 2

    exported = tmp_path / "b-ledger.json"
    assert agora_node(["ledger", "export", "--state-dir", str(b_dir), "--out", str(exported)]) == 0
    (rounds,) = json.loads(exported.read_text())["attested_rounds"]
    assert (rounds["worker"], rounds["rounds"], rounds["attesters"]) == (b_node.peer_id, 2, [a_node.peer_id])
    root = tmp_path / "root.pem"
    root.write_bytes(made.root_pem)
    assert agora_node(["ledger", "verify", str(exported), "--ca", str(root)]) == 0


TIMEOUTS = dict(matchmaking_s=3.0, request_s=1.0, sender_s=2.0, reducer_s=4.0, round_s=20.0)


def test_two_admitted_replicas_averaging_a_round_each_keep_the_others_attestation(pki, tmp_path):
    made, second = pki
    dirs = [fresh(made.workers[0], tmp_path, "a"), fresh(second, tmp_path, "b")]
    sync = CONFIG.sync
    size = averaged_vector_size(sync, SlicePartition(stage_parameter_numels(CONFIG.model, 0), sync.n_slices,
                                                     CONFIG.seed).buffer_size)
    securities = [DHTSecurity.from_state_dir(d) for d in dirs]
    swarms, averagers = [SwarmDHT.start(security=securities[0])], []
    try:  # hivemind forks: its processes first, then the gRPC servers
        swarms.append(SwarmDHT.start(initial_peers=swarms[0].visible_maddrs(), security=securities[1]))
        for swarm, security in zip(swarms, securities):
            averagers.append(SliceAverager.start(swarm.hivemind_dht, prefix=averaging_prefix(RUN, 0, sync.method),
                                                 size=size, part_size_bytes=64 * 1024, **TIMEOUTS,
                                                 admission=AveragingAdmission.for_node(security, 0)))
        kept = asyncio.run(_one_round(dirs, swarms, averagers))
    finally:
        for averager in averagers:
            averager.shutdown()
        for swarm in swarms:
            swarm.shutdown()
    (a_peer, a_totals, a_outcomes), (b_peer, b_totals, b_outcomes) = kept
    assert a_totals == b_totals == (1, 1, 1)  # round 1, attested by the other member
    assert a_outcomes == b_outcomes == {"kept": 1}


async def _one_round(dirs, swarms, averagers):
    sync = CONFIG.sync
    workers, loops, attesters = [], [], []
    try:
        for state, swarm, averager in zip(dirs, swarms, averagers):
            node = NodeCredentials(state, clock=time.time)
            worker = StageWorker(CONFIG, 0, run_id=RUN, credentials=node)
            await worker.start()
            workers.append(worker)
            assert swarm.peer_id == node.peer_id  # the averaging peer id is the credential's
            swarm.announce_worker(WorkerRecord(
                peer_id=swarm.peer_id, run_id=RUN, endpoint=worker.address, stage=0, n_stages=3, throughput=1.0,
                queue_depth=0, step=0, phase="member", version="test", updated_at=0.0,
                fingerprint=FINGERPRINT.text()), ttl=60)
        for swarm in swarms:  # each counts both replicas: the round's group target, and where the other is
            eventually(lambda: len(swarm.live_workers(RUN, 0)) == 2, timeout=10, what="both workers' records")
        for worker, swarm, averager in zip(workers, swarms, averagers):
            board = RoundBoard(swarm, run_id=RUN, stage=0, method=sync.method, ttl=TIMEOUTS["matchmaking_s"])
            loop = AveragingLoop(worker, averager, sync, seed=CONFIG.seed, board=board)
            attesters.append(attest_rounds(worker, loop, worker.credentials,
                                           lambda swarm=swarm: swarm.live_workers_async(RUN, 0)))
            await loop.start()
            loops.append(loop)
        results = await asyncio.gather(*(loop.run_round(1) for loop in loops))
        assert [r.outcome for r in results] == ["committed", "committed"], [r.error for r in results]
        for attester in attesters:
            await attester.close()
        return [(w.credentials.peer_id, w.attestations.kept.totals(), a.outcomes) for w, a in zip(workers, attesters)]
    finally:
        for loop in loops:
            await loop.stop()
        for worker in workers:
            await worker.stop(0)
