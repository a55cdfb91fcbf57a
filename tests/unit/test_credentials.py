"""The run's PKI (auth/keys, auth/credentials, auth/authority, auth/node_state) and the run fingerprint."""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from agora.auth.authority import RunAuthority
from agora.auth.credentials import (
    PROBE_ROLE,
    ROLES,
    CredentialError,
    CredentialVerifier,
    certificate_fingerprint,
    issue_credential,
    make_issuing_ca,
    make_root_ca,
    server_name,
    split_pem,
)
from agora.auth.keys import generate_key, libp2p_identity_bytes, peer_id_of
from agora.auth.node_state import NodeCredentials, RunInfo
from agora.pipeline.config import load_config
from agora.pipeline.fingerprint import FingerprintMismatch, RunFingerprint, run_fingerprint

NOW = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def pki():
    root = make_root_ca("run-a", generate_key(), now=NOW, lifetime_s=30 * 86400)
    issuing = make_issuing_ca(root, generate_key(), now=NOW, lifetime_s=86400)
    return root, issuing, generate_key()


def test_a_credential_names_run_role_stage_and_the_peer_id_of_its_key(pki):
    root, issuing, key = pki
    chain = issue_credential(issuing, key.public_key(), run_id="run-a", role="worker", stage=2, now=NOW,
                             lifetime_s=3600)
    assert len(split_pem(chain)) == 2  # leaf + issuing CA: peers trust the root alone
    identity = CredentialVerifier(root.pem, "run-a", clock=Clock()).verify(chain, roles=["worker"], stage=2)
    assert (identity.run_id, identity.role, identity.stage) == ("run-a", "worker", 2)
    assert identity.peer_id == peer_id_of(key)
    assert identity.not_after == pytest.approx(NOW + 3600)
    leaf = x509.load_pem_x509_certificate(split_pem(chain)[0])
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert server_name("worker", 2, identity.peer_id) in names.get_values_for_type(x509.DNSName)


@pytest.mark.parametrize("case, reason", [
    ("other_root", "untrusted"), ("other_run", "wrong_run"), ("expired", "expired"),
    ("not_yet_valid", "not_yet_valid"), ("role", "wrong_role"), ("stage", "wrong_stage"),
    ("other_key", "wrong_key"), ("garbage", "malformed"), ("issuer_expired", "expired"),
])
def test_the_verifier_refuses_with_a_reason(pki, case, reason):
    root, issuing, key = pki
    clock = Clock()
    chain = issue_credential(issuing, key.public_key(), run_id="run-a", role="worker", stage=1, now=NOW,
                             lifetime_s=3600)
    verifier = CredentialVerifier(root.pem, "run-a", clock=clock)
    kwargs = {}
    if case == "other_root":
        other = make_root_ca("run-a", generate_key(), now=NOW, lifetime_s=86400)
        verifier = CredentialVerifier(other.pem, "run-a", clock=clock)
    elif case == "other_run":
        verifier = CredentialVerifier(root.pem, "run-b", clock=clock)
    elif case == "expired":
        clock.now = NOW + 3601
    elif case == "not_yet_valid":
        clock.now = NOW - 3600
    elif case == "role":
        kwargs = {"roles": ["trainer"]}
    elif case == "stage":
        kwargs = {"stage": 0}
    elif case == "other_key":
        kwargs = {"public_key": generate_key().public_key()}
    elif case == "garbage":
        chain = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    elif case == "issuer_expired":
        short = make_issuing_ca(root, generate_key(), now=NOW, lifetime_s=60)
        chain = issue_credential(short, key.public_key(), run_id="run-a", role="worker", stage=1, now=NOW,
                                 lifetime_s=3600)  # capped at the issuing CA's expiry
        clock.now = NOW + 120
    with pytest.raises(CredentialError) as refused:
        verifier.verify(chain, **kwargs)
    assert refused.value.reason == reason, str(refused.value)


