"""A hostile member of a stage serves poisoned state over real gRPC on 127.0.0.1:0: the joiner's
downloader (node/membership/state_download.py) checks what it downloaded (node/membership/
state_verify.py) before returning it, so the poisoned state is refused, its donor reported (the
refusals metric and a `state_donor_refused` milestone) and the state comes from an honest member.
`export`, reading the members from a real hivemind DHT, writes the honest member's state too.

The stage: three tail StageWorkers of one tiny run, trained on different batches (honest replicas
that drifted apart), the hostile one first in the plan (the donor order a joiner would try first).
Its poison is put into its own parameters, so it serves it through the real DownloadState path as
the state of a member, and answers sketch requests over its poisoned state too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from agora.auth.grpc_policy import FINGERPRINT_METADATA
from agora.dht.records import WorkerRecord
from agora.monitor.weight_sync_metrics import WeightSyncMetrics
from agora.node.export import ExportOptions, _export
from agora.node.membership.check_options import StateCheckOptions
from agora.node.membership.state_check import norms_of
from agora.node.membership.state_download import Donor, DonorPlan, StateDownloader, StateDownloadError
from agora.node.membership.state_transfer import MAX_SKETCH_SIZE, apply_state
from agora.node.membership.state_verify import StateChecks
from agora.node.rpc.server import run
from agora.node.rpc.tls import InsecureChannels
from agora.node.trainer.stage_client import StageClient
from agora.node.worker.worker import StageWorker, WorkerOptions
from agora.pipeline.checkpoint import load_checkpoint
from agora.pipeline.config import PRESETS, ConfigError
from agora.pipeline.fingerprint import run_fingerprint
from agora.protos.state_adapter import StateRequest, StateStub
from tail_training import train_tail
from tcp_relay import TcpRelay

pytestmark = pytest.mark.timeout(180)

CONFIG = PRESETS["tiny"].with_stages(2)
RUN = "poison-run"
FINGERPRINT = run_fingerprint(CONFIG)
TAIL = 1
POISONED = "layers.3.attn.q.weight"  # a tail-stage weight matrix (tiny, two stages)
CHUNK = 64 * 2**10


async def _train(worker: StageWorker, first_batch: int, batches: int = 3, first_report: int = 0) -> None:
    client = StageClient(worker.address, run_id=RUN, stage=TAIL, model=CONFIG.model, fingerprint=FINGERPRINT)
    try:
        await train_tail(client, CONFIG.model, first_batch, batches, first_report)
    finally:
        await client.close()


def _poison(how: str):
    def apply(compute) -> None:
        with torch.no_grad():
            tensor = dict(compute.stage.named_parameters())[POISONED]
            if how == "scaled":
                tensor.mul_(10)
            elif how == "nonfinite":
                tensor.view(-1)[7] = math.nan
            elif how == "flipped":
                tensor.neg_()
    return apply


def _checks(joiner: StageWorker) -> StateChecks:
    async def own():
        return await joiner.on_compute(lambda compute: norms_of(compute.stage.state_dict()))

    return StateChecks.for_run(StateCheckOptions(), CONFIG.optim, own)


def _downloader(joiner: StageWorker, metrics: WeightSyncMetrics, **kwargs) -> StateDownloader:
    return StateDownloader(run_id=RUN, stage=TAIL, fingerprint=FINGERPRINT, channels=InsecureChannels(),
                           max_bytes=64 * 2**20, checks=_checks(joiner), show_progress=False, metrics=metrics,
                           **kwargs)


@contextlib.asynccontextmanager
async def _workers(count: int):
    workers = [StageWorker(CONFIG, TAIL, run_id=RUN, options=WorkerOptions()) for _ in range(count)]
    try:
        for worker in workers:
            await worker.start()
        yield workers
    finally:
        for worker in workers:
            await worker.stop()


def _refusals(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("agora_worker_state_refusals_total", {"reason": reason}) or 0.0


def _parameters(compute) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in compute.stage.state_dict().items()}


@pytest.mark.parametrize("how, reason", [("scaled", "scale"), ("nonfinite", "nonfinite"), ("flipped", "sketch")])
def test_a_hostile_donors_state_is_refused_and_the_joiner_loads_an_honest_members(how, reason, caplog):
    async def main():
        async with _workers(4) as (hostile, honest, other, joiner):
            joiner.start_in_phase("weight_sync")
            await asyncio.gather(_train(hostile, 0), _train(honest, 0), _train(other, 10))
            await hostile.on_compute(_poison(how))
            registry = CollectorRegistry()
            plan = DonorPlan((Donor("hostile", hostile.address, 3), Donor("honest", honest.address, 3),
                              Donor("other", other.address, 3)), agreed_step=3, max_gap=64)
            with caplog.at_level(logging.WARNING, logger="agora.node.worker.state"):
                result = await _downloader(joiner, WeightSyncMetrics(registry)).download(plan)
            assert result.donor.peer_id == "honest", result.attempts
            assert result.check.verdict.refusal is None and result.check.second_members
            assert hostile.state_donor.stats.completed == 1  # it was asked, and what it sent was refused
            assert _refusals(registry, reason) == 1
            assert other.state_donor.stats.sketches >= 1  # a few KiB each, counted by the joiner too
            assert registry.get_sample_value("agora_worker_state_sketch_bytes_total") > 0
            (line,) = [r for r in caplog.records if getattr(r, "milestone", None) == "state_donor_refused"]
            assert line.fields["donor"] == "hostile" and line.fields["reason"] == reason
            await joiner.on_compute(lambda compute: apply_state(compute, result.tree))
            applied, served = await joiner.on_compute(_parameters), honest.state_donor.snapshots[0]["model"]
            assert all(torch.equal(applied[name], served[name]) for name in served)

    run(main())


def test_the_stages_only_member_serving_a_state_far_from_the_joiners_scale_is_refused():
    """Alone: no second member to compare with; the scale against the joiner's own tensors (the run's
    initialisation) is what is checked, and a tensor 100x its size fails it."""
    async def main():
        async with _workers(2) as (only, joiner):
            joiner.start_in_phase("weight_sync")
            await _train(only, 0)
            await only.on_compute(lambda compute: dict(compute.stage.named_parameters())[POISONED].data.mul_(100))
            registry = CollectorRegistry()
            downloader = _downloader(joiner, WeightSyncMetrics(registry), timeout_s=10.0)
            before = await joiner.on_compute(_parameters)
            with pytest.raises(StateDownloadError, match="every donor's state was refused.*scale"):
                await downloader.download(DonorPlan((Donor("only", only.address, 3),), agreed_step=3, max_gap=64))
            assert _refusals(registry, "scale") == 1
            after = await joiner.on_compute(_parameters)
            assert all(torch.equal(before[name], after[name]) for name in before)

    run(main())


def test_a_state_no_other_member_answers_for_is_not_used_and_nobody_is_reported():
    """The plan names a second member that is gone (a stale record): the state cannot be checked, so
    the download ends without it (the caller reads the members again) and its donor is not blamed."""
    async def main():
        async with _workers(2) as (honest, joiner):
            joiner.start_in_phase("weight_sync")
            await _train(honest, 0)
            await joiner.stop()  # its port now answers nothing: the stale record's endpoint
            registry = CollectorRegistry()
            downloader = _downloader(honest, WeightSyncMetrics(registry), next_chunk_s=3.0)
            plan = DonorPlan((Donor("honest", honest.address, 3), Donor("gone", joiner.address, 3)),
                             agreed_step=3, max_gap=64)
            with pytest.raises(StateDownloadError, match="could not be checked"):
                await downloader.download(plan)
            assert honest.state_donor.stats.completed == 1
            assert not any(sample.value for metric in registry.collect() for sample in metric.samples
                           if sample.name == "agora_worker_state_refusals_total")

    run(main())


def test_a_second_member_that_moved_to_another_stage_is_asked_once_not_until_the_timeout(caplog):
    """The plan's other member has since moved to stage 0 (rebalancing): it refuses the sketch naming
    its stage, which asking again cannot change, so the verdict comes at once instead of after a
    second's retries for the whole ask timeout."""
    async def main():
        async with _workers(1) as (honest,):
            moved = StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions())
            await moved.start()
            try:
                await _train(honest, 0)
                downloader = _downloader(honest, WeightSyncMetrics(CollectorRegistry()), next_chunk_s=4.0)
                plan = DonorPlan((Donor("honest", honest.address, 3), Donor("moved", moved.address, 3)),
                                 agreed_step=3, max_gap=64)
                with caplog.at_level(logging.INFO, logger="agora.node.worker.state"):
                    with pytest.raises(StateDownloadError, match="could not be checked"):
                        await downloader.download(plan)
            finally:
                await moved.stop()
        asked = [r.getMessage() for r in caplog.records if "sent no usable sketch" in r.getMessage()]
        assert len(asked) == 1 and "INVALID_ARGUMENT" in asked[0] and "hosts stage 0" in asked[0], asked

    run(main())


