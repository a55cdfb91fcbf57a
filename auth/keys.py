"""A node's one key pair, and the three identities derived from it.

Design choices:

- One RSA-2048 key per node, kept in its state directory (mode 0600, written atomically under a
  file lock, so two processes starting on one directory agree on one key). The same key is:
  the libp2p identity (so the peer id is a hash of the public key, see ``peer_id_of``), the key
  that signs the node's DHT records and its hivemind requests (hivemind's RSA classes), and the
  TLS key of its gRPC channels. The authorizer certifies the public key, so a credential binds a
  peer id by construction: nobody can present a credential for a peer id whose key they lack.
- RSA because hivemind's record signatures and access tokens are RSA-only; 2048 bits is
  hivemind's own choice and what libp2p's RSA peer ids use.
- Every node key has that size and the public exponent 65537 (``node_key_problem``), and the
  authorizer admits and renews no other. A peer id hashes the whole public key, exponent
  included: the holder of one key pair can compute a private exponent for any other public
  exponent of the same modulus, so without this rule one key would yield any number of peer ids
  (and a ban by peer id would be sidestepped without generating a key).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from filelock import FileLock

from agora.pipeline.files import atomic_write

__all__ = [
    "KEY_FILE",
    "generate_key",
    "hivemind_private_key",
    "libp2p_identity_bytes",
    "load_or_create_key",
    "node_key_problem",
    "NODE_KEY_BITS",
    "NODE_KEY_EXPONENT",
    "openssh_public_key",
    "peer_id_of",
    "private_key_pem",
    "public_key_fingerprint",
    "write_private_file",
    "write_libp2p_identity",
]

KEY_FILE = "node.key"
NODE_KEY_BITS = 2048
NODE_KEY_EXPONENT = 65537


def generate_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=NODE_KEY_EXPONENT, key_size=NODE_KEY_BITS)


def node_key_problem(key: object) -> Optional[str]:
    """Why ``key`` is not a node key (an RSA public key of NODE_KEY_BITS bits with exponent
    NODE_KEY_EXPONENT, what ``generate_key`` makes), or None when it is one."""
    if not isinstance(key, rsa.RSAPublicKey):
        return f"expected an RSA key, got {type(key).__name__}"
    exponent = key.public_numbers().e
    if key.key_size != NODE_KEY_BITS or exponent != NODE_KEY_EXPONENT:
        return (f"expected an RSA key of {NODE_KEY_BITS} bits with public exponent {NODE_KEY_EXPONENT} (what "
                f"agora-node generates), got {key.key_size} bits with exponent {exponent}")
    return None


def private_key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_private_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically (temp file + rename), readable by the owner only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data, mode=mode)


def load_or_create_key(directory: str | Path) -> rsa.RSAPrivateKey:
    """The node key in ``directory/node.key``, created on first use."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / KEY_FILE
    with FileLock(str(directory / f".{KEY_FILE}.lock")):
        if not path.exists():
            write_private_file(path, private_key_pem(generate_key()))
        # This node wrote the key itself (mode 0600, in its own state directory): OpenSSL's check
        # of the RSA parameters would cost 40 to 100 ms per load, and a node loads it several
        # times as it starts (admission, DHT security, TLS).
        key = serialization.load_pem_private_key(path.read_bytes(), password=None,
                                                 unsafe_skip_rsa_key_validation=True)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: expected an RSA private key, found {type(key).__name__}")
    return key


def openssh_public_key(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> bytes:
    """The public key as hivemind writes it (``ssh-rsa AAAA...``): record owners, access tokens."""
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    return public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)


def public_key_fingerprint(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> str:
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def libp2p_identity_bytes(key: rsa.RSAPrivateKey) -> bytes:
    """The key in libp2p's private-key protobuf, the file format of p2pd's ``-id`` (hivemind's ``identity_path``)."""
    from hivemind.proto import crypto_pb2

    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                            serialization.NoEncryption())
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=der).SerializeToString()


def write_libp2p_identity(key: rsa.RSAPrivateKey, path: str | Path) -> Path:
    """Write the identity file hivemind's DHT takes as ``identity_path``; returns its path."""
    write_private_file(Path(path), libp2p_identity_bytes(key))
    return Path(path)


def peer_id_of(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> str:
    """The libp2p peer id (base58) of a key: what the DHT and the averager call this node."""
    import multihash
    from hivemind.p2p import PeerID
    from hivemind.proto import crypto_pb2

    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def hivemind_private_key(key: rsa.RSAPrivateKey):
    """The key as hivemind's ``RSAPrivateKey`` (which can only generate keys, not load them)."""
    from hivemind.utils.crypto import RSAPrivateKey

    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped._private_key = key
    return wrapped
