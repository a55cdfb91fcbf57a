"""Credentials: X.509 certificates from the run's CA, what they say, and how a peer checks them.

Design choices (the bar is SPIFFE/SPIRE's: short-lived workload identities from a short-lived
issuing CA, verified locally):

- Three tiers. A long-lived *root* (its SHA-256 fingerprint is what nodes pin) signs a 24-hour
  *issuing CA*, which signs 1-hour *credentials*. The authorizer rotates the issuing CA at half
  life; credentials carry their chain (leaf + issuing CA), so peers trust the root alone and
  never need a new trust bundle.
- A credential certifies the node's own public key (auth/keys.py: the same key is its libp2p
  identity, so the peer id is derived from the certified key, never claimed). What it grants is
  in its subject alternative names:
  - a URI ``agora://<run>/<role>/<stage or ->/<peer id>``: run, role, stage, identity;
  - a DNS name ``server_name(role, stage, peer_id)``: a client dialling a worker sets the TLS
    target name to the one it expects from the worker's DHT record, so the TLS handshake itself
    proves that whoever answers holds a credential for that peer, role and stage.
- ``ROLES`` are the roles of admitted nodes, and every check whose caller names no roles takes
  only those. A ``probe`` credential (``PROBE_ROLE``) is no admission: the authorizer hands one
  to a Join's dry run (auth/join_check.py) for two minutes, for the stage it would assign, so
  `agora-node doctor` can measure its links to that stage's members over mutual TLS. It parses and
  verifies like any other, but only a check that names ``probe`` takes it (the one gRPC method open
  to it, auth/grpc_policy.py); it is a client certificate only (no server use), so nothing can
  answer a dial with it.
- ``CredentialVerifier`` checks a chain against the pinned root with ``cryptography``'s X.509
  verifier (path building, signatures, validity periods, CA constraints), then the run and the
  role. Parsing is cached by the certificate bytes; time checks run on every call.
- Times are seconds since the epoch from an injected clock, so tests can age credentials.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from agora.auth.keys import peer_id_of

__all__ = [
    "ROLES",
    "PROBE_ROLE",
    "CREDENTIAL_ROLES",
    "STAGE_ROLES",
    "CLOCK_SKEW_S",
    "Clock",
    "CredentialError",
    "Identity",
    "Issuer",
    "CredentialVerifier",
    "certificate_fingerprint",
    "identity_uri",
    "issue_credential",
    "issue_authorizer_certificate",
    "AUTHORIZER_SERVER_NAME",
    "load_chain",
    "make_issuing_ca",
    "make_root_ca",
    "parse_identity",
    "server_name",
    "split_pem",
]

# A client runs inference through the swarm (`agora-node generate` / `serve`): it reads the DHT
# and calls the workers' inference methods, nothing else (auth/grpc_policy.py).
ROLES = ("worker", "trainer", "monitor", "operator", "client")
# A Join's dry run's credential: a link probe of one stage's members, nothing else (module docstring).
PROBE_ROLE = "probe"
CREDENTIAL_ROLES = (*ROLES, PROBE_ROLE)  # every role a credential may carry
STAGE_ROLES = frozenset({"worker", PROBE_ROLE})  # roles whose credential names one pipeline stage
_URI = re.compile(r"agora://(?P<run>[A-Za-z0-9_-]{1,64})/(?P<role>[a-z]+)/(?P<stage>-|\d{1,4})/(?P<peer>[1-9A-HJ-NP-Za-km-z]{10,128})")

Clock = Callable[[], float]
# The TLS name of the authorizer's certificate: outside the names credentials carry
# (``<hash>.<role>[-<stage>].agora``), so no admitted node can answer for it.
AUTHORIZER_SERVER_NAME = "authorizer.agora"

# Certificates are valid from this long before they are issued, for peers whose clocks run
# behind; a credential's useful lifetime is therefore not_after - not_before - CLOCK_SKEW_S.
CLOCK_SKEW_S = 60.0


class CredentialError(ValueError):
    """A credential that does not grant what was asked; ``reason`` is a short machine-readable code
    (``untrusted``, ``expired``, ``not_yet_valid``, ``wrong_run``, ``wrong_role``, ``wrong_stage``,
    ``malformed``, ``wrong_key``) and the message one readable line."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Identity:
    """What a verified credential says about its holder."""

    run_id: str
    role: str
    stage: Optional[int]
    peer_id: str
    not_before: float
    not_after: float
    serial: int

    def remaining_s(self, now: float) -> float:
        return self.not_after - now

    def describe(self) -> str:
        where = f" stage {self.stage}" if self.stage is not None else ""
        return f"{self.role}{where} {self.peer_id[:16]}... of run {self.run_id!r}"


