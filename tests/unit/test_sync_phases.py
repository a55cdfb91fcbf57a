"""The sync phases (node/membership/phases.py): the decisions, pure (where a replica starts, when it moves
on), and `SyncPhases`' answers to a stage that shows no member, over an in-memory view of the DHT."""

from __future__ import annotations

import pytest

from agora.dht.records import PHASE_TRANSITIONS, START_PHASES, Phase
from agora.node.membership.phases import SyncPolicy, SyncProgress, behind_the_run, entry_phase, next_phase, rotation_slices
from agora.node.membership.state_download import StateDownloadError
from agora.pipeline.config import PRESETS, SyncConfig

POLICY = SyncPolicy(optimizer_sync_steps=10, lag_tolerance=3, fallback_rotations=2)



def test_the_life_of_a_worker_goes_forward_only_and_every_phase_can_leave():
    assert set(PHASE_TRANSITIONS) == set(Phase)
    for phase in set(Phase) - {Phase.LEAVING}:
        assert Phase.LEAVING in PHASE_TRANSITIONS[phase]
    assert PHASE_TRANSITIONS[Phase.LEAVING] == frozenset()
    # Every phase is reachable from where a worker starts, and none leads back (no cycle but the end).
    reached, frontier = set(START_PHASES), list(START_PHASES)
    while frontier:
        for after in PHASE_TRANSITIONS[frontier.pop()]:
            assert after not in START_PHASES or after == Phase.MEMBER
            if after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(Phase)
    assert Phase.WEIGHT_SYNC not in PHASE_TRANSITIONS[Phase.MEMBER]  # a member never goes back to syncing
    assert Phase.MEMBER not in PHASE_TRANSITIONS[Phase.SERVING]  # an inference-only worker never trains

def test_the_first_replica_of_a_stage_and_one_that_starts_with_it_are_members_at_once():
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[], policy=POLICY) == "member"
    # Replicas started together (the demo, a run's start) are identical by construction.
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[0, 2, 3], policy=POLICY) == "member"
    # A resumed replica close to its stage goes on as a member.
    assert entry_phase(own_step=40, resumed_phase="member", donor_steps=[42], policy=POLICY) == "member"


def test_a_replica_behind_its_stage_or_resumed_mid_sync_syncs_first():
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[4], policy=POLICY) == "weight_sync"
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[1, 500], policy=POLICY) == "weight_sync"
    assert entry_phase(own_step=100, resumed_phase="member", donor_steps=[300], policy=POLICY) == "weight_sync"
    assert entry_phase(own_step=40, resumed_phase="optimizer_sync", donor_steps=[40], policy=POLICY) == "weight_sync"
    # ...unless there is nobody to sync from: then it is the stage's state.
    assert entry_phase(own_step=0, resumed_phase="weight_sync", donor_steps=[], policy=POLICY) == "member"


def _progress(**kwargs) -> SyncProgress:
    values = dict(phase="weight_sync", downloaded=True, steps=0, updates=0, rounds=0, slices_averaged=frozenset(),
                  n_slices=4)
    values.update(kwargs)
    return SyncProgress(**values)


def test_weight_sync_waits_for_the_download_then_for_every_slice_of_a_rotation():
    assert next_phase(_progress(downloaded=False, steps=1000), POLICY) is None
    assert next_phase(_progress(slices_averaged=frozenset({0, 1, 3}), steps=40, rounds=5), POLICY) is None
    phase, why = next_phase(_progress(slices_averaged=frozenset({0, 1, 2, 3}), steps=32), POLICY)
    assert phase == "optimizer_sync" and "4 slices" in why


def test_weight_sync_ends_after_two_rotations_of_rounds_even_when_rounds_kept_failing():
    # Counted in rounds, not steps: steps can outpace rounds by far on a small model.
    assert next_phase(_progress(slices_averaged=frozenset({2}), steps=10**4, rounds=7), POLICY) is None
    phase, why = next_phase(_progress(slices_averaged=frozenset({2}), rounds=8), POLICY)
    assert phase == "optimizer_sync" and "8 rounds" in why and "1 of 4 slices" in why


def test_without_averaging_the_download_is_the_whole_weight_sync():
    assert next_phase(_progress(n_slices=0), POLICY)[0] == "optimizer_sync"


def test_optimizer_sync_counts_steps_that_updated_its_weights():
    base = dict(phase="optimizer_sync")
    assert next_phase(_progress(**base, steps=15, updates=9), POLICY) is None
    assert next_phase(_progress(**base, steps=15, updates=10), POLICY)[0] == "member"
    # Little traffic routed to it: after twice its steps in stage steps it is a member anyway.
    phase, why = next_phase(_progress(**base, steps=20, updates=3), POLICY)
    assert phase == "member" and "little traffic" in why
    assert next_phase(_progress(**base), SyncPolicy(optimizer_sync_steps=0))[0] == "member"


