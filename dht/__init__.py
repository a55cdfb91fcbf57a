"""agora.dht: the typed layer over hivemind's DHT.

- ``records``: record schemas (``WorkerRecord``, the ``Record`` base) and key names; pure.
- ``swarm``: ``SwarmDHT``, the one owner of the hivemind DHT process and its futures.
- ``ownership``: which per-peer entries a reader believes (owner key, peer id, fingerprint).
- ``averaging``: ``SliceAverager`` (hivemind's averager, with credential checks) and the
  rounds board.
- ``heartbeat``: ``Heartbeat``, keeps a worker's record alive while the worker is.
- ``bootstrap``: ``run_bootstrap``, the ``agora-node bootstrap`` role (import it from
  ``agora.dht.bootstrap``; not re-exported here so ``python -m agora.dht.bootstrap`` runs
  the module once, as ``__main__`` only).
"""

from agora.dht.heartbeat import Heartbeat
from agora.dht.records import PHASES, SCHEMA_VERSION, Record, RecordError, WorkerRecord, worker_key
from agora.dht.swarm import DHTRequestError, Stored, SwarmDHT

__all__ = [
    "PHASES",
    "SCHEMA_VERSION",
    "DHTRequestError",
    "Heartbeat",
    "Record",
    "RecordError",
    "Stored",
    "SwarmDHT",
    "WorkerRecord",
    "worker_key",
]