def identity_uri(run_id: str, role: str, stage: Optional[int], peer_id: str) -> str:
    return f"agora://{run_id}/{role}/{'-' if stage is None else stage}/{peer_id}"


def server_name(role: str, stage: Optional[int], peer_id: str) -> str:
    """The DNS name a credential carries for TLS target-name checks (peer ids are case-sensitive
    base58, DNS is not: the label is a hash of the peer id)."""
    label = hashlib.sha256(peer_id.encode()).hexdigest()[:32]
    return f"{label}.{role}{'' if stage is None else f'-{stage}'}.agora"


def certificate_fingerprint(pem_or_der: bytes) -> str:
    """SHA-256 of a certificate's DER bytes, hex: what an operator prints and a node pins."""
    cert = _load(pem_or_der)
    return cert.fingerprint(hashes.SHA256()).hex()


def split_pem(chain_pem: bytes) -> list[bytes]:
    """The PEM blocks of a chain, leaf first."""
    blocks = re.findall(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----\s*", chain_pem, re.S)
    return [block.strip() + b"\n" for block in blocks]


def load_chain(chain_pem: bytes) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as error:
        raise CredentialError("malformed", f"credential: not a PEM certificate chain ({error})") from None
    if not certs:
        raise CredentialError("malformed", "credential: empty certificate chain")
    return certs


def _load(pem_or_der: bytes) -> x509.Certificate:
    if pem_or_der.lstrip().startswith(b"-----"):
        return x509.load_pem_x509_certificate(pem_or_der)
    return x509.load_der_x509_certificate(pem_or_der)


def _utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "agora-node"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64])])


def _ca_certificate(subject: x509.Name, public_key: rsa.RSAPublicKey, issuer: x509.Name,
                    signing_key: rsa.RSAPrivateKey, issuer_public: rsa.RSAPublicKey, not_before: float,
                    not_after: float, path_length: Optional[int]) -> x509.Certificate:
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(not_before)).not_valid_after(_utc(not_after))
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public), critical=False)
        .sign(signing_key, hashes.SHA256())
    )


@dataclass(frozen=True)
class Issuer:
    """A CA that signs: its key and certificate (root or issuing CA)."""

    key: rsa.RSAPrivateKey
    certificate: x509.Certificate

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def not_after(self) -> float:
        return self.certificate.not_valid_after_utc.timestamp()

    @property
    def not_before(self) -> float:
        return self.certificate.not_valid_before_utc.timestamp()


def make_root_ca(run_id: str, key: rsa.RSAPrivateKey, *, now: float, lifetime_s: float) -> Issuer:
    """The run's trust anchor (self-signed); its fingerprint is what every node pins."""
    name = _name(f"agora root CA of run {run_id}")
    cert = _ca_certificate(name, key.public_key(), name, key, key.public_key(), now - CLOCK_SKEW_S, now + lifetime_s,
                           path_length=1)
    return Issuer(key, cert)


def make_issuing_ca(root: Issuer, key: rsa.RSAPrivateKey, *, now: float, lifetime_s: float) -> Issuer:
    """A short-lived CA under the root that signs credentials; never outlives the root."""
    not_after = min(now + lifetime_s, root.not_after)
    name = _name(f"agora issuing CA {int(now)}")
    cert = _ca_certificate(name, key.public_key(), root.certificate.subject, root.key,
                           root.key.public_key(), now - CLOCK_SKEW_S, not_after, path_length=0)
    return Issuer(key, cert)


def issue_credential(issuer: Issuer, public_key: rsa.RSAPublicKey, *, run_id: str, role: str,
                     stage: Optional[int], now: float, lifetime_s: float) -> bytes:
    """A credential for ``public_key``: the leaf certificate and the issuing CA, PEM, leaf first.

    Its lifetime is capped by the issuing CA's (so a chain never holds an expired link while its
    leaf is valid). A probe credential is for client use only (module docstring)."""
    if role not in CREDENTIAL_ROLES:
        raise ValueError(f"role: expected one of {', '.join(CREDENTIAL_ROLES)}, got {role!r}")
    if (role in STAGE_ROLES) != (stage is not None):
        raise ValueError(f"stage: a {role} credential {'needs' if role in STAGE_ROLES else 'takes no'} stage")
    peer_id = peer_id_of(public_key)
    names = [x509.UniformResourceIdentifier(identity_uri(run_id, role, stage, peer_id)),
             x509.DNSName(server_name(role, stage, peer_id))]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if role == PROBE_ROLE else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                                           ExtendedKeyUsageOID.CLIENT_AUTH]
    return _leaf(issuer, public_key, f"{role} {peer_id}", names, usages, now=now,
                 not_after=min(now + lifetime_s, issuer.not_after))


