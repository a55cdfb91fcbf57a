"""`agora-node doctor` against a real authorizer on 127.0.0.1:0 (tests/helpers/authorizer_world.py):
the CheckJoin dry run in-process, and the command itself as one child process per test.

The authorizer runs in the test's event loop; the doctor is a child (`python -m agora.node doctor`)
awaited without blocking that loop, so the authorizer answers it, dial-back included.
"""

from __future__ import annotations

import dataclasses
import json
import time

import grpc
import pytest

from agora.auth.admission import hardware_report
from agora.auth.admitted import read_admitted
from agora.auth.join_check import check_join
from agora.auth.node_state import public_key_pem
from agora.auth.policy import sign_proof
from agora.node.rpc.server import run
from agora.protos import authorizer_adapter as adapter
import authorizer_world as world
from authorizer_world import OPEN, fingerprint_from_config, free_port, join, serving
from doctor_run import run_doctor, write_join_file

pytestmark = pytest.mark.timeout(180)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


def test_a_dry_run_reports_the_measurements_and_takes_no_slot_of_a_full_run(authority, nodes):
    """With room for one worker, a dry run passes the dial-back, names the stage a Join would get,
    and leaves the slot to the next real Join (admitted, not queued)."""
    async def main():
        async with serving(authority, max_workers=1) as (service, address):
            result = await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                      hardware=hardware_report(), announce=("127.0.0.1", free_port()))
            held_after_check = (dict(service._slots.admitted), service._slots.queue(), service.admitted())
            admitted = await join(address, nodes(0), authority)
            return result, held_after_check, admitted

    result, (slots, queue, admitted_nodes), admitted = run(main())
    check = result.check
    assert check.refused is None and check.unreachable == ""
    assert check.stage == 0 and check.rtt_ms > 0 and check.upload_mbit > 0 and check.download_mbit > 0
    assert check.floors.min_upload_mbit == 0 and check.tolerated_skew_s == 60.0
    assert abs(result.skew_s) < 5
    assert slots == {} and queue == [] and admitted_nodes == []
    assert check.members == () and check.probe_credential_pem == b""  # no member to probe: no probe credential
    assert admitted.stage == 0  # the one slot was still free


def test_a_dry_run_is_bounded_as_a_join_is(authority, keys):
    """It needs a join challenge of its own and that challenge's preflight, spends the challenge,
    dials only where a Join's dial-back may (no loopback in a run that is not local), and is
    counted by outcome."""
    outcomes = []

    async def main():
        async with serving(authority, local_network=False, on_join_check=outcomes.append) as (_, address):
            async with world.channel(address, authority) as opened:
                stub = adapter.AuthorizerStub(opened)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="worker"))
                key = keys[0]
                request = adapter.JoinRequest(nonce=challenge.nonce, public_key_pem=public_key_pem(key), role="worker",
                                              fingerprint=world.FINGERPRINT.text(), hardware=hardware_report(),
                                              announce_host="127.0.0.1", announce_port=free_port())
                request = dataclasses.replace(request, signature=sign_proof(key, adapter.signed_payload(request)))
                statuses = []
                for _ in range(2):  # no preflight yet; then the challenge is spent
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.check_join(request)
                    statuses.append((refused.value.code(), refused.value.details().split(':')[0]))
                with pytest.raises(grpc.aio.AioRpcError) as trainer:
                    await stub.check_join(dataclasses.replace(request, role="trainer"))
            result = await check_join(address, authority.root_fingerprint, fingerprint=fingerprint_from_config,
                                      hardware=hardware_report(), announce=("127.0.0.1", free_port()))
            return statuses, trainer.value.code(), result

    statuses, trainer_status, result = run(main())
    assert statuses[0] == (grpc.StatusCode.FAILED_PRECONDITION, "preflight")
    assert statuses[1][0] == grpc.StatusCode.FAILED_PRECONDITION and statuses[1][1] != "preflight"
    assert trainer_status == grpc.StatusCode.INVALID_ARGUMENT
    assert "is unreachable from the authorizer" in result.check.unreachable  # loopback: never dialled
    assert outcomes == ["unreachable"]


