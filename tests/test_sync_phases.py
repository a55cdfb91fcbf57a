"""The sync phases' decisions (node/worker/phases.py), pure: where a replica starts, when it moves on."""

from __future__ import annotations

import pytest

from agora.node.worker.phases import SyncPolicy, SyncProgress, entry_phase, next_phase, rotation_slices
from agora.pipeline.config import PRESETS, SyncConfig

POLICY = SyncPolicy(optimizer_sync_steps=10, lag_tolerance=3, fallback_rotations=2)


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
