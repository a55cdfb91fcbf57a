"""The bar at which trainers' reports ban a worker, and the bounds on a report (auth/reports.py): pure."""

from __future__ import annotations

import math

import pytest

from agora.auth.reports import MAX_LABEL_CHARS, MAX_REASON_CHARS, ReportBar, report_problem
from agora.auth.settings import AuthorizerSettings
from agora.pipeline.schema import ConfigError, checked
from agora.protos.authorizer_adapter import WorkerReport

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_by_default_one_trainers_report_bans():
    verdict = ReportBar().verdict([("trainer-a", 100.0)], now=100.0)
    assert verdict.ban and verdict.reporters == {"trainer-a"}
    assert AuthorizerSettings().report_bar == ReportBar(ban_after_reports=1, window_s=3600.0)


def test_distinct_trainers_count_not_reports():
    bar = ReportBar(ban_after_reports=2, window_s=60.0)
    assert not bar.verdict([("trainer-a", 10.0), ("trainer-a", 20.0), ("trainer-a", 30.0)], now=30.0).ban
    verdict = bar.verdict([("trainer-a", 10.0), ("trainer-b", 30.0)], now=30.0)
    assert verdict.ban and verdict.reporters == {"trainer-a", "trainer-b"}


def test_reports_older_than_the_window_do_not_count():
    bar = ReportBar(ban_after_reports=2, window_s=60.0)
    verdict = bar.verdict([("trainer-a", 10.0), ("trainer-b", 80.0)], now=80.0)
    assert not verdict.ban and verdict.reporters == {"trainer-b"}
    assert bar.verdict([("trainer-a", 20.0), ("trainer-b", 80.0)], now=80.0).ban  # exactly the window's age


def test_a_bar_of_zero_keeps_reports_and_never_bans():
    verdict = ReportBar(ban_after_reports=0).verdict([(f"trainer-{i}", 5.0) for i in range(10)], now=5.0)
    assert not verdict.ban and len(verdict.reporters) == 10


@pytest.mark.parametrize("refusal, settings", [
    ("authorizer.ban_after_reports: must be >= 0, got -1", {"ban_after_reports": -1}),
    ("authorizer.report_window_s: must be > 0, got 0.0", {"report_window_s": 0.0}),
    ("authorizer.report_window_s: must be > 0, got nan", {"report_window_s": math.nan}),
])
def test_a_bad_bar_is_refused_naming_the_field(refusal, settings):
    with pytest.raises(ConfigError) as refused:
        checked(AuthorizerSettings, "authorizer", **settings)
    assert str(refused.value) == refusal


def _report(**fields) -> WorkerReport:
    return WorkerReport(**{"nonce": b"", "credential_pem": b"", "peer_id": PEER, "stage": 1, "kind": "output",
                           "feature": "log_rms", "cusum": 31.5, "replies": 40, "reason": "log_rms high", **fields})


def test_a_report_within_bounds_passes():
    assert report_problem(_report(), stages=2) is None


@pytest.mark.parametrize("field, fields", [
    ("peer_id", {"peer_id": "not a peer id"}),
    ("peer_id", {"peer_id": "Qm" + "z" * 200}),
    ("stage", {"stage": 2}),
    ("kind", {"kind": ""}),
    ("feature", {"feature": "x" * (MAX_LABEL_CHARS + 1)}),
    ("reason", {"reason": "x" * (MAX_REASON_CHARS + 1)}),
    ("cusum", {"cusum": math.inf}),
    ("cusum", {"cusum": -1.0}),
])
def test_a_report_out_of_bounds_is_refused_naming_the_field(field, fields):
    problem = report_problem(_report(**fields), stages=2)
    assert problem is not None and problem.startswith(f"{field}: "), problem
