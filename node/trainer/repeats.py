"""Repeat checks: a reply that repeats its worker's earlier reply to other tokens proves a lie.

A worker's answer at a token position depends on the token there: the wire at position t carries
the residual stream's coordinates there, computed from that token's embedding, and a gradient at t
flows back through those same values. So two honest replies to microbatches whose tokens differ at a
position stand about their own size apart there. A worker that replays an earlier answer (saving
its compute, or serving answers it cached) matches that answer at those very positions. One such
match is proof, not a statistic: nothing is learned first and no honest spread has to be estimated,
so the first replayed reply is refused before it is relayed, and its worker flagged. The verifier
sees a replay only as far as it shifts a stage's statistics (a replayed reply has every marginal of
an honest one), and the self checks only when one of their probes falls on a replayed reply.

How it compares (`RepeatJudge`): each reply's frame (batch, positions, width) is sketched per
position by `SKETCH` fixed random directions (a random projection keeps distances within a small
factor: Johnson and Lindenstrauss), and the last `KEPT` sketches of each worker's frame kind are kept
with their tokens. A new reply is held to each kept one of the same shape at the positions whose
tokens differ, if there are at least `MIN_POSITIONS`: a distance under `TOLERANCE` of the two
sketches' size there is a repeat. A verbatim replay stands at 0; honest replies to different tokens
stand at order 1 (tests/unit/test_repeats.py measures a real stage's). Positions where the tokens are
the same are never compared: an honest answer there may repeat (a shared prefix, causal attention),
and a retried or rerouted microbatch repeats its own tokens everywhere.

What it misses: a replay of an answer given to another trainer (this trainer never saw it), a
replay with noise added past `TOLERANCE` (noise is the verifier's and the replay check's), and
frames with no size to compare (zeros: the verifier's).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from agora.node.trainer.verification import Evidence

__all__ = ["KEPT", "MIN_POSITIONS", "SKETCH", "TOLERANCE", "RepeatEvidence", "RepeatJudge", "repeat_distance",
           "sketch"]

# Per worker and frame kind, how many earlier replies a new one is compared with.
KEPT = 8
# Fixed random directions each position's values are projected on.
SKETCH = 16
# Positions whose tokens differ that a comparison needs, and the distance (over the two replies' size
# there) under which a reply repeats another.
MIN_POSITIONS = 8
TOLERANCE = 0.01
_EPSILON = 1e-30


def _directions(width: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(104_729 + width)
    return torch.randn(width, SKETCH, generator=generator) / SKETCH ** 0.5


def sketch(frame: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """A frame's values at each position projected on `directions`: (batch, positions, SKETCH)."""
    return frame.to(torch.float32) @ directions


def repeat_distance(tokens: torch.Tensor, sketched: torch.Tensor, earlier_tokens: torch.Tensor,
                    earlier: torch.Tensor) -> float | None:
    """The RMS distance of two replies' sketches at the positions where their tokens differ, over their
    RMS size there; None when fewer than `MIN_POSITIONS` differ, or the replies have no size there."""
    differ = tokens != earlier_tokens
    if int(differ.sum()) < MIN_POSITIONS:
        return None
    mine, theirs = sketched[differ], earlier[differ]
    size = float((mine.square().mean() + theirs.square().mean()).div(2).sqrt())
    if size <= _EPSILON:
        return None
    return float((mine - theirs).square().mean().sqrt()) / size


class RepeatEvidence(Evidence):
    """Why a repeat check flagged a worker: `value` the distance to the reply it repeated (in its size),
    `cusum` the positions compared, `replies` the worker's replies of this kind seen."""

    def describe(self) -> str:
        return (f"stage {self.stage} {self.kind}: its reply repeated one of its earlier replies to other tokens "
                f"(distance {self.value:.3g} of their size at the {int(self.cusum)} positions whose tokens differ; "
                f"honest replies stand about 1 apart there, a repeat under {TOLERANCE:g}; "
                f"{self.replies} of its replies seen)")


@dataclass
class _Kept:
    tokens: torch.Tensor
    sketched: torch.Tensor


class RepeatJudge:
    """Per worker and frame kind, its last replies' sketches, and whether a new reply repeats one (module
    docstring). Pure: no socket, no clock."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], deque[_Kept]] = {}
        self._seen: dict[tuple[str, str], int] = {}
        self._directions: dict[int, torch.Tensor] = {}

    def observe(self, stage: int, kind: str, peer: str, tokens: torch.Tensor,
                frame: torch.Tensor) -> RepeatEvidence | None:
        """Hold `peer`'s reply `frame` (its `kind`, answering `tokens`) to its earlier ones, then keep it;
        the evidence when it repeats one. Frames not laid out token by token are not compared."""
        if frame.dim() != tokens.dim() + 1 or frame.shape[:-1] != tokens.shape:
            return None
        width = frame.shape[-1]
        if width not in self._directions:
            self._directions[width] = _directions(width)
        sketched = sketch(frame, self._directions[width])
        key = (peer, kind)
        kept = self._kept.setdefault(key, deque(maxlen=KEPT))
        self._seen[key] = self._seen.get(key, 0) + 1
        for earlier in kept:
            if earlier.tokens.shape != tokens.shape:
                continue
            distance = repeat_distance(tokens, sketched, earlier.tokens, earlier.sketched)
            if distance is not None and distance < TOLERANCE:
                compared = int((tokens != earlier.tokens).sum())
                return RepeatEvidence(stage=stage, kind=kind, peer=peer, feature="repeated_reply", direction="low",
                                      cusum=float(compared), value=distance, mean=distance, centre=1.0,
                                      spread=TOLERANCE, replies=self._seen[key])
        kept.append(_Kept(tokens.clone(), sketched))
        return None

    def forget(self, peer: str) -> None:
        """Drop what is kept of `peer` (it left the run, or was flagged)."""
        for key in [key for key in self._kept if key[0] == peer]:
            del self._kept[key]
