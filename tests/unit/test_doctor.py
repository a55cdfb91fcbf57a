"""The verdicts of `agora-node doctor` (node/doctor.py), without sockets or devices."""

from __future__ import annotations

import dataclasses
import json
import math

from agora.auth.policy import DEFAULT_FLOORS, Floors, LinkMeasurement, check_floors, floor_verdicts
from agora.node.cli import main
from agora.node.doctor import (FAIL, OK, UNKNOWN, Check, as_json, authorizer_check, clock_check, disk_check, exit_code,
                               floor_checks, format_line, memory_check, reachability_check, refused_check, unknown,
                               version_check)
from agora.protos.authorizer_adapter import Hardware

GB, GiB = 10 ** 9, 1 << 30
GPU = Hardware(device="H100", accelerator_memory_bytes=80 * GB, ram_bytes=256 * GB)
FAST = LinkMeasurement(rtt_ms=20.0, download_mbit=900.0, upload_mbit=800.0)


def test_every_floor_gets_a_verdict_and_join_refuses_on_the_first_failed_one():
    slow = LinkMeasurement(rtt_ms=120.0, download_mbit=150.0, upload_mbit=800.0)
    verdicts = floor_verdicts(DEFAULT_FLOORS, GPU, slow)
    assert [(v.name, v.passed) for v in verdicts] == [
        ("max_rtt_ms", False), ("min_upload_mbit", True), ("min_download_mbit", False),
        ("min_accelerator_gb", True), ("min_ram_gb", True)]
    refusal = check_floors(DEFAULT_FLOORS, GPU, slow)
    assert refusal.field == "max_rtt_ms" and refusal.reason == verdicts[0].reason
    assert check_floors(DEFAULT_FLOORS, GPU, FAST) is None


def test_floor_checks_show_the_value_against_the_floor_and_a_fix_only_when_failed():
    cpu = Hardware(device="cpu", accelerator_memory_bytes=0, ram_bytes=16 * GB)
    checks = {c.name: c for c in floor_checks(floor_verdicts(DEFAULT_FLOORS, cpu, FAST))}
    assert [checks[n].verdict for n in ("rtt", "upload", "download", "accelerator", "ram")] == [OK, OK, OK, FAIL, FAIL]
    assert checks["upload"].value == 800.0 and checks["upload"].floor == 200.0 and checks["upload"].fix == ""
    assert checks["accelerator"].floor == 24.0 and "larger accelerator" in checks["accelerator"].fix
    assert "below the floor min_ram_gb=80" in checks["ram"].detail
    assert format_line(checks["ram"]).startswith("FAIL    ram              16 GB (floor 80 GB) - RAM reported 16.0 GB")


def test_a_disabled_floor_passes_and_states_no_floor():
    open_floors = Floors(min_upload_mbit=0, min_download_mbit=0, max_rtt_ms=math.inf, min_accelerator_gb=0,
                         min_ram_gb=0)
    checks = floor_checks(floor_verdicts(open_floors, GPU, LinkMeasurement(900.0, 1.0, 1.0)))
    assert all(c.verdict == OK and c.floor is None and "sets no floor" in c.detail for c in checks)


def test_reachability_fails_with_the_authorizers_line_and_the_fix():
    assert reachability_check("203.0.113.7:4000", "").verdict == OK
    failed = reachability_check("203.0.113.7:4000", "reachability: 203.0.113.7:4000 is unreachable from the authorizer")
    assert failed.verdict == FAIL and failed.detail.startswith("reachability: 203.0.113.7:4000 is unreachable")
    assert "forward that TCP port" in failed.fix


def test_clock_skew_is_judged_against_what_credentials_tolerate_either_way():
    assert clock_check(59.0, 60.0).verdict == OK and clock_check(-59.0, 60.0).verdict == OK
    behind, ahead = clock_check(61.0, 60.0), clock_check(-90.0, 60.0)
    assert behind.verdict == FAIL and "61.000 s behind" in behind.detail and "NTP" in behind.fix
    assert ahead.verdict == FAIL and "ahead of" in ahead.detail
    assert format_line(clock_check(0.25, 60.0)).startswith("ok      clock            0.25 s (tolerated 60 s)")