def test_a_chain_corrupted_anywhere_is_valid_or_a_credential_error_never_another_exception(pki):
    """cryptography parses a certificate's key and extensions only when they are read, so a chain
    that loads can still hold bytes that are no key: every verifier path answers such a chain as
    malformed (the renewal fuzz found one byte in a leaf's key that escaped as a bare ValueError)."""
    root, issuing, key = pki
    chain = issue_credential(issuing, key.public_key(), run_id="run-a", role="worker", stage=2, now=NOW,
                             lifetime_s=3600)
    leaf = split_pem(chain)[0]
    verifier = CredentialVerifier(root.pem, "run-a", clock=Clock())
    body = range(leaf.index(b"\n") + 1, len(leaf) - len(b"-----END CERTIFICATE-----\n"))
    reasons = set()
    for at in body:
        if leaf[at:at + 1] == b"\n":
            continue
        for byte in (b"/", b"A"):
            corrupted = chain[:at] + byte + chain[at + 1:]
            for judge in (verifier.verify, verifier.verify_issued):
                try:
                    judge(corrupted)
                except CredentialError as error:
                    reasons.add(error.reason)
    assert "malformed" in reasons and reasons <= {"malformed", "untrusted", "wrong_run", "wrong_role", "expired",
                                                  "not_yet_valid", "wrong_stage"}


def test_a_cached_verification_still_checks_time(pki):
    root, issuing, key = pki
    clock = Clock()
    chain = issue_credential(issuing, key.public_key(), run_id="run-a", role="trainer", stage=None, now=NOW,
                             lifetime_s=60)
    verifier = CredentialVerifier(root.pem, "run-a", clock=clock)
    verifier.verify(chain)
    clock.now += 61
    with pytest.raises(CredentialError, match="expired"):
        verifier.verify(chain)


def test_a_self_signed_leaf_presenting_itself_as_the_issuer_is_untrusted(pki):
    root, _, key = pki
    forged_root = make_root_ca("run-a", generate_key(), now=NOW, lifetime_s=86400)
    forged = issue_credential(forged_root, key.public_key(), run_id="run-a", role="trainer", stage=None,
                              now=NOW, lifetime_s=3600)
    with pytest.raises(CredentialError) as refused:
        CredentialVerifier(root.pem, "run-a", clock=Clock()).verify(forged)
    assert refused.value.reason == "untrusted"


def test_roles_and_stages_must_agree():
    root = make_root_ca("r", generate_key(), now=NOW, lifetime_s=86400)
    key = generate_key()
    with pytest.raises(ValueError, match="stage"):
        issue_credential(root, key.public_key(), run_id="r", role="worker", stage=None, now=NOW, lifetime_s=60)
    with pytest.raises(ValueError, match="stage"):
        issue_credential(root, key.public_key(), run_id="r", role="trainer", stage=0, now=NOW, lifetime_s=60)
    with pytest.raises(ValueError, match="role"):
        issue_credential(root, key.public_key(), run_id="r", role="admin", stage=None, now=NOW, lifetime_s=60)


def test_a_probe_credential_is_taken_only_where_a_check_names_it(pki, tmp_path):
    """A dry run's probe credential (auth/join_check.py) verifies against the root and names its stage,
    but a check that names no roles (the DHT's, a node's own credential, renewal) takes admitted
    roles only; it is a client certificate, so no server can answer a dial with it."""
    root, issuing, key = pki
    with pytest.raises(ValueError, match="stage"):
        issue_credential(issuing, key.public_key(), run_id="run-a", role=PROBE_ROLE, stage=None, now=NOW,
                         lifetime_s=120)
    chain = issue_credential(issuing, key.public_key(), run_id="run-a", role=PROBE_ROLE, stage=1, now=NOW,
                             lifetime_s=120)
    verifier = CredentialVerifier(root.pem, "run-a", clock=Clock())
    assert PROBE_ROLE not in ROLES
    identity = verifier.verify(chain, roles=[PROBE_ROLE], stage=1)
    assert (identity.role, identity.stage, identity.peer_id) == (PROBE_ROLE, 1, peer_id_of(key))
    for check in (lambda: verifier.verify(chain), lambda: verifier.verify_issued(chain),
                  lambda: verifier.check(identity)):
        with pytest.raises(CredentialError) as refused:
            check()
        assert refused.value.reason == "wrong_role" and "a probe credential may not do this" in str(refused.value)
    leaf = x509.load_pem_x509_certificate(split_pem(chain)[0])
    usages = list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert usages == [ExtendedKeyUsageOID.CLIENT_AUTH]
    with pytest.raises(CredentialError) as refused:
        verifier.verify(chain, roles=[PROBE_ROLE], stage=2)
    assert refused.value.reason == "wrong_stage"
    authority = RunAuthority(tmp_path / "auth", run_id="run-a")
    node = authority.mint(tmp_path / "node", role="trainer")
    probe = authority.issue(node.key.public_key(), role=PROBE_ROLE, stage=0)
    with pytest.raises(CredentialError) as refused:  # a node cannot take it as its own credential
        node.save(probe, authority.root_pem, node.run_info())
    assert refused.value.reason == "wrong_role"


