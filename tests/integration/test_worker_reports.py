"""Trainers' reports of flagged workers over the real authorizer (grpc.aio on 127.0.0.1:0, TLS under the
run's root), sent by the trainer's own reporter (node/trainer/reports.py): a trainer's report bans an
admitted worker through the authority's ban list, and the worker's renewal is then refused; the bar of
several trainers counts distinct ones; a worker's credential, a credential of another run, a report
over the bounds and a report about a peer that is no admitted worker are refused and counted, nothing
banned. Where the flag comes from a live trainer's verifier: tests/integration/test_reply_verification.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import grpc
import pytest

from agora.auth.admission import CredentialRenewer, RenewalRefused
from agora.auth.authority import RunAuthority
from agora.auth.policy import sign_proof
from agora.auth.reports import MAX_REASON_CHARS, ReportLog
from agora.monitor.metrics import sample_value
from agora.node.rpc.server import run
from agora.node.trainer.reports import WorkerReports, send_report
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.protos import authorizer_adapter as adapter
import authorizer_world as world
from authorizer_world import channel, join, serving

pytestmark = pytest.mark.timeout(60)

authority, keys, nodes = world.authority, world.keys, world.nodes  # fixtures


def _evidence(peer_id: str, stage: int = 0) -> Evidence:
    return Evidence(stage=stage, kind="output", peer=peer_id, feature="log_rms", direction="high", cusum=31.5,
                    value=2.3, mean=2.1, centre=0.0, spread=0.1, replies=40)


@pytest.fixture
def unbanned(authority):
    """Lift the bans a test leaves (the authority is the module's)."""
    yield
    for peer in list(authority.bans()):
        authority.unban(peer)


def test_a_trainers_report_bans_the_worker_everywhere_the_ban_list_reaches(authority, nodes, unbanned):
    worker, trainer = nodes(0), nodes(1)
    outcomes: Counter = Counter()
    counted = dict(on_report=lambda outcome: outcomes.update([outcome]))

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, **counted) as (service, address):
            await join(address, worker, authority)
            await join(address, trainer, authority, role="trainer")
            receipt = await send_report(address, trainer, _evidence(worker.peer_id), timeout_s=10)
            # The worker's next renewal is refused: it leaves within one lifetime.
            with pytest.raises(RenewalRefused) as refused:
                await CredentialRenewer(address, worker, on_revoked=pytest.fail).renew_once()
            return receipt, refused.value, service.admitted()

    receipt, refused, admitted = run(main())
    assert receipt == adapter.ReportReceipt(reporters=1, needed=1, banned=True)
    ban = authority.is_banned(worker.peer_id)
    assert ban is not None and trainer.peer_id in ban.reason and "stage 0 output log_rms" in ban.reason, ban
    assert refused.code is grpc.StatusCode.PERMISSION_DENIED and refused.reason.startswith("banned: flagged by 1")
    assert worker.peer_id not in [node.peer_id for node in admitted], "the banned worker's slot is freed"
    assert outcomes == {"banned": 1}
    # Kept beside the admissions: who reported whom, with the evidence.
    log = ReportLog(authority.directory)
    try:
        [stored] = log.about(worker.peer_id, since=0.0)
    finally:
        log.close()
    assert (stored.reporter, stored.stage, stored.kind, stored.feature, stored.cusum, stored.replies) == (
        trainer.peer_id, 0, "output", "log_rms", 31.5, 40)
    assert "CUSUM 31.5 after 40 replies" in stored.reason


def test_with_a_bar_of_two_trainers_one_trainer_reporting_twice_bans_nobody(authority, nodes, unbanned):
    worker, first, second = nodes(0), nodes(1), nodes(2)

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, ban_after_reports=2) as (service, address):
            await join(address, worker, authority)
            for trainer in (first, second):
                await join(address, trainer, authority, role="trainer")
            receipts = [await send_report(address, first, _evidence(worker.peer_id), timeout_s=10) for _ in range(2)]
            banned_before = authority.is_banned(worker.peer_id)
            receipts.append(await send_report(address, second, _evidence(worker.peer_id), timeout_s=10))
            return receipts, banned_before

    receipts, banned_before = run(main())
    assert [(r.reporters, r.needed, r.banned) for r in receipts] == [(1, 2, False), (1, 2, False), (2, 2, True)]
    assert banned_before is None
    ban = authority.is_banned(worker.peer_id)
    assert ban is not None and first.peer_id in ban.reason and second.peer_id in ban.reason


async def _refused(address: str, authority: RunAuthority, sender, report: adapter.WorkerReport) -> grpc.aio.AioRpcError:
    """Send `report` signed by `sender`'s key over a fresh renewal challenge; the status it got."""
    async with channel(address, authority) as opened:
        stub = adapter.AuthorizerStub(opened)
        challenge = await stub.get_challenge(adapter.ChallengeRequest(role="trainer", renewal=True))
        report = replace(report, nonce=challenge.nonce)
        report = replace(report, signature=sign_proof(sender.key, adapter.signed_payload(report)))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.report(report, timeout=10)
    return refused.value


