"""The admitted nodes an authorizer keeps beside its CA, so a restarted authorizer keeps its slots
and ``agora-node authorizer list`` shows them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["ADMITTED_FILE", "AdmittedNode", "read_admitted"]

ADMITTED_FILE = "admitted.json"


@dataclass(frozen=True)
class AdmittedNode:
    peer_id: str
    role: str
    stage: Optional[int]
    address: str  # the announced host:port (workers), else the caller's address
    device: str
    admitted_at: float
    expires_at: float
    rtt_ms: Optional[float] = None
    upload_mbit: Optional[float] = None
    download_mbit: Optional[float] = None


def read_admitted(state_dir: str | Path) -> list[AdmittedNode]:
    path = Path(state_dir) / ADMITTED_FILE
    if not path.exists():
        return []
    return [AdmittedNode(**entry) for entry in json.loads(path.read_text() or "[]")]
