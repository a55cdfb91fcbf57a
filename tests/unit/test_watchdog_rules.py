"""The watchdog's rules (node/worker/watchdog_rules.py): pure, over the samples a worker takes of itself;
and the switch that turns the watchdog off (join's and demo's --no-watchdog)."""

from __future__ import annotations

import asyncio

import pytest

from agora.node.cli import build_parser
from agora.node.demo.options import DemoOptions
from agora.node.worker.options import WorkerOptions
from agora.node.worker.watchdog import Watchdog
from agora.pipeline.option_flags import options_from_args
from agora.node.worker.watchdog_rules import (EXIT_CODES, RULES, WatchdogOptions, WatchdogSample, exit_codes_help,
                                              first_tripped)
from agora.pipeline.schema import ConfigError, checked

OPTIONS = WatchdogOptions(window_s=60.0)
GIB = 2**30


def samples(*changes: dict, step_s: float = 10.0) -> list[WatchdogSample]:
    """One sample per dict, `step_s` apart, each carrying its dict's fields (counters since the start)."""
    return [WatchdogSample(at=i * step_s, **change) for i, change in enumerate(changes)]


def test_a_healthy_worker_trips_nothing():
    healthy = samples({}, dict(non_finite=2, failed_rounds=40, committed_rounds=1, host_bytes=GIB,
                               host_total_bytes=16 * GIB, device_bytes=70 * GIB, device_total_bytes=80 * GIB,
                               compute_wait_s=30.0, renewal_failures=7))
    assert first_tripped(OPTIONS, healthy) is None
    assert first_tripped(OPTIONS, []) is None


@pytest.mark.parametrize("rule,sick,figures", [
    ("banned", dict(banned=True), {}),
    ("non_finite_gradients", dict(non_finite=3), {"count": 3, "max": 3, "window_s": 60.0}),
    ("host_memory", dict(host_bytes=31 * GIB, host_total_bytes=32 * GIB), {"share": 0.9688, "bound": 0.95}),
    ("device_memory", dict(device_bytes=79 * GIB, device_total_bytes=80 * GIB), {"share": 0.9875, "bound": 0.98}),
    ("compute_stalled", dict(compute_wait_s=600.0), {"waited_s": 600.0, "bound_s": 600.0}),
    ("averaging_failed", dict(failed_rounds=20), {"failed": 20, "committed": 0}),
    ("renewal_failing", dict(renewal_failures=8), {"failures": 8, "max": 8}),
])
def test_each_rule_trips_with_its_figures_and_its_own_exit_code(rule, sick, figures):
    trip = first_tripped(OPTIONS, samples({}, sick))
    assert trip is not None and trip.rule == rule
    assert figures.items() <= trip.figures.items()
    assert trip.exit_code == EXIT_CODES[rule] and rule in trip.describe()


def test_exit_codes_are_distinct_and_none_is_a_clean_or_a_config_exit():
    codes = [EXIT_CODES[rule] for rule in RULES]
    assert len(set(codes)) == len(codes) and not {0, 1, 2, 130} & set(codes)
    assert all(f"{EXIT_CODES[rule]} {rule}" in exit_codes_help() for rule in RULES if rule != "banned")


def test_counters_count_over_the_window_only():
    """Three non-finite calls long ago and one now: the window holds one, nothing trips."""
    old = samples({}, dict(non_finite=3), dict(non_finite=3), dict(non_finite=3), dict(non_finite=3),
                  dict(non_finite=3), dict(non_finite=3), dict(non_finite=3), dict(non_finite=4))
    assert first_tripped(OPTIONS, old) is None
    assert first_tripped(OPTIONS, old[-3:] + [WatchdogSample(at=80.0, non_finite=6)]).rule == "non_finite_gradients"


def test_failed_rounds_trip_only_without_a_commit_in_the_window():
    one_commit = samples({}, dict(failed_rounds=25, committed_rounds=1))
    assert first_tripped(OPTIONS, one_commit) is None


def test_zero_turns_a_counting_rule_off_and_the_ban_rule_can_be_off():
    off = WatchdogOptions(max_non_finite=0, max_failed_rounds=0, max_renewal_failures=0, stall_s=0,
                          leave_when_banned=False)
    sick = samples({}, dict(non_finite=99, failed_rounds=99, renewal_failures=99, compute_wait_s=1e6, banned=True))
    assert first_tripped(off, sick) is None


def test_the_surest_rule_is_named_first():
    trip = first_tripped(OPTIONS, samples({}, dict(banned=True, non_finite=5, renewal_failures=9)))
    assert trip.rule == "banned"


def test_a_share_out_of_bounds_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"worker\.watchdog\.host_memory_share"):
        checked(WorkerOptions, "worker", watchdog={"host_memory_share": 1.5})
    assert checked(WorkerOptions, "worker", watchdog={"host_memory_share": 0.01}).watchdog.host_memory_share == 0.01


def test_a_watchdog_turned_off_trips_nothing():
    sick = samples({}, dict(banned=True, non_finite=99, host_bytes=32 * GIB, host_total_bytes=32 * GIB))
    assert first_tripped(WatchdogOptions(enabled=False), sick) is None
    assert first_tripped(WatchdogOptions(), sick).rule == "banned"


def test_a_watchdog_turned_off_starts_no_task_and_takes_no_sample():
    taken = []

    async def started(enabled: bool) -> bool:
        sampled = asyncio.Event()

        def sample() -> WatchdogSample:
            taken.append(enabled)
            sampled.set()
            return WatchdogSample(at=0.0)

        watchdog = Watchdog(WatchdogOptions(enabled=enabled), sample, on_trip=lambda trip: None)
        task = watchdog.start()
        if task is not None:
            await asyncio.wait_for(sampled.wait(), 10)
        await watchdog.stop()
        return task is not None

    assert asyncio.run(started(False)) is False
    assert asyncio.run(started(True)) is True
    assert taken == [True]


def test_no_watchdog_is_a_flag_of_join_and_of_the_demo_which_hands_it_to_its_workers():
    parser = build_parser()
    join = parser.parse_args(["join", "--stage", "0", "--no-watchdog"])
    assert options_from_args(WorkerOptions, join, "worker").watchdog.enabled is False
    assert options_from_args(WorkerOptions, parser.parse_args(["join", "--stage", "0"]), "worker").watchdog.enabled
    assert "--no-watchdog" in DemoOptions.from_args(parser.parse_args(["demo", "--no-watchdog"])).worker_flags()
    assert "--no-watchdog" not in DemoOptions.from_args(parser.parse_args(["demo"])).worker_flags()
