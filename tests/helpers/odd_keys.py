"""Keys the authorizer must refuse though they sign correctly."""

from __future__ import annotations

import math

from cryptography.hazmat.primitives.asymmetric import rsa


def same_modulus_with_exponent(key: rsa.RSAPrivateKey, exponent: int = 65539) -> rsa.RSAPrivateKey:
    """The key pair the holder of `key` can compute for another public exponent of its own modulus:
    a new peer id without generating a key."""
    private = key.private_numbers()
    p, q = private.p, private.q
    d = pow(exponent, -1, math.lcm(p - 1, q - 1))
    return rsa.RSAPrivateNumbers(p, q, d, rsa.rsa_crt_dmp1(d, p), rsa.rsa_crt_dmq1(d, q), rsa.rsa_crt_iqmp(p, q),
                                 rsa.RSAPublicNumbers(exponent, p * q)).private_key(unsafe_skip_rsa_key_validation=True)
