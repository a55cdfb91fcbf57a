"""agora.dht: the typed layer over hivemind's DHT.

- ``records``: record schemas (``WorkerRecord``, the ``Record`` base) and their wire form; pure.
- ``record_fields``: the field types and bounds records and keys are checked with, ``RecordError``.
- ``keys``: the names of the DHT keys (``worker_key``, ...) and of owned subkeys; pure.
- ``key_families``: which record type each key holds, who may write it, how long it may live.
- ``swarm``: ``SwarmDHT``, the one owner of the hivemind DHT process and its futures.
- ``dht_process``: that process: forked, orphan watch, stopped and reaped.
- ``entry_reader``: what a read makes of found values (``Stored`` records it believes, the rest counted).
- ``ownership``: which per-peer entries a reader believes (owner key, peer id, fingerprint).
- ``security``: admission on the DHT (``DHTSecurity``): the token authorizer and record validators.
- ``token_authorizer``: ``CredentialTokenAuthorizer``, the access tokens of admitted peers.
- ``chain_references``: when a token may name its sender's chain instead of carrying it (pure).
- ``entry_value``: what a typed entry's value carries (record, writer's chain, owner's signature).
- ``entry_chains``: a changed find's answer naming the writers' chains its reader holds (pure, and the reader's memory).
- ``averaging``: ``SliceAverager`` (hivemind's averager, with credential checks).
- ``averaging_admission``: the credential a round carries and the averager process's check of it.
- ``round_board``: ``RoundBoard``, which round the stage's replicas are in and how many live.
- ``heartbeat``: ``Heartbeat``, keeps a worker's record alive while the worker is.
- ``bootstrap``: ``run_bootstrap``, the ``agora-node bootstrap`` role (import it from
  ``agora.dht.bootstrap``; not re-exported here so ``python -m agora.dht.bootstrap`` runs
  the module once, as ``__main__`` only).

The names below are loaded when first used: ``swarm`` imports hivemind (and with it torch, seconds),
which a command that only reads its flags or a record never needs.
"""

import importlib

_HOMES = {"Heartbeat": "heartbeat", "PHASES": "records", "SCHEMA_VERSION": "records", "Record": "records",
          "RecordError": "record_fields", "WorkerRecord": "records", "worker_key": "keys",
          "DHTRequestError": "swarm", "Stored": "entry_reader", "SwarmDHT": "swarm"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
