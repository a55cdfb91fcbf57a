"""The run fingerprint: what two processes must share for their tensors to mean the same thing.

A worker started with another seed computes with another basis U: its activations are garbage to
everyone else, and nothing in a tensor shows it. So every process derives a fingerprint from its
run config, and the authorizer (at the door), every worker (on every request) and every trainer
(on every DHT record) compare theirs with the peer's, naming the first field that differs.

Fields, compared in this order so the message names the most specific cause:

- ``seed`` and ``stages``: the two flags most often mistyped;
- ``basis``: a digest of U as this machine's torch generates it from the seed (another torch
  build could draw other numbers from the same seed); dense runs digest a probe of the same
  generator instead;
- ``data``: a digest of the data section (source, tokenizer, order seed, held-out split);
- ``config``: a digest of the whole config, everything else (model shape, schedule, batch,
  averaging). The token cache's location and the `[runtime]` section (device, compute dtype) are
  machine-local and left out of both digests.

Its text form ``seed=0;stages=3;basis=...;data=...;config=...`` travels in gRPC metadata and in
DHT records; ``parse`` turns anything else into ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields

import torch

from agora.pipeline.config import RunConfig, config_to_dict
from agora.pipeline.model import _generator, make_basis

__all__ = ["RunFingerprint", "run_fingerprint", "FingerprintMismatch"]

_DIGEST_CHARS = 16


class FingerprintMismatch(ValueError):
    """Two fingerprints differ; ``field`` is the first differing field."""

    def __init__(self, field: str, ours: str, theirs: str):
        super().__init__(f"run fingerprint mismatch in {field}: this run has {field}={ours}, the peer has "
                         f"{field}={theirs}")
        self.field = field


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:_DIGEST_CHARS]


@dataclass(frozen=True)
class RunFingerprint:
    seed: int
    stages: int
    basis: str
    data: str
    config: str

    def text(self) -> str:
        return ";".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))

    @classmethod
    def parse(cls, text: str) -> "RunFingerprint":
        if not isinstance(text, str) or len(text) > 512:
            raise ValueError("run fingerprint: expected a short string")
        values = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
        try:
            return cls(seed=int(values["seed"]), stages=int(values["stages"]), basis=values["basis"],
                       data=values["data"], config=values["config"])
        except (KeyError, ValueError) as error:
            raise ValueError(f"run fingerprint: malformed {text[:120]!r} ({error})") from None

    def mismatch(self, other: "RunFingerprint") -> FingerprintMismatch | None:
        """The first differing field as an error to raise or report, or None when they agree."""
        for f in fields(self):
            ours, theirs = getattr(self, f.name), getattr(other, f.name)
            if ours != theirs:
                return FingerprintMismatch(f.name, str(ours), str(theirs))
        return None

    def check(self, other_text: str) -> None:
        """Raise ``ValueError`` (a ``FingerprintMismatch`` when it parses) unless ``other_text`` equals this."""
        mismatch = self.mismatch(RunFingerprint.parse(other_text))
        if mismatch is not None:
            raise mismatch


def _basis_digest(config: RunConfig) -> str:
    model = config.model
    if model.subspace:
        basis = make_basis(model)
    else:
        basis = torch.randn(64, generator=_generator(model.basis_seed, "U"), dtype=torch.float64)
    return _digest(basis.contiguous().numpy().tobytes())


def run_fingerprint(config: RunConfig) -> RunFingerprint:
    """This run's fingerprint; cheap (U is d x k; the data is not read)."""
    # Machine-local settings (where it computes, caches, how long a joiner warms up) are not what the run is.
    plain = config_to_dict(config, local=False)
    return RunFingerprint(
        seed=config.seed,
        stages=len(config.layer_split),
        basis=_basis_digest(config),
        data=_digest(json.dumps(plain["data"], sort_keys=True).encode()),
        config=_digest(json.dumps(plain, sort_keys=True).encode()),
    )