def test_second_members_are_asked_when_the_download_starts_so_training_during_it_is_no_drift(caplog):
    """Three replicas in step; the transfer is held after its first chunks while all three train on
    for 30 more batches. The snapshot is the stage's state at its step; the second members' states
    30 steps later are not. Asked when the stream starts, their sketches match the snapshot's
    step and the state is taken; asked at its end, an honest donor would be refused for how long
    its download took."""
    async def main():
        workers = [StageWorker(CONFIG, TAIL, run_id=RUN, options=WorkerOptions(stream_chunk_bytes=CHUNK))
                   for _ in range(4)]
        donor, first, second, joiner = workers
        for worker in workers:
            await worker.start()
        relay = TcpRelay(donor.address, hold_after=4 * CHUNK)
        try:
            joiner.start_in_phase("weight_sync")
            await asyncio.gather(*(_train(worker, 0) for worker in (donor, first, second)))
            plan = DonorPlan((Donor("donor", await relay.start(), 3), Donor("first", first.address, 3),
                              Donor("second", second.address, 3)), agreed_step=3, max_gap=64)
            registry = CollectorRegistry()
            download = asyncio.create_task(_downloader(joiner, WeightSyncMetrics(registry)).download(plan))
            await asyncio.wait_for(relay.held.wait(), 30)
            await asyncio.gather(*(_train(worker, 3, batches=30, first_report=3) for worker in (donor, first, second)))
            relay.release()
            result = await download
            assert result.donor.peer_id == "donor" and result.step == 3, result.attempts
            assert result.check.confirmed_by, result.check
            assert first.state_donor.stats.sketches == second.state_donor.stats.sketches == 1
        finally:
            await relay.close()
            for worker in workers:
                await worker.stop()

    run(main())


