"""The authorizer's admission log (auth/admitted.py): rows in SQLite beside the CA, one upsert per
admission or renewal, and the one-time import of an older state directory's admitted.json."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest

from agora.auth.admitted import ADMITTED_DB, LEGACY_ADMITTED_FILE, AdmissionLog, AdmittedNode, read_admitted

pytestmark = pytest.mark.timeout(30)


def node(i: int, *, expires_at: float = 1000.0, role: str = "worker") -> AdmittedNode:
    return AdmittedNode(peer_id=f"peer{i}", role=role, stage=i % 3 if role == "worker" else None,
                        address=f"198.51.100.{i}:7000", device="cpu", admitted_at=float(i), expires_at=expires_at,
                        rtt_ms=12.5 if role == "worker" else None)


def test_admissions_are_rows_and_a_renewal_moves_one_expiry(tmp_path):
    log = AdmissionLog(tmp_path, now=0.0)
    for i in range(3):
        log.record(node(i))
    log.record(node(3, role="monitor", expires_at=50.0))
    log.record(dataclasses.replace(node(1), expires_at=2000.0))  # renewed
    log.close()
    assert not (tmp_path / LEGACY_ADMITTED_FILE).exists(), "nothing writes the whole list as JSON"
    assert read_admitted(tmp_path, now=100.0) == [node(0), dataclasses.replace(node(1), expires_at=2000.0), node(2)]
    assert [n.peer_id for n in read_admitted(tmp_path, now=1500.0)] == ["peer1"]
    rows = sqlite3.connect(tmp_path / ADMITTED_DB).execute("SELECT count(*) FROM admitted").fetchone()[0]
    assert rows == 1, "opening the log deleted the rows of expired credentials"


def test_an_older_state_dirs_admitted_json_is_imported_once(tmp_path):
    legacy = [dataclasses.asdict(node(0)), dataclasses.asdict(node(1, expires_at=5.0)),
              dataclasses.asdict(node(2, role="trainer"))]
    (tmp_path / LEGACY_ADMITTED_FILE).write_text(json.dumps(legacy, indent=1))
    log = AdmissionLog(tmp_path, now=10.0)
    assert log.live(10.0) == [node(0), node(2, role="trainer")]
    assert not (tmp_path / LEGACY_ADMITTED_FILE).exists()
    assert json.loads((tmp_path / f"{LEGACY_ADMITTED_FILE}.imported").read_text()) == legacy
    log.record(dataclasses.replace(node(0), expires_at=3000.0))
    log.close()
    again = AdmissionLog(tmp_path, now=10.0)
    assert again.live(10.0) == [dataclasses.replace(node(0), expires_at=3000.0), node(2, role="trainer")]
    again.close()
