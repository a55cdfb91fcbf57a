"""The watchdog on the real path: a worker in its own process (in-process here), admitted by a real
authorizer over gRPC, announcing itself in a real DHT, whose rule trips, leaves cleanly: its record
withdrawn, its stage checkpointed, its slot freed at the authorizer (a queued newcomer is admitted),
and it ends with the rule's exit code."""

from __future__ import annotations

import asyncio
import logging

import pytest

import authorizer_world as world
from authorizer_world import CONFIG, join, serving
from agora.dht.swarm import SwarmDHT
from agora.node.rpc.server import run
from agora.node.worker.join import JoinOptions, _serve
from agora.node.worker.options import WorkerOptions
from agora.node.worker.watchdog_rules import EXIT_CODES, WatchdogOptions
from agora.pipeline.checkpoint import checkpoint_steps

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