def test_members_and_others_stay_where_they_are():
    for phase in ("member", "leaving", "serving"):
        assert next_phase(_progress(phase=phase, steps=10**6, updates=10**6), POLICY) is None


def test_a_rotation_is_every_slice_once():
    assert rotation_slices(PRESETS["tiny"].sync) == 4
    assert rotation_slices(SyncConfig()) == 20  # the report's 5% per round
    assert rotation_slices(SyncConfig(method="diloco", fragments=3)) == 3
    assert rotation_slices(SyncConfig(method="none")) == 0 and rotation_slices(None) == 0
    with pytest.raises(ValueError):
        SyncPolicy(fallback_rotations=0)


def test_an_empty_looking_stage_is_the_replicas_own_only_when_the_run_is_not_ahead_of_it():
    # At a run's start (or a whole swarm resumed together) nobody is ahead: member at once.
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[], policy=POLICY, run_step=None) == "member"
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[], policy=POLICY, run_step=3) == "member"
    assert entry_phase(own_step=40, resumed_phase="member", donor_steps=[], policy=POLICY, run_step=42) == "member"
    # Mid-run, a stage that looks empty has (or had) a state: wait for a member, never take its place.
    assert entry_phase(own_step=0, resumed_phase=None, donor_steps=[], policy=POLICY, run_step=115) == "weight_sync"
    assert behind_the_run(0, 4, POLICY) and not behind_the_run(0, None, POLICY)
    with pytest.raises(ValueError):
        SyncPolicy(empty_stage_wait_s=-1.0)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _RefusingDownloader:
    """Every donor refuses (the in-memory stand-in for node/membership/state_download.py's failures)."""

    def __init__(self):
        self.asked: list[list[str]] = []
        self.reported: list[str] = []

    def report_outliers(self, plan):
        self.reported.extend(d.peer_id for d in plan.outliers)

    async def download(self, plan, replan=None):
        self.asked.append([d.peer_id for d in plan.donors])
        raise StateDownloadError("every donor refused")


async def _download_until_cancelled(phases, downloader: _RefusingDownloader, members) -> None:
    """Weight sync from its start until `members` cancels it (the test has seen enough)."""
    import asyncio

    await phases.begin(own_step=0, resumed_phase=None, members=members)
    try:
        await phases.download(downloader, members, apply=None, retry_s=0.001)
    except asyncio.CancelledError:
        pass


def _phases(clock: _Clock, policy: SyncPolicy):
    from agora.node.membership.phases import SyncPhases
    from agora.node.worker.worker import StageWorker

    worker = StageWorker(PRESETS["tiny"].with_stages(3), 1, run_id="run")
    return SyncPhases(worker, policy, PRESETS["tiny"].sync, clock=clock)


@pytest.mark.timeout(60)
def test_behind_the_run_a_replica_waits_for_a_member_before_it_takes_the_stage_as_lost(caplog):
    """A newcomer's DHT read missed its stage's live member under churn, and it made its fresh
    weights the stage's state: now it waits in weight sync, asking again, and a member that shows
    up is downloaded from; only `empty_stage_wait_s` with none makes it the stage's state."""
    import asyncio

    from agora.node.membership.phases import StageView
    from agora.node.membership.state_download import Donor, DonorPlan

    policy = SyncPolicy(lag_tolerance=3, empty_stage_wait_s=10.0)

    async def lost_stage():
        clock = _Clock()
        phases = _phases(clock, policy)

        async def members():
            clock.now += 1.0  # each read a second later
            return StageView(DonorPlan(()), run_step=115)

        await phases.begin(own_step=0, resumed_phase=None, members=members)
        assert phases.phase == "weight_sync"
        result = await phases.download(_RefusingDownloader(), members, apply=None, retry_s=0.001)
        return phases, clock.now, result

    phases, waited, result = asyncio.run(lost_stage())
    assert result is None and phases.phase == "member" and 10.0 <= waited <= 12.0
    assert [phase for phase, _ in phases.history] == ["weight_sync", "member"]
    assert "its state is lost" in caplog.text

    async def member_shows_up():
        clock = _Clock()
        phases = _phases(clock, policy)
        reads = iter([StageView(DonorPlan(()), 115), StageView(DonorPlan(()), 115),
                      StageView(DonorPlan((Donor("live", "127.0.0.1:1", 115),)), 115)])
        downloader = _RefusingDownloader()

        async def members():
            clock.now += 1.0
            view = next(reads, None)
            if view is None:
                raise asyncio.CancelledError  # the test has seen enough: stop the loop here
            return view

        await _download_until_cancelled(phases, downloader, members)
        return phases, downloader

    phases, downloader = asyncio.run(member_shows_up())
    assert phases.phase == "weight_sync" and downloader.asked == [["live"]]

    async def not_behind():
        phases = _phases(_Clock(), policy)

        async def members():
            return StageView(DonorPlan(()), run_step=2)  # the run is where this replica is: nothing was lost

        await phases.begin(own_step=0, resumed_phase=None, members=members)
        return phases

    assert asyncio.run(not_behind()).phase == "member"