def test_a_sketch_request_beyond_the_bound_is_refused_by_name_and_the_member_serves_on():
    async def main():
        async with _workers(1) as (member,):
            channel = InsecureChannels().open(member.address)
            stub, metadata = StateStub(channel), ((FINGERPRINT_METADATA, FINGERPRINT.text()),)
            try:
                call = stub.download(StateRequest(run_id=RUN, stage=TAIL, sketch_seed=1,
                                                  sketch_size=MAX_SKETCH_SIZE + 1), metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await call.next()
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"sketch_size {MAX_SKETCH_SIZE + 1}" in raised.value.details()
                call = stub.download(StateRequest(run_id=RUN, stage=TAIL, sketch_seed=1, sketch_size=16),
                                     metadata=metadata)
                chunks = []
                while (chunk := await call.next()) is not None:
                    chunks.append(chunk)
                assert chunks and member.state_donor.stats.sketches == 1
            finally:
                await channel.close()

    run(main())


def _record(worker: StageWorker, peer_id: str, clock: float, queue_depth: int = 0) -> WorkerRecord:
    return WorkerRecord(peer_id=peer_id, run_id=RUN, endpoint=worker.address, stage=worker.stage_index,
                        n_stages=len(CONFIG.layer_split), throughput=1.0, queue_depth=queue_depth, step=3,
                        phase="member",
                        version="0.1.0", updated_at=clock, fingerprint=FINGERPRINT.text())


def test_export_writes_the_stage_state_another_members_sketch_confirms(dht_pair, tmp_path, caplog):
    """Stage 1's first donor serves a tensor scaled x10: export refuses it and writes an honest member's
    state, confirmed by the third member's sketch; stage 0, one member, is checked alone."""
    first, second = dht_pair

    async def main():
        async with _workers(3) as (hostile, honest, other):
            head = StageWorker(CONFIG, 0, run_id=RUN, options=WorkerOptions())
            await head.start()
            try:
                await asyncio.gather(_train(hostile, 0), _train(honest, 0), _train(other, 10))
                await hostile.on_compute(_poison("scaled"))
                now = first.clock()  # the hostile member announces the shortest queue: export asks it first
                records = [_record(head, "head", now), _record(hostile, "hostile", now),
                           _record(honest, "honest", now, queue_depth=2), _record(other, "other", now, queue_depth=2)]
                for record in records:
                    assert await first.announce_worker_async(record, ttl=120)
                await _until_listed(second, len(records))
                with caplog.at_level(logging.WARNING, logger="agora.node.worker.state"):
                    assert await _export(CONFIG, ExportOptions(out=str(tmp_path), run_id=RUN, timeout_s=60.0),
                                         second, None) == 0
                assert hostile.state_donor.stats.completed == 1  # asked first, and what it sent was refused
                snapshots = {"honest": honest.state_donor.snapshots, "other": other.state_donor.snapshots}
            finally:
                await head.stop()
        return snapshots

    snapshots = run(main())
    _, _, stages, extra = load_checkpoint(tmp_path / "checkpoint")
    sources = extra["exported_from"]
    assert sources["1"]["peer"] in ("honest", "other"), sources
    assert sources["1"]["confirmed_by"] and {"hostile", sources["1"]["peer"]}.isdisjoint(sources["1"]["confirmed_by"])
    served = snapshots[sources["1"]["peer"]][0]["model"]
    assert sources["0"]["peer"] == "head" and sources["0"]["confirmed_by"] == []
    assert all(torch.equal(stages[1].model[name], served[name]) for name in served)
    lines = [r for r in caplog.records if getattr(r, "milestone", None) == "state_donor_refused"]
    assert len(lines) == 1, [(r.fields, r.getMessage()) for r in lines]
    (line,) = lines
    assert line.fields["donor"] == "hostile" and line.fields["reason"] == "scale"


async def _until_listed(reader, count: int, timeout_s: float = 20.0, run_id: str = RUN) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stages = await reader.all_workers_async(run_id, len(CONFIG.layer_split), fingerprint=FINGERPRINT)
        if sum(len(records) for records in stages.values()) == count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the DHT did not list the {count} workers in {timeout_s:g} s")


def test_export_reads_the_stages_again_until_each_has_a_member_and_names_one_that_never_has(dht_pair, tmp_path,
                                                                                            caplog):
    """One read can miss a stage's members on a loaded swarm: export reads again. Stage 1's member
    announces itself a second after the export began, and the export waits for it and writes both
    stages; a run whose stage 1 never has a member fails after `members_wait_s`, naming stage 1."""
    first, second = dht_pair
    late = "late-member-run"

    def record(worker: StageWorker, peer_id: str) -> WorkerRecord:
        return WorkerRecord(peer_id=peer_id, run_id=late, endpoint=worker.address, stage=worker.stage_index,
                            n_stages=len(CONFIG.layer_split), throughput=1.0, queue_depth=0, step=0, phase="member",
                            version="0.1.0", updated_at=first.clock(), fingerprint=FINGERPRINT.text())

    async def main():
        head = StageWorker(CONFIG, 0, run_id=late, options=WorkerOptions())
        tail = StageWorker(CONFIG, TAIL, run_id=late, options=WorkerOptions())
        await head.start()
        await tail.start()
        try:
            assert await first.announce_worker_async(record(head, "head"), ttl=120)
            await _until_listed(second, 1, run_id=late)
            with pytest.raises(ConfigError, match=r"stage 1 of run 'late-member-run': no member replica announces "
                                                  r"itself in the DHT after 2 s"):
                await _export(CONFIG, ExportOptions(out=str(tmp_path / "none"), run_id=late, members_wait_s=2.0),
                              second, None)
            assert not (tmp_path / "none").exists()

            async def announce_later():
                await asyncio.sleep(1.0)
                assert await first.announce_worker_async(record(tail, "tail"), ttl=120)

            with caplog.at_level(logging.INFO, logger="agora.node.export"):
                announced = asyncio.create_task(announce_later())
                assert await _export(CONFIG, ExportOptions(out=str(tmp_path / "out"), run_id=late, timeout_s=60.0),
                                     second, None) == 0
                await announced
        finally:
            await head.stop()
            await tail.stop()

    run(main())
    assert any("no member of stage 1 seen yet; reading again" in r.getMessage() for r in caplog.records)
    _, _, stages, extra = load_checkpoint(tmp_path / "out" / "checkpoint")
    assert [state.index for state in stages] == [0, 1]
    assert extra["exported_from"]["1"]["peer"] == "tail" and extra["exported_from"]["0"]["peer"] == "head"