def issue_authorizer_certificate(issuer: Issuer, public_key: rsa.RSAPublicKey, *, now: float,
                                 lifetime_s: float) -> bytes:
    """The authorizer's TLS server certificate, leaf + issuing CA (PEM). It names only
    ``AUTHORIZER_SERVER_NAME`` (no agora:// identity, so it is no credential), and no credential
    carries that name, so a node expecting it talks to the authorizer and to no admitted peer."""
    return _leaf(issuer, public_key, "agora authorizer", [x509.DNSName(AUTHORIZER_SERVER_NAME)],
                 [ExtendedKeyUsageOID.SERVER_AUTH], now=now, not_after=min(now + lifetime_s, issuer.not_after))


def _leaf(issuer: Issuer, public_key: rsa.RSAPublicKey, common_name: str, names: list[x509.GeneralName],
          usages: list[x509.ObjectIdentifier], *, now: float, not_after: float) -> bytes:
    cert = (
        x509.CertificateBuilder().subject_name(_name(common_name))
        .issuer_name(issuer.certificate.subject).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(now - CLOCK_SKEW_S)).not_valid_after(_utc(not_after))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=True,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(issuer.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM) + issuer.pem


def _public_key_of(cert: x509.Certificate):
    """A certificate's key; CredentialError where its bytes are no key (cryptography parses a
    certificate's key only when it is read, so a chain that loaded can still fail here)."""
    try:
        return cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as error:
        raise CredentialError("malformed", f"credential: its key does not parse ({error})") from None


def parse_identity(cert: x509.Certificate) -> Identity:
    """What a (not yet verified) leaf certificate claims; CredentialError if it claims nothing usable."""
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CredentialError("malformed", "credential: no subject alternative names") from None
    except ValueError as error:  # extensions too are parsed only when read
        raise CredentialError("malformed", f"credential: its extensions do not parse ({error})") from None
    uris = [u for u in names.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith("agora://")]
    if len(uris) != 1:
        raise CredentialError("malformed", f"credential: expected one agora:// identity, found {len(uris)}")
    match = _URI.fullmatch(uris[0])
    if match is None or match["role"] not in CREDENTIAL_ROLES:
        raise CredentialError("malformed", f"credential: malformed identity {uris[0][:120]!r}")
    stage = None if match["stage"] == "-" else int(match["stage"])
    if (match["role"] in STAGE_ROLES) != (stage is not None):
        raise CredentialError("malformed", f"credential: role {match['role']} with stage {match['stage']}")
    return Identity(run_id=match["run"], role=match["role"], stage=stage, peer_id=match["peer"],
                    not_before=cert.not_valid_before_utc.timestamp(), not_after=cert.not_valid_after_utc.timestamp(),
                    serial=cert.serial_number)