def test_memory_fails_on_the_device_peak_or_on_the_pinned_host_bytes():
    fits = memory_check(1, "body", 10 * GiB, 20 * GiB, "cuda:0 (H100)", host_bytes=4 * GiB, host_free_bytes=8 * GiB)
    assert fits.verdict == OK and (fits.value, fits.floor, fits.against) == (10.0, 20.0, "free")
    short = memory_check(1, "body", 30 * GiB, 20 * GiB, "cuda:0 (H100)", problem="memory plan: short by 10 GiB")
    assert short.verdict == FAIL and short.fix == "memory plan: short by 10 GiB" and short.name == "memory stage 1"
    host = memory_check(0, "head", 10 * GiB, 20 * GiB, "cuda:0", host_bytes=9 * GiB, host_free_bytes=8 * GiB)
    assert host.verdict == FAIL and host.value == 9.0 and "--pinned-weights 0" in host.fix


def test_disk_needs_room_for_every_checkpoint_kept_and_the_next():
    assert disk_check("/ckpt", 10 * GiB, 9 * GiB, 3).verdict == OK
    short = disk_check("/ckpt", 2 * GiB, 3 * GiB, 3)
    assert short.verdict == FAIL and (short.value, short.floor, short.against) == (2.0, 3.0, "needed")
    assert "3 checkpoints" in short.detail and "--checkpoint-dir" in short.fix


def test_versions_are_unknown_unless_the_run_states_them():
    running = {"agora-node": "0.1.0", "torch": "2.5.0", "protocol": "agora.v1"}
    assert version_check(running, {}).verdict == UNKNOWN
    assert version_check(running, {"protocol": "agora.v1"}).verdict == OK
    wrong = version_check(running, {"torch": "2.6.0"})
    assert wrong.verdict == FAIL and "torch 2.5.0 (the run: 2.6.0)" in wrong.detail and "torch 2.6.0" in wrong.fix


def test_exit_code_is_1_on_any_failure_and_unknowns_do_not_fail():
    assert exit_code([authorizer_check("a:1", "r", None), unknown("versions", "the run states none")]) == 0
    unreachable = authorizer_check("a:1", None, "the authorizer at a:1 is unreachable")
    assert unreachable.verdict == FAIL and exit_code([unreachable]) == 1
    assert exit_code([refused_check("fingerprint.seed", "fingerprint: seed differs")]) == 1


def test_an_authorizer_under_another_root_is_told_apart_from_an_unreachable_one():
    untrusted = authorizer_check("a:1", None, "presented root CA 2d94..., not the pinned 0000...", untrusted=True)
    assert untrusted.verdict == FAIL and "join file from its operator again" in untrusted.fix
    assert "firewall" in authorizer_check("a:1", None, "unreachable").fix


def test_doctor_without_a_join_file_is_a_usage_error(capsys):
    assert main(["doctor"]) == 2
    assert "--join-file: doctor checks admission to a run" in capsys.readouterr().err


def test_a_refusal_before_the_measurements_names_its_field_and_fix():
    banned = refused_check("banned", "banned: spot checks failed")
    assert (banned.name, banned.verdict, banned.value) == ("admission", FAIL, "banned") and "operator" in banned.fix
    assert "drop the run flags" in refused_check("fingerprint.seed", "seed differs").fix


def test_json_has_every_check_and_no_infinite_numbers():
    checks = [Check("rtt", OK, 0.5, math.inf, "ms"), dataclasses.replace(clock_check(90.0, 60.0))]
    report = json.loads(as_json(checks))
    assert report["exit_code"] == 1 and [c["name"] for c in report["checks"]] == ["rtt", "clock"]
    assert report["checks"][0]["floor"] is None and report["checks"][1]["fix"]
