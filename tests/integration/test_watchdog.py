"""The watchdog on the real path: a worker (in-process here), admitted by a real authorizer over gRPC,
announcing itself in a real DHT, whose rule trips, leaves cleanly: its record withdrawn, its stage
checkpointed, its slot freed at the authorizer (a queued newcomer is admitted), and it ends with the
rule's exit code. And a worker whose own id reaches the ban list its DHT holds (the authorizer's
publisher, a heartbeat's read) leaves without waiting for its next renewal."""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc
import pytest
import torch

import authorizer_world as world
from authorizer_world import CONFIG, join, serving
from agora.dht.security import DHTSecurity
from agora.dht.swarm import SwarmDHT
from agora.node.ban_publisher import BanPublisher
from agora.node.rpc.server import run
from agora.node.trainer.stage_client import StageCallError, StageClient
from agora.node.worker.watchdog import NodeHealth
from agora.node.worker.join import _serve
from agora.node.worker.join_options import JoinOptions
from agora.node.worker.options import WorkerOptions
from agora.node.worker.watchdog_rules import EXIT_CODES, WatchdogOptions, first_tripped
from agora.node.worker.worker import StageWorker
from agora.pipeline.checkpoint import checkpoint_steps
from agora.pipeline.fingerprint import run_fingerprint
from fake_clock import FakeClock

pytestmark = pytest.mark.timeout(120)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


def test_a_worker_past_its_memory_share_leaves_cleanly_and_frees_its_slot(authority, nodes, tmp_path, caplog):
    """A share of the machine's RAM no process stays under: the watchdog trips at its first check."""
    caplog.set_level(logging.INFO)
    sick, newcomer = nodes(0), nodes(1)
    checkpoints = tmp_path / "checkpoints"
    tight = WorkerOptions(watchdog=WatchdogOptions(host_memory_share=0.0001, check_s=0.2))
    swarm = SwarmDHT.start()  # hivemind forks: before the loop and its gRPC servers

    async def main():
        async with serving(authority, max_workers=1, queue_retry_after_s=0.2, join_rate_per_s=100.0,
                           network_join_rate_per_s=100.0, network_join_burst=1000) as (service, address):
            await join(address, sick, authority, stage=0)
            queued = asyncio.Event()
            waiting = asyncio.ensure_future(join(address, newcomer, authority, on_queued=lambda p: queued.set()))
            await asyncio.wait_for(queued.wait(), 20)
            options = JoinOptions(stage=0, run_id=authority.run_id, authorizer=address, heartbeat_s=1.0,
                                  checkpoint_dir=str(checkpoints), sync_phases=False, rebalance=False)
            ended = await asyncio.wait_for(_serve(CONFIG, options, tight, swarm, credentials=sick), 60)
            admitted = await asyncio.wait_for(waiting, 20)  # the slot the sick worker held
            live = await swarm.live_workers_async(authority.run_id, 0)
            return ended, admitted, live, [node.peer_id for node in service.admitted()]

    try:
        ended, admitted, live, holders = run(main())
    finally:
        swarm.shutdown()
    assert ended.code == EXIT_CODES["host_memory"] == 11 and ended.move_to is None
    milestones = {getattr(record, "milestone", None): record for record in caplog.records}
    assert milestones["watchdog_tripped"].fields["rule"] == "host_memory"
    assert "joined" in milestones and "left_authorizer" in milestones  # announced, then told the authorizer
    assert live == [], "the record was withdrawn, not left to expire"
    assert checkpoint_steps(str(checkpoints)), "the clean leave wrote the stage's checkpoint"
    assert admitted.role == "worker" and holders == [newcomer.peer_id]


def test_a_worker_whose_own_id_the_swarm_bans_leaves_at_once_with_the_ban_code(authority, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    sick = authority.mint(tmp_path / "sick", role="worker", stage=0)
    operator = authority.mint(tmp_path / "operator", role="operator")
    swarm = SwarmDHT.start(security=DHTSecurity.from_state_dir(sick.directory))
    publishing = SwarmDHT.start(initial_peers=swarm.visible_maddrs(), client_mode=True,
                                security=DHTSecurity.from_state_dir(operator.directory))
    options = JoinOptions(stage=0, run_id=authority.run_id, heartbeat_s=1.0, sync_phases=False, rebalance=False)

    async def main():
        serving = asyncio.ensure_future(_serve(CONFIG, options, WorkerOptions(watchdog=WatchdogOptions(check_s=0.2)),
                                               swarm, credentials=sick))
        for _ in range(600):  # its record announced: it is serving
            if await publishing.live_workers_async(authority.run_id, 0) or serving.done():
                break
            await asyncio.sleep(0.05)
        assert not serving.done(), "it left before it was banned"
        authority.ban(sick.peer_id, "test")
        try:
            await asyncio.to_thread(BanPublisher(authority, publishing).publish_if_due)
            return await asyncio.wait_for(serving, 60)
        finally:
            authority.unban(sick.peer_id)

    try:
        ended = run(main())
    finally:
        publishing.shutdown()
        swarm.shutdown()
    assert ended.code == EXIT_CODES["banned"] == 3
    tripped = [record for record in caplog.records if getattr(record, "milestone", None) == "watchdog_tripped"]
    assert [record.fields["rule"] for record in tripped] == ["banned"]


def test_the_health_sample_sees_a_blocked_compute_thread_and_calls_failed_on_its_own_non_finite_weights():
    """A real worker: a job that holds its compute thread shows as the probe's wait; a Forward on NaN
    weights fails INTERNAL and is counted as this replica's non-finite result."""
    clock, release, holding = FakeClock(), threading.Event(), threading.Event()
    tokens = torch.randint(0, CONFIG.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def hold(_compute):
        holding.set()
        release.wait(30)

    async def main():
        async with StageWorker(CONFIG, 0, run_id="watchdog") as worker:
            health = NodeHealth(worker, clock=clock)
            blocker = asyncio.ensure_future(worker.on_compute(hold))
            assert await asyncio.to_thread(holding.wait, 30)  # the thread is held before the first probe
            first = health.sample()
            clock.now += 700.0
            stalled = health.sample()
            release.set()
            await blocker
            await worker.on_compute(lambda compute: None)  # the probe has run: the thread moves again
            moving = health.sample()
            await worker.on_compute(lambda compute: [p.data.fill_(float("nan")) for p in compute.stage.parameters()])
            client = StageClient(worker.address, stage=0, run_id="watchdog", fingerprint=run_fingerprint(CONFIG),
                                 model=CONFIG.model)
            with pytest.raises(StageCallError) as failed:
                await client.forward("nan", tokens)
            await client.close()
            return first, stalled, moving, failed.value, health.sample()

    first, stalled, moving, failed, sick = run(main())
    assert first.compute_wait_s == 0 and stalled.compute_wait_s == 700.0 and moving.compute_wait_s == 0
    assert first_tripped(WatchdogOptions(), [first, stalled]).rule == "compute_stalled"
    assert failed.code == grpc.StatusCode.INTERNAL and (first.non_finite, sick.non_finite) == (0, 1)
    assert sick.host_bytes and sick.host_total_bytes and sick.device_bytes is None  # a CPU worker