class CredentialVerifier:
    """Checks credentials against the pinned root, locally (never a call to the authorizer).

    ``verify(chain)`` for a full chain (DHT tokens, averaging metadata, the authorizer's replies);
    ``check(identity)`` for the time, run, role and stage of an identity whose chain a TLS
    handshake already verified (per gRPC call).
    """

    _CACHE = 1024

    def __init__(self, root_pem: bytes, run_id: str, *, clock: Clock):
        self.root = x509.load_pem_x509_certificate(root_pem)
        self.root_fingerprint = self.root.fingerprint(hashes.SHA256()).hex()
        self.run_id = run_id
        self._clock = clock
        self._store = Store([self.root])
        self._verified: dict[bytes, tuple[Identity, float]] = {}  # chain -> (identity, chain not_after)
        self._issued: dict[bytes, Identity | tuple[str, str]] = {}  # chain -> identity, or why it was refused
        self._parsed: dict[bytes, Identity] = {}

    def verify(self, chain_pem: bytes, *, roles: Sequence[str] = ROLES, stage: Optional[int] = None,
               public_key: Optional[rsa.RSAPublicKey] = None) -> Identity:
        """The identity of a credential chain if it is valid now for this run and one of ``roles``
        (and ``stage`` when given; the default takes admitted roles only, never a probe); else
        CredentialError."""
        cached = self._verified.get(chain_pem)
        if cached is None:
            cached = self._verify_chain(chain_pem)
            if len(self._verified) >= self._CACHE:
                self._verified.clear()
            self._verified[chain_pem] = cached
        identity, chain_not_after = cached
        if public_key is not None and peer_id_of(public_key) != identity.peer_id:
            raise CredentialError("wrong_key", f"credential of {identity.describe()} presented with another key")
        now = self._clock()
        if now > chain_not_after:
            raise CredentialError("expired", f"credential of {identity.describe()} expired "
                                             f"{now - chain_not_after:.0f} s ago")
        return self.check(identity, roles=roles, stage=stage)

    def _verify_chain(self, chain_pem: bytes) -> tuple[Identity, float]:
        certs = load_chain(chain_pem)
        leaf, intermediates = certs[0], certs[1:]
        identity = parse_identity(leaf)
        if peer_id_of(_public_key_of(leaf)) != identity.peer_id:
            raise CredentialError("malformed", "credential: its peer id is not its key's")
        now = self._clock()
        self.check_time(identity, now)
        verifier = PolicyBuilder().store(self._store).time(_utc(now)).build_client_verifier()
        try:
            verifier.verify(leaf, intermediates)
        except VerificationError as error:
            if any(now > c.not_valid_after_utc.timestamp() for c in intermediates):
                raise CredentialError("expired", "credential: its issuing CA has expired") from None
            raise CredentialError("untrusted", f"credential of {identity.describe()} is not signed by this run's "
                                               f"CA (root {self.root_fingerprint[:16]}): {error}") from None
        chain_not_after = min(c.not_valid_after_utc.timestamp() for c in certs)
        return identity, chain_not_after

    def verify_issued(self, chain_pem: bytes, *, roles: Sequence[str] = ROLES) -> Identity:
        """The identity of a chain this run's CA issued for one of ``roles``, judged at the time
        the leaf was valid rather than now: for something its holder wrote while it was (a DHT
        entry needed a live credential to be stored at all; its author's role still matters to
        readers after the credential has run out). CredentialError otherwise. Each chain is
        judged once (readers see the same entries on every poll); the role every call."""
        verdict = self._issued.get(chain_pem)
        if verdict is None:
            try:
                verdict = self._issued_identity(chain_pem)
            except CredentialError as error:
                verdict = (error.reason, str(error))
            if len(self._issued) >= self._CACHE:
                self._issued.clear()
            self._issued[chain_pem] = verdict
        if isinstance(verdict, tuple):
            raise CredentialError(*verdict)
        self._check_run_and_role(verdict, roles)
        return verdict

    def _issued_identity(self, chain_pem: bytes) -> Identity:
        certs = load_chain(chain_pem)
        leaf, intermediates = certs[0], certs[1:]
        identity = parse_identity(leaf)
        if peer_id_of(_public_key_of(leaf)) != identity.peer_id:
            raise CredentialError("malformed", "credential: its peer id is not its key's")
        then = max(c.not_valid_before_utc.timestamp() for c in certs) + 1.0
        verifier = PolicyBuilder().store(self._store).time(_utc(then)).build_client_verifier()
        try:
            verifier.verify(leaf, intermediates)
        except VerificationError as error:
            raise CredentialError("untrusted", f"credential of {identity.describe()} is not signed by this run's "
                                               f"CA (root {self.root_fingerprint[:16]}): {error}") from None
        return identity

    def identity_of_leaf(self, leaf_pem: bytes) -> Identity:
        """Parse (cached) a leaf whose chain the TLS handshake verified: the per-call path."""
        identity = self._parsed.get(leaf_pem)
        if identity is None:
            try:
                identity = parse_identity(x509.load_pem_x509_certificate(leaf_pem))
            except ValueError as error:
                if isinstance(error, CredentialError):
                    raise
                raise CredentialError("malformed", f"credential: {error}") from None
            if len(self._parsed) >= self._CACHE:
                self._parsed.clear()
            self._parsed[leaf_pem] = identity
        return identity

    def check_time(self, identity: Identity, now: Optional[float] = None) -> None:
        now = self._clock() if now is None else now
        if now > identity.not_after:
            raise CredentialError("expired", f"credential of {identity.describe()} expired "
                                             f"{now - identity.not_after:.0f} s ago")
        if now < identity.not_before:
            raise CredentialError("not_yet_valid", f"credential of {identity.describe()} is valid only from "
                                                   f"{identity.not_before - now:.0f} s from now")

    def _check_run_and_role(self, identity: Identity, roles: Sequence[str]) -> None:
        if identity.run_id != self.run_id:
            raise CredentialError("wrong_run", f"credential is for run {identity.run_id!r}, this is run "
                                               f"{self.run_id!r}")
        if identity.role not in roles:
            raise CredentialError("wrong_role", f"a {identity.role} credential may not do this "
                                                f"(needs {' or '.join(roles)})")

    def check(self, identity: Identity, *, roles: Sequence[str] = ROLES, stage: Optional[int] = None) -> Identity:
        self.check_time(identity)
        self._check_run_and_role(identity, roles)
        if stage is not None and identity.stage != stage:
            raise CredentialError("wrong_stage", f"credential of {identity.describe()} is not for stage {stage}")
        return identity
