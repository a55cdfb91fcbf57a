"""Round attestations: a worker's signed statement that another member completed an averaging round with it.

What an attestation says (``RoundAttestation``): in run ``run_id``, worker ``attester`` of stage
``stage`` completed averaging round ``round`` of that stage (a committed all-reduce,
dht/averaging.py) in one group with worker ``attested``, at ``completed_at`` (seconds since the
epoch, the attester's wall clock, when it signed).

Why another member signs it: a trainer never sees the background averaging of a stage's replicas,
so it cannot receipt it (auth/receipts.py), and a worker's own count of its rounds is only its
claim. The members of a round are the ones who saw each other take part: each one that completed
it attests every other (node/averaging/round_attestations.py) and hands the attestation to the
member it names, which keeps it (node/worker/attestations.py). A contributor's rounds are then
the rounds at least one other member attests.

Design choices:

- **Who signs**: a ``worker`` credential of the attestation's stage, the attester's own (its node
  key, its chain carried with the attestation): signing, the offline chain check and the JSON form
  are every signed statement's (auth/signed_statements.py), under the domain tag ``agora-round-v1``,
  so neither a receipt's signature nor any other payload's is ever an attestation's.
- **Never of oneself** (``self_attested``): a worker may sign anything about itself, so an
  attestation whose attester is the attested worker proves nothing and is refused wherever it is
  read, by the worker it names and by ``agora-node ledger verify``.
- **Bounded before anything else** (``attestation_problem``): base58 peer ids, a stage and a
  round that are non-negative integers, a finite time.
- **Addressed** (``verify_addressed_attestation``): the worker it names keeps it only when it
  names this worker and this worker's stage; the worker also bounds the round by its own count and
  keeps one per attester and round (node/worker/attestations.py).
- **The fields are fixed** (``agora-round-v1``): readers require exactly these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from cryptography.hazmat.primitives.asymmetric import rsa

from agora.auth.credentials import CredentialVerifier, Identity
from agora.auth.signed_statements import (STATEMENT_REFUSALS, StatementError, count_problem, peer_id_problem,
                                          run_id_problem, sign_statement, statement_from_json, statement_to_json,
                                          time_problem, verify_statement)

__all__ = ["ATTESTATION_KIND", "ATTESTATION_REFUSALS", "ATTESTATION_ROLES", "KEPT_ATTESTATION_REFUSALS",
           "RoundAttestation", "SignedAttestation", "attestation_from_json", "attestation_problem",
           "attestation_to_json", "sign_attestation", "verify_addressed_attestation", "verify_attestation"]

ATTESTATION_KIND = "attestation"  # its key in the JSON form, and its name in messages
ATTESTATION_ROLES = ("worker",)  # only a member of the round, a worker of its stage, attests it
_DOMAIN = b"agora-round-v1\0"
# Why an attestation is refused wherever it is read.
ATTESTATION_REFUSALS = STATEMENT_REFUSALS + ("wrong_stage", "self_attested")
# Why the worker an attestation names refuses it (node/worker/attestations.py): those, one naming
# another worker, a round far from its own count, one over the size an attestation has, a caller
# with too many deliveries in flight, or none can be verified (no root: --insecure).
KEPT_ATTESTATION_REFUSALS = ATTESTATION_REFUSALS + ("wrong_worker", "far_round", "oversized", "busy", "no_root")


@dataclass(frozen=True)
class RoundAttestation:
    """``attester`` completed averaging round ``round`` of ``stage`` with ``attested`` (module docstring)."""

    run_id: str
    stage: int
    round: int
    attester: str  # the signing worker's peer id
    attested: str  # the peer id of the member it vouches for
    completed_at: float  # seconds since the epoch, when it was signed


@dataclass(frozen=True)
class SignedAttestation:
    attestation: RoundAttestation
    chain_pem: bytes  # the attester's credential: leaf + issuing CA
    signature: bytes


def attestation_problem(attestation: RoundAttestation) -> Optional[str]:
    """None when every field is within bounds, else one line naming the field."""
    problems = (run_id_problem(attestation.run_id), count_problem("stage", attestation.stage),
                count_problem("round", attestation.round), peer_id_problem("attester", attestation.attester),
                peer_id_problem("attested", attestation.attested),
                time_problem("completed_at", attestation.completed_at))
    return next((problem for problem in problems if problem is not None), None)


def sign_attestation(attestation: RoundAttestation, key: rsa.RSAPrivateKey, chain_pem: bytes) -> SignedAttestation:
    """``attestation`` signed with the attester's node ``key``, carrying its credential ``chain_pem``."""
    problem = attestation_problem(attestation)
    if problem is not None:
        raise ValueError(f"attestation: {problem}")
    return SignedAttestation(attestation, chain_pem, sign_statement(_DOMAIN, attestation, key))


def verify_attestation(signed: SignedAttestation, verifier: CredentialVerifier) -> Identity:
    """The attester's identity when ``signed`` is a valid attestation of ``verifier``'s run, of one
    worker by another, signed by the attester it names with a worker credential of its stage while
    that credential was valid; else StatementError."""
    attestation = signed.attestation
    problem = attestation_problem(attestation)
    if problem is not None:
        raise StatementError("malformed", f"attestation: {problem}")
    if attestation.attester == attestation.attested:
        raise StatementError("self_attested", f"attester: {attestation.attester[:16]}... attests itself; a round "
                                              "counts only when another member attests it")
    return verify_statement(attestation, signed.chain_pem, signed.signature, verifier, domain=_DOMAIN,
                            kind=ATTESTATION_KIND, roles=ATTESTATION_ROLES, signer_field="attester",
                            signed_at_field="completed_at", stage=attestation.stage)


def verify_addressed_attestation(signed: SignedAttestation, verifier: CredentialVerifier, worker: str,
                                 stage: int) -> Identity:
    """``verify_attestation``, for the worker it names: one naming another worker (``wrong_worker``) or
    another stage than the worker's (``wrong_stage``) is refused first."""
    attestation = signed.attestation
    if attestation.attested != worker:
        raise StatementError("wrong_worker", f"attested: the attestation is for worker "
                                             f"{str(attestation.attested)[:16]}..., this is {worker[:16]}...")
    if attestation.stage != stage:
        raise StatementError("wrong_stage", f"stage: the attestation is of a round of stage {attestation.stage!r}, "
                                            f"this worker hosts stage {stage}")
    return verify_attestation(signed, verifier)


def attestation_to_json(signed: SignedAttestation) -> dict[str, Any]:
    return statement_to_json(ATTESTATION_KIND, signed.attestation, signed.chain_pem, signed.signature)


def attestation_from_json(value: Any) -> SignedAttestation:
    """A signed attestation from its JSON form; StatementError (malformed) naming the field otherwise."""
    return SignedAttestation(*statement_from_json(value, ATTESTATION_KIND, RoundAttestation))
