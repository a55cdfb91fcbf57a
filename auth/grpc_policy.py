"""Who may call what over gRPC: one table, read by the per-call check (node/rpc/auth_check.py).

Design choices:

- A table, not code: each service maps to its methods (or ``*`` for the whole service), each
  method to the roles allowed to call it and whether the request must carry the caller's run
  fingerprint. A method that is not in the table is refused (fail closed): adding an RPC to a
  service without deciding who may call it cannot open it to everyone.
- Roles follow docs/design.md "Admission and trust": only a trainer drives the pipeline (Forward,
  Backward, Abort, Step: a Step with a huge ``completed_batch`` or an Abort of someone else's
  gradient would wreck a stage); Info is read-only, so every role may call it (a monitor's
  whole job, and workers reading each other's state); health checks and reflection are open to
  any credentialed caller (the TLS handshake has already demanded a credential of this run).
- Inference (Prefill, Decode, CloseSession) is open to a client (the role of `agora-node
  generate` and `serve`), a trainer (generating from the model it trains) and an operator (its
  own tools). Not to a worker (a stage has no reason to drive another's sessions) nor a monitor
  (read-only). Inference changes no weights, only the caller's own sessions (bound to it like a
  microbatch, node/inference/sessions.py), and each worker bounds what sessions may hold.
- DownloadState (weight sync: a stage's whole state, node/membership/state_transfer.py) is open to a
  worker, which the handler further holds to its own stage (a contributor never gets more than
  the stage it hosts), and to an operator, whose `agora-node export` gathers every stage. Not to a
  trainer, client or monitor: none of them holds weights, and the state is the run's model.
- DeliverReceipt (a trainer hands a worker the receipt it signed for its work, auth/receipts.py)
  is open to a trainer and an operator, the roles that sign receipts (a worker cannot vouch for
  itself, nor fill another's store); the handler further verifies the receipt itself, bounds its
  size and keeps each one once (node/worker/receipts.py).
- DeliverAttestation (a member of an averaging round hands another the attestation it signed that
  they completed the round together, auth/round_attestations.py) is open to a worker alone, the
  role that takes part in rounds; the handler further holds the caller to its own stage (only the
  stage's replicas average together), verifies the attestation itself, bounds its size, the
  caller's deliveries in flight and the round, and keeps each one once (node/worker/attestations.py).
- ProbeLink (a would-be member times its link to a worker before admission: `agora-node doctor`,
  node/worker/link_probe.py) is the one method open to a ``probe`` credential, the two-minute
  credential a Join's dry run issues (auth/join_check.py), and to an operator (its own tools). No
  other role needs it. Every other method, health and reflection included, refuses a probe
  credential: ``_READ_ONLY`` and ``_PROBE`` name the admitted roles (``ROLES``), which it is not
  one of. The handler further holds the caller to this worker's stage and bounds what one probe
  and one caller may cost.
- The run fingerprint (pipeline/fingerprint.py) travels in the ``agora-run-fingerprint``
  metadata of every Stage request, also under ``--insecure``: a peer started with another seed or
  config is refused at the call, naming the field, instead of computing garbage. Health and
  reflection are exempt: they carry no tensors, and generic probes cannot send it.
- Pure: strings in, a frozen rule out; no grpc, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

from agora.auth.credentials import PROBE_ROLE, ROLES
from agora.auth.receipts import RECEIPT_ROLES
from agora.auth.round_attestations import ATTESTATION_ROLES

__all__ = [
    "FINGERPRINT_METADATA",
    "STAGE_SERVICE",
    "HEALTH_SERVICE",
    "REFLECTION_SERVICES",
    "MethodRule",
    "NODE_POLICY",
    "rule_for",
    "split_method",
]

# gRPC metadata keys are lower-case ASCII.
FINGERPRINT_METADATA = "agora-run-fingerprint"

STAGE_SERVICE = "agora.v1.Stage"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")

_ANY_SERVICE_METHOD = "*"


@dataclass(frozen=True)
class MethodRule:
    """What a caller of one method must present."""

    roles: frozenset[str]  # credential roles allowed to call it
    fingerprint: bool  # the request must carry this run's fingerprint


_TRAINER = MethodRule(frozenset({"trainer"}), fingerprint=True)
_INFERENCE = MethodRule(frozenset({"client", "trainer", "operator"}), fingerprint=True)
_READ_ONLY = MethodRule(frozenset(ROLES), fingerprint=True)
_STATE = MethodRule(frozenset({"worker", "operator"}), fingerprint=True)
_PROBE = MethodRule(frozenset(ROLES), fingerprint=False)
_RECEIPT = MethodRule(frozenset(RECEIPT_ROLES), fingerprint=True)
_ATTESTATION = MethodRule(frozenset(ATTESTATION_ROLES), fingerprint=True)
_LINK_PROBE = MethodRule(frozenset({PROBE_ROLE, "operator"}), fingerprint=True)

# service -> method (or "*") -> rule. Read-only views: the table is a constant.
NODE_POLICY: Mapping[str, Mapping[str, MethodRule]] = MappingProxyType({
    STAGE_SERVICE: MappingProxyType({
        "Forward": _TRAINER,
        "ForwardStream": _TRAINER,
        "Backward": _TRAINER,
        "BackwardStream": _TRAINER,
        "Abort": _TRAINER,
        "Step": _TRAINER,
        "Info": _READ_ONLY,
        "Prefill": _INFERENCE,
        "Decode": _INFERENCE,
        "CloseSession": _INFERENCE,
        "DownloadState": _STATE,
        "DeliverReceipt": _RECEIPT,
        "DeliverAttestation": _ATTESTATION,
        "ProbeLink": _LINK_PROBE,
    }),
    HEALTH_SERVICE: MappingProxyType({_ANY_SERVICE_METHOD: _PROBE}),
    **{name: MappingProxyType({_ANY_SERVICE_METHOD: _PROBE}) for name in REFLECTION_SERVICES},
})


def split_method(full_method: str) -> tuple[str, str]:
    """``"/agora.v1.Stage/Forward"`` -> ``("agora.v1.Stage", "Forward")``; ValueError otherwise."""
    parts = full_method.split("/")
    if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
        raise ValueError(f"not a gRPC method name: {full_method[:120]!r}")
    return parts[1], parts[2]


def rule_for(full_method: str, policy: Mapping[str, Mapping[str, MethodRule]] = NODE_POLICY) -> Optional[MethodRule]:
    """The rule for a full method name, or None when the policy does not name it (refuse it)."""
    try:
        service, method = split_method(full_method)
    except ValueError:
        return None
    methods = policy.get(service)
    if methods is None:
        return None
    return methods.get(method) or methods.get(_ANY_SERVICE_METHOD)
