"""Who may average with a node: the credential it sends with each round and the gate that checks it.

The protocol (what travels in the gather metadata, who checks it when) is in dht/averaging.py's
module docstring; this module holds the picklable admission the averager process is started with
and the pure check it runs there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hivemind.utils.serializer import MSGPackSerializer

from agora.auth.credentials import CredentialError, CredentialVerifier
from agora.auth.node_state import CREDENTIAL_FILE
from agora.dht.security import DHTSecurity

__all__ = ["CREDENTIAL_FIELD", "AdmissionGate", "AveragingAdmission"]

logger = logging.getLogger("agora.dht.averaging")  # one logger for everything averaging says

# The gather metadata field that carries the sender's credential chain (PEM bytes).
CREDENTIAL_FIELD = "credential"


@dataclass(frozen=True)
class AveragingAdmission:
    """Who may average with this node: workers of ``run_id`` at ``stage`` under the pinned root.

    ``state_dir`` is the node's own credential directory, read every round for the chain it
    sends (None: the caller passes ``credential=`` to ``average``). Picklable: the averager
    process builds its verifier from it.
    """

    root_pem: bytes
    run_id: str
    stage: int
    state_dir: Optional[str] = None

    @classmethod
    def for_node(cls, security: DHTSecurity, stage: int) -> "AveragingAdmission":
        """An admitted node's averaging at ``stage``: its run's root and run, its own state directory."""
        return cls(root_pem=security.root_pem, run_id=security.run_id, stage=stage, state_dir=str(security.state_dir))

    def current_credential(self) -> Optional[bytes]:
        if self.state_dir is None:
            return None
        return (Path(self.state_dir) / CREDENTIAL_FILE).read_bytes()



class AdmissionGate:
    """The averager process's credential check (built there, from a picklable admission); pure:
    ``problem`` takes a peer's gather bytes as hivemind sends them and the peer id libp2p names."""

    def __init__(self, admission: AveragingAdmission):
        self.admission = admission
        self.verifier = CredentialVerifier(admission.root_pem, admission.run_id, clock=time.time)
        self.banned: frozenset[str] = frozenset()  # the run's ban list, as the owner last sent it
        self._warned: set[str] = set()

    def problem(self, data_for_gather: bytes, peer_id: str) -> Optional[str]:
        """Why a peer's gather does not admit it to this stage's rounds, or None if it does."""
        if peer_id in self.banned:
            return "banned: the run's operator banned it"
        try:  # hivemind's envelope: [bandwidth, mode, msgpack(user gather)]
            _, _, user = MSGPackSerializer.loads(data_for_gather)
            chain = MSGPackSerializer.loads(user).get(CREDENTIAL_FIELD)
        except Exception:  # noqa: BLE001 - anything a peer sends must become a refusal, not a crash
            return "malformed gather metadata"
        if not isinstance(chain, bytes):
            return "no credential in its gather metadata"
        try:
            identity = self.verifier.verify(chain, roles=("worker",), stage=self.admission.stage)
        except CredentialError as error:
            return f"{error.reason}: {error}"
        if identity.peer_id != peer_id:
            return f"wrong_key: it presents the credential of {identity.peer_id}"
        return None

    def warn(self, message: str) -> None:
        level = logging.DEBUG if message in self._warned else logging.WARNING
        if len(self._warned) < 1024:
            self._warned.add(message)
        logger.log(level, "%s", message)