@pytest.mark.timeout(60)
def test_a_stage_whose_only_members_announce_far_off_steps_is_never_taken_as_lost(caplog):
    """A member announcing step 10**9 is not downloaded from, but it is not an empty stage either:
    the joiner reports it and asks again, however long, instead of making its fresh weights the
    stage's state after `empty_stage_wait_s`."""
    import asyncio

    from agora.node.membership.phases import StageView
    from agora.node.membership.state_download import Donor, DonorPlan

    policy = SyncPolicy(lag_tolerance=3, empty_stage_wait_s=2.0)
    liar = Donor("liar", "127.0.0.1:1", 10**9)

    async def main():
        clock = _Clock()
        phases = _phases(clock, policy)
        downloader = _RefusingDownloader()
        reads = 0

        async def members():
            nonlocal reads
            reads += 1
            clock.now += 1.0
            if reads > 10:
                raise asyncio.CancelledError  # ten seconds, five times the wait for an empty stage
            return StageView(DonorPlan((), (liar,), agreed_step=115, max_gap=256), run_step=10**9)

        await _download_until_cancelled(phases, downloader, members)
        return phases, downloader

    phases, downloader = asyncio.run(main())
    assert phases.phase == "weight_sync" and downloader.asked == [] and set(downloader.reported) == {"liar"}
    assert "far from the run's" in caplog.text


@pytest.mark.timeout(60)
def test_a_syncing_replica_with_the_stages_state_is_a_member_once_no_member_is_left(caplog):
    """Chaos killed a stage's only member while its other replica was in weight sync (state
    downloaded): that replica is the freshest copy, so it becomes a member (routed, a donor)
    instead of waiting for rounds with nobody while the newcomer in its place found no donor. One
    read without a member is not enough (a read can miss a record); two in a row are."""
    import asyncio
    import time

    from agora.node.membership.phases import SyncPhases, StageView
    from agora.node.membership.state_download import Donor, DonorPlan
    from agora.node.worker.worker import StageWorker

    policy = SyncPolicy(lag_tolerance=3, member_check_s=0.01)
    member = Donor("member", "127.0.0.1:1", 60)

    async def main(downloaded: bool, reads: list):
        worker = StageWorker(PRESETS["tiny"].with_stages(3), 1, run_id="run")
        phases = SyncPhases(worker, policy, PRESETS["tiny"].sync, clock=time.monotonic)
        views = iter(reads)
        seen = []

        async def members():
            view = next(views, StageView(DonorPlan(()), 60))
            seen.append(bool(view.donors))
            return view

        await phases.begin(own_step=0, resumed_phase=None, members=members)
        assert phases.phase == "weight_sync"
        phases.downloaded = downloaded
        try:
            await asyncio.wait_for(phases._run(), timeout=0.5)
        except asyncio.TimeoutError:
            pass
        return phases, seen

    phases, seen = asyncio.run(main(True, [StageView(DonorPlan((member,)), 60), StageView(DonorPlan(()), 60),
                                           StageView(DonorPlan((member,)), 60)]))
    # begin's read; then an empty read, the member back (the miss forgotten), two empty reads: member.
    assert phases.phase == "member" and seen[:5] == [True, False, True, False, False] and len(seen) == 5
    assert phases.history[-1][0] == "member" and "freshest copy" in caplog.text
    phases, seen = asyncio.run(main(False, [StageView(DonorPlan((member,)), 60)]))
    assert phases.phase == "weight_sync" and seen == [True]  # without the state it has nothing to offer


def test_a_worker_refuses_a_move_its_life_does_not_have():
    from agora.node.rpc.server import run
    from agora.node.worker.worker import StageWorker

    async def main():
        worker = StageWorker(PRESETS["tiny"].with_stages(2), 0, run_id="phases")
        assert worker.phase == Phase.MEMBER
        with pytest.raises(ValueError, match="no move from phase member to weight_sync"):
            worker.phase = "weight_sync"
        with pytest.raises(ValueError, match="starts in one of"):
            worker.start_in_phase("optimizer_sync")
        worker.start_in_phase("weight_sync")
        worker.phase = Phase.OPTIMIZER_SYNC
        worker.phase = "member"
        worker.phase = Phase.LEAVING
        with pytest.raises(ValueError, match="no move from phase leaving to member"):
            worker.phase = Phase.MEMBER
        with pytest.raises(ValueError):
            worker.phase = "asleep"

    run(main())