def test_the_libp2p_identity_has_the_peer_id_of_the_key():
    from hivemind.p2p import PeerID

    key = generate_key()
    assert PeerID.from_identity(libp2p_identity_bytes(key)).to_base58() == peer_id_of(key)


def test_the_authority_persists_rotates_and_bans(tmp_path):
    clock = Clock()
    authority = RunAuthority(tmp_path / "auth", run_id="run-a", clock=clock, issuing_lifetime_s=1000)
    assert stat.S_IMODE(os.stat(tmp_path / "auth" / "root.key").st_mode) == 0o600
    first = authority.issuing()
    clock.now += 400
    assert authority.issuing().pem == first.pem  # before half life: the same issuing CA
    clock.now += 200
    second = authority.issuing()
    assert second.pem != first.pem  # past half life: rotated, persisted
    reopened = RunAuthority(tmp_path / "auth", clock=clock)
    assert reopened.root_fingerprint == authority.root_fingerprint
    assert reopened.issuing().pem == second.pem
    with pytest.raises(ValueError, match="holds run 'run-a'"):
        RunAuthority(tmp_path / "auth", run_id="run-b", clock=clock)

    node = authority.mint(tmp_path / "w", role="worker", stage=0, lifetime_s=600)
    assert node.identity().stage == 0 and node.identity().peer_id == node.peer_id
    assert stat.S_IMODE(os.stat(tmp_path / "w" / "node.key").st_mode) == 0o600
    authority.ban(node.peer_id, "test")
    assert reopened.is_banned(node.peer_id).reason == "test"  # another process sees the file change
    assert authority.unban(node.peer_id) and reopened.is_banned(node.peer_id) is None


def test_node_credentials_reload_a_renewed_credential_and_refuse_a_foreign_root(tmp_path):
    clock = Clock()
    authority = RunAuthority(tmp_path / "auth", run_id="run-a", clock=clock)
    node = authority.mint(tmp_path / "t", role="trainer", lifetime_s=600)
    chain, identity = node.current()
    generation = node.generation
    clock.now += 300
    authority.mint(tmp_path / "t", role="trainer", lifetime_s=600)  # the renewal path: same key, new file
    renewed_chain, renewed = node.current()
    assert renewed_chain != chain and renewed.not_after > identity.not_after and node.generation > generation
    other = RunAuthority(tmp_path / "other", run_id="run-a", clock=clock)
    foreign = other.issue(node.key.public_key(), role="trainer", stage=None)
    run = replace(node.run_info(), root_fingerprint=authority.root_fingerprint)
    with pytest.raises(CredentialError) as refused:
        node.save(foreign, other.root_pem, run)  # the root does not hash to the pinned fingerprint
    assert refused.value.reason == "untrusted"
    with pytest.raises(CredentialError) as refused:
        node.save(foreign, authority.root_pem, run)  # pinned root, but the chain is not under it
    assert refused.value.reason == "untrusted"
    assert node.current()[0] == renewed_chain  # nothing was overwritten
    assert certificate_fingerprint(node.root_pem()) == authority.root_fingerprint
    assert RunInfo.from_json(node.run_info().to_json()) == node.run_info()


def test_the_run_fingerprint_names_the_first_differing_field():
    config = load_config("tiny").with_stages(3)
    ours = run_fingerprint(config)
    assert RunFingerprint.parse(ours.text()) == ours
    assert run_fingerprint(config) == ours  # deterministic
    reseeded = replace(config, seed=1, model=replace(config.model, basis_seed=1), data=replace(config.data, seed=1))
    cases = {
        "seed": reseeded,
        "stages": config.with_stages(2),
        "basis": replace(config, model=replace(config.model, basis_seed=7)),
        "data": replace(config, data=replace(config.data, heldout_fraction=0.25)),
        "config": replace(config, train=replace(config.train, batch_size=config.train.batch_size * 2)),
    }
    for field, other in cases.items():
        with pytest.raises(FingerprintMismatch) as mismatch:
            ours.check(run_fingerprint(other).text())
        assert mismatch.value.field == field
        assert f"{field}=" in str(mismatch.value)
    with pytest.raises(ValueError, match="malformed"):
        ours.check("seed=zero")
    elsewhere = replace(config, data=replace(config.data, cache_dir="/somewhere/else"))
    assert run_fingerprint(elsewhere) == ours  # a machine-local path is not part of the run