def test_a_dry_run_with_another_config_is_refused_before_its_measurements(authority):
    """The checks before the measurements answer as a Join's refusal would, naming the field."""
    outcomes = []
    other_seed = dataclasses.replace(world.FINGERPRINT, seed=world.FINGERPRINT.seed + 1).text()

    async def main():
        async with serving(authority, on_join_check=outcomes.append) as (_, address):
            return await check_join(address, authority.root_fingerprint, fingerprint=lambda served: other_seed,
                                    hardware=hardware_report(), announce=("127.0.0.1", free_port()))

    check = run(main()).check
    assert check.refused.field == "fingerprint.seed" and check.floors is None and check.stage is None
    assert check.probe_credential_pem == b""
    assert outcomes == ["refused"]


def test_a_reachable_node_passes_every_check_and_nothing_is_admitted(authority, tmp_path):
    async def main():
        async with serving(authority) as (service, address):
            outcome = await run_doctor(write_join_file(tmp_path, address, authority), tmp_path, "--json",
                                    "--host", "127.0.0.1", "--port", str(free_port()))
            return outcome, service.admitted(), dict(service._slots.admitted)

    (code, out, err), admitted, slots = run(main())
    report = json.loads(out)
    verdicts = {check["name"]: check["verdict"] for check in report["checks"]}
    assert code == 0 and report["exit_code"] == 0, (out, err)
    assert verdicts == {"authorizer": "ok", "rtt": "ok", "upload": "ok", "download": "ok", "accelerator": "ok",
                        "ram": "ok", "reachability": "ok", "clock": "ok", "memory stage 0": "ok", "disk": "ok",
                        "share stage 0": "ok", "capacity stage 0": "ok", "capacity stage 1": "ok",
                        "capacity stage 2": "ok", "bottleneck": "ok", "versions": "unknown"}
    assert all(set(check) == {"name", "verdict", "value", "floor", "against", "unit", "fix",
                                                "detail"} for check in report["checks"])
    # The dry run admitted nobody, held no slot, wrote nothing to the admission log or a state directory.
    assert admitted == [] and slots == {}
    assert read_admitted(authority.directory, time.time()) == []
    assert not (tmp_path / "state").exists()


def test_an_unreachable_address_and_a_missed_floor_fail_with_exit_1(authority, tmp_path):
    """The node listens on 127.0.0.1 but announces 127.0.0.2, where nothing answers; the run's
    upload floor is out of reach of any link."""
    floors = dataclasses.replace(OPEN, min_upload_mbit=1e9)

    async def main():
        async with serving(authority, floors=floors) as (service, address):
            outcome = await run_doctor(write_join_file(tmp_path, address, authority), tmp_path, "--host", "127.0.0.1",
                                    "--announce-host", "127.0.0.2", "--port", str(free_port()), "--stage", "2")
            return outcome, service.admitted()

    (code, out, err), admitted = run(main())
    lines = {line.split()[1]: line for line in out.splitlines() if line.split()[0] in ("ok", "FAIL", "unknown")}
    assert code == 1, (out, err)
    assert lines["reachability"].startswith("FAIL    reachability     127.0.0.2:")
    assert "is unreachable from the authorizer" in lines["reachability"]
    assert "fix: open or forward" in lines["reachability"]
    assert lines["upload"].startswith("FAIL    upload") and "(floor 1e+09 Mbit/s)" in lines["upload"]
    failed = sorted(name for name, line in lines.items() if line.startswith("FAIL"))
    assert failed == ["reachability", "upload"]
    assert "memory stage 2" in out and "Traceback" not in err
    assert admitted == []


def test_an_unreachable_authorizer_is_one_fail_line_and_exit_1(authority, tmp_path):
    """Nothing listens at the join file's address: one FAIL line naming it, what depends on it
    unknown, no traceback."""
    address = f"127.0.0.1:{free_port()}"
    code, out, err = run(run_doctor(write_join_file(tmp_path, address, authority), tmp_path))
    lines = out.splitlines()
    assert code == 1 and "Traceback" not in err, (out, err)
    assert lines[0].startswith(f"FAIL    authorizer       {address} - the authorizer at {address} is unreachable")
    assert [line.split()[0] for line in lines[1:-1]] == ["unknown"] * (len(lines) - 2)
    assert [line.split()[0] for line in lines if line.startswith("FAIL")] == ["FAIL"]