def test_reports_from_a_worker_another_run_or_over_the_bounds_are_refused_and_counted(authority, nodes, tmp_path,
                                                                                     unbanned):
    worker, other_worker, trainer = nodes(0), nodes(1), nodes(2)
    stranger = RunAuthority(tmp_path / "other-run", run_id="other-run").mint(tmp_path / "stranger", role="trainer")
    outcomes: Counter = Counter()
    counted = dict(on_report=lambda outcome: outcomes.update([outcome]))

    async def main():
        async with serving(authority, credential_lifetime_s=600.0, **counted) as (service, address):
            await join(address, worker, authority)
            await join(address, other_worker, authority)
            await join(address, trainer, authority, role="trainer")

            def report(sender, peer_id: str = worker.peer_id, **fields) -> adapter.WorkerReport:
                fields = {"stage": 0, "kind": "output", "feature": "log_rms", "cusum": 31.5, "replies": 40, **fields}
                return adapter.WorkerReport(nonce=b"", credential_pem=sender.current()[0], peer_id=peer_id, **fields)
            return {
                "worker": await _refused(address, authority, other_worker, report(other_worker)),
                "stranger": await _refused(address, authority, stranger, report(stranger)),
                "oversized": await _refused(address, authority, trainer,
                                            report(trainer, reason="x" * (MAX_REASON_CHARS + 1))),
                "stage": await _refused(address, authority, trainer, report(trainer, stage=7)),
                "not_a_worker": await _refused(address, authority, trainer, report(trainer, peer_id=trainer.peer_id)),
            }

    refused = run(main())
    codes = {case: error.code() for case, error in refused.items()}
    assert codes == {"worker": grpc.StatusCode.PERMISSION_DENIED, "stranger": grpc.StatusCode.UNAUTHENTICATED,
                     "oversized": grpc.StatusCode.INVALID_ARGUMENT, "stage": grpc.StatusCode.INVALID_ARGUMENT,
                     "not_a_worker": grpc.StatusCode.NOT_FOUND}
    assert refused["worker"].details() == "role: only a trainer reports workers; this is a worker credential"
    assert refused["oversized"].details().startswith(f"reason: at most {MAX_REASON_CHARS} characters")
    assert "not an admitted worker of this run" in refused["not_a_worker"].details()
    assert outcomes == {"permission_denied": 1, "unauthenticated": 1, "invalid_argument": 2, "not_found": 1}
    assert authority.bans() == {}


def test_the_trainer_reports_each_worker_once_and_counts_a_report_it_could_not_send(authority, nodes, unbanned):
    worker, trainer = nodes(0), nodes(1)
    stats = TrainerStats()

    async def main():
        async with serving(authority, credential_lifetime_s=600.0) as (service, address):
            await join(address, worker, authority)
            await join(address, trainer, authority, role="trainer")
            async with WorkerReports(address, trainer, stats) as reports:
                for _ in range(3):  # flagged again for replies still in flight: one report
                    reports.flagged(_evidence(worker.peer_id))
        # The authorizer is gone: a retried report gives up after its attempts, counted, never raised.
        async with WorkerReports(address, trainer, stats, attempts=2, retry_initial_s=0.01, rpc_timeout_s=2,
                                 close_grace_s=30) as unreachable:
            unreachable.flagged(_evidence("QmNoSuchWorkerNoSuchWorkerNoSuchWorkerNoSuchW"))
        return reports.receipts, unreachable.receipts

    receipts, unreachable = run(main())
    assert receipts == {worker.peer_id: adapter.ReportReceipt(reporters=1, needed=1, banned=True)}
    assert unreachable == {}
    assert sample_value(stats.registry, "agora_trainer_worker_reports_total", {"outcome": "sent"}) == 1
    assert sample_value(stats.registry, "agora_trainer_worker_reports_total", {"outcome": "failed"}) == 1


def test_a_report_is_signed_over_every_field(authority, nodes, unbanned):
    """A report whose evidence was altered after signing does not verify (the proof covers the fields)."""
    worker, trainer = nodes(0), nodes(1)

    async def main():
        async with serving(authority, credential_lifetime_s=600.0) as (service, address):
            await join(address, worker, authority)
            await join(address, trainer, authority, role="trainer")
            async with channel(address, authority) as opened:
                stub = adapter.AuthorizerStub(opened)
                challenge = await stub.get_challenge(adapter.ChallengeRequest(role="trainer", renewal=True))
                report = adapter.WorkerReport(nonce=challenge.nonce, credential_pem=trainer.current()[0],
                                              peer_id=worker.peer_id, stage=0, kind="output", feature="log_rms",
                                              cusum=31.5, replies=40)
                signed = replace(report, signature=sign_proof(trainer.key, adapter.signed_payload(report)))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.report(replace(signed, peer_id=trainer.peer_id), timeout=10)
            return refused.value

    refused = run(main())
    assert refused.code() is grpc.StatusCode.UNAUTHENTICATED and "proof of possession" in refused.details()
    assert authority.bans() == {}
