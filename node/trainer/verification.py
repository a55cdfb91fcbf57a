"""`ReplyVerifier`: whether what a worker computes looks like what its stage's other workers compute.

Format checks (the codec) and the scale bound (pipeline/wire_scale.py) stop values no honest stage
produces; a worker that scales its outputs by ten, flips the sign of its gradients, adds noise at the
signal's scale, sends a constant or replays the previous microbatch's reply passes both, and its
values flow into every later stage (activations) or every earlier one (gradients). The trainer
relays every such value, so it can watch them. Design choices:

- **What is measured.** Each reply's frame (batch, seq, wire) in the stage's wire coordinates is
  summarised by a few dimensionless numbers (`reply_features`): the log of its RMS (scale); the
  share of that RMS in the tokens' differences from their mean (a constant has none); the
  per-coordinate mean over tokens projected on `PROJECTIONS` fixed random unit directions and
  divided by the RMS (direction: a sign flip negates it, a constant or noise shrinks it); and, where
  the call carried a frame the reply answers token for token, the mean per-token cosine between the
  two (the relation of a reply to its request: a body's output to its input wire, both residual
  streams; a Backward's input gradient to the output gradient it was given; a tail's input
  gradient to its input wire). A replayed reply keeps every marginal statistic and loses that
  alignment. Cost: one decode and a few passes over the frame per reply.
- **The reference.** Per stage and frame kind ("output", "input_grad"), the features of the last
  `window` accepted replies of all the stage's workers, pooled: the median of its newest quarter
  is the centre (a short lag behind drift), the MAD of the whole window (times 1.4826, floored at
  `SPREAD_FLOOR`) the spread (wide enough to hold the window's drift as well as the noise between
  microbatches). For values drifting steadily through the window the newest reply then stands about
  a third of a spread off. Medians cannot be moved by a minority of the window's replies, however
  extreme, so with three or more replicas one liar cannot shift the reference; with two, a liar's
  replies stay out of it from the moment its CUSUM is half-way to the bar (and the reply that trips
  it never enters, as `WireScale` keeps refused frames out), so it trips before it owns the median.
  Early in a run, while values still move fast, the spread is wide and a lie needs more replies.
  A worker flagged by another check (spot or gradient checks) leaves every reference at once
  (`forget`), and the CUSUMs held to those references restart.
- **The workers that are there.** Only the replies of the stage's workers the trainer still routes
  to make the reference (`observe`'s `present`): a worker killed or gone takes its replies with it.
  Under churn a newcomer may be a stage's only member, holding the copy of its state it downloaded
  while the members it came to join were dying, steps behind what they last answered; held to the
  departed ones' window it stood five of their spreads off and was flagged within a few replies
  (seen in a chaos run). Held to the workers that are there, it is alone and its own history is its
  reference, and nothing is judged until that history holds `warmup` replies.
- **The test.** Per worker, for each feature, a two-sided CUSUM (Page, "Continuous inspection
  schemes", Biometrika 1954) over the reply's standardized deviation z, clipped at `Z_CAP`:
  S+ = max(0, S+ + z - k), S- = max(0, S- - z - k), tripping at S > h. With k = 3 and h = 30
  an honest worker (z mostly within 2) accumulates nothing, a single wild reply (a loss spike)
  adds at most 9, and a worker whose every reply is 12 spreads off or more trips on its fourth
  (`DETECTION_REPLIES`); a lie of z spreads takes about 30 / (z - 3) replies. On tiny's real
  traffic honest CUSUMs stayed below a third of the bar over 150 steps. Monitoring the
  activations and gradients crossing stage boundaries with running statistics follows SENTINEL's
  EMA monitoring of inter-stage values in decentralized pipelines; a per-worker EMA of each
  feature is kept for the evidence, and each worker's largest CUSUM (`peaks`) shows how close
  honest traffic comes to the bar.
- **Whose shift it is.** When a worker trips, the stage's other recently active workers are
  looked at: if at least half of them are half-way to tripping the same feature in the same
  direction, the stage as a whole has moved (the data, the weights after a step or an averaging
  round) and nobody is flagged: every CUSUM of that stage and kind restarts at 0 (`shifts` counts
  it). Otherwise the worker is flagged for good, with its evidence, and every later reply of it
  is refused.
- **Whose lie it is.** A lie flows on: a head's outputs scaled by ten make the tail's input
  gradient ten times smaller, and a tail judged on that would be flagged as fast as the liar (or
  faster, if its values vary less). So a reply computed from a suspected worker's (one whose
  CUSUM reached a tenth of the bar) is not judged at all: `observe` is told which replies of the
  microbatch's route came before it (`upstream`), and while one of their workers is suspected,
  the reply is used, its worker's statistics untouched (`tainted` counts it). The same holds while
  another check suspects one of them (a self check it failed and has not cleared): a tail
  returning stale gradients keeps every marginal statistic and fails only its gradient checks,
  and a body's Backward replies computed from those gradients drifted off its twin's until the
  verifier flagged the honest body (seen in an attack run). The liar alone accumulates evidence;
  honest workers downstream wait, at the cost of a few unjudged replies while an honest upstream
  worker's CUSUM is above a tenth of the bar or its stray check is not yet cleared. And a lie
  small enough to keep its sender under suspicion (a persistent bias of a twentieth of the
  head's RMS) can grow in the next stage's reply past that stage's spread: an honest body was
  flagged for it in an attack run. So when a worker trips, its latest replies are grouped by the
  worker that produced their request (`_producer_to_blame`): if only one producer's frames came
  with the deviation (at least `_ATTRIBUTION_MIN_REPLIES` from each of two producers, the
  culprit's mean deviation past the drift allowance k and every other's within k/2), the trip is
  laid on that producer instead (`implicated`: the trainer checks it at once, node/trainer/
  reply_checks.py) and the worker's CUSUMs restart; once per producer, so a worker that lies only
  on one producer's inputs is flagged at its next trip. Once a worker is flagged (by any check),
  what the replies computed from its frames added to other workers' CUSUMs is void: those restart.
  Voiding the evidence does not undo the training: a body that took a lying head's x10 outputs
  (or a lying tail's x10 gradients) into its weights for a step stands off its twin afterwards on
  honest inputs too, and was flagged beside the liar in attack runs, once before it. So a worker
  that trips while its latest replies of any kind include frames of a worker flagged or suspected
  since (`implicated_elsewhere`: excluded, or a self check failed and not cleared; or half-way to
  this verifier's bar) is not flagged: its CUSUMs restart and the trainer checks it at once
  against its own held-out answers (`pardoned`), which an honest worker on damaged weights passes
  and a liar does not; once per such producer, so a worker that keeps tripping is flagged.
- Nothing is judged before the stage and kind have `warmup` accepted replies.

With one worker on a stage the reference is that worker's own history, by weights version, its
spread floored wider, its replies entering it unless each stands far off
(node/trainer/reply_reference.py: alone, weights versions, and what that cannot catch); and a trip
alone does not flag it: it is checked at once, and only a second trip with no passed self check
since flags it (node/trainer/lone_worker.py). A stage-wide honest shift cannot be told from a lie
there. With two workers, the statistics say that they differ, not which of them moved: replicas
between averaging rounds train on different microbatches, and sparse averaging keeps them near each
other, not together. Early in a run on a loaded host one of two honest tails' input gradients stood
0.1-0.5 in log-RMS off its twin's, the faster twin's replies owning the median and the spread (three
demos of 3 x 2 over 80 ms links: an honest worker flagged and its credential revoked in each within
its first 45 replies, its gradient checks all passed); later in such a run two honest heads' and two
honest bodies' mean output directions stood 4 of the stage's spreads apart. So with self checks on
(`self_checks`), a trip of one of two that nothing else explains, on the scale (`log_rms`) or a
direction, is the lone worker's: excused, checked at once (a finite difference or a replay tells a
wrong gradient or output from an honest one), flagged only at a trip with no passed self check
since. A trip on the content (`variation`) or the alignment flags at once, and names the trip when
the scale trips with it (zeros): a self check cannot see some lies in them (a tail's constant input
gradient, every token's the mean, is the gradient's own projection on constants and passes a
finite-difference check exactly; a zero one leaves it nothing to probe along). Those lies stand far
off, though, and honest twins do not share the content exactly either: on a loaded host an honest
body's input gradients' `variation` stood 0.957 against its stage's 0.900 +- 0.02, about 4 spreads a
reply, and tripped after 21 (a two-replica demo of the suite; its credential was revoked). So an
input gradient's `variation` trip whose latest `DETECTION_REPLIES` deviations stand under `OUTLIER_Z`
in the median is excused and checked like a scale trip: a constant or zero gradient stands tens of
spreads off and still flags at once, and a partial one (each token's gradient pulled towards the
tokens' mean) far enough off to trip at under `OUTLIER_Z` moves the directional derivative along it
out of the finite-difference check's band (node/trainer/gradient_checks.py; from a variation of 0.9
with that spread, pulled a third of the way: 0.81, 4.5 spreads off, and the check's ratio 0.75
against the band's 0.8; a smaller pull stands within about 3, where the CUSUM hardly grows; the
narrow blind spot between is the pair's). An output's content stays flagged at once: a replay of
the worker's own output cannot see a lie it makes again. What that costs: a two-replica liar whose
lie is in its scale or direction and whose self checks pass it (the lone worker's blind spot: a
head scaling or flipping its outputs in its replays too) is not flagged by these statistics;
without self checks a trip flags as with three. With three or more, a colluding majority of a
stage's replies owns the median, as in robust averaging.
Where a stage has several replicas, the trainer's optional spot checks (node/trainer/spot_checks.py)
cover part of what this cannot: a replayed head reply, content shuffled within a batch, a lie from
a worker's first reply, by asking a second replica the same Forward now and then; and its
gradient checks (node/trainer/gradient_checks.py) what no marginal statistic shows of a gradient,
its sign and scale against the stage's own directional derivative, with any number of replicas.

Pure: no socket, no clock; `reply_features` is the only torch here. One instance per trainer, used
from its event loop.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from agora.node.trainer.lone_worker import LoneNotice, held_to, lone_trip, vouched
from agora.node.trainer.reply_reference import LONE_SPREAD_FLOOR, SPREAD_FLOOR, STALE_VERSIONS, Boundary
__all__ = ["PROJECTIONS", "FEATURES", "Z_CAP", "OUTLIER_Z", "SPREAD_FLOOR", "LONE_SPREAD_FLOOR", "STALE_VERSIONS",
           "DETECTION_REPLIES", "VerifierSettings",
           "Evidence", "ReplyVerifier", "Source", "reply_features", "projection_directions"]

# A reply's place: (stage, frame kind, worker).
Source = tuple[int, str, str]

# Fixed random directions the per-coordinate mean is projected on.
PROJECTIONS = 4
FEATURES = ("log_rms", "variation", *(f"direction_{index}" for index in range(PROJECTIONS)), "alignment")
# What two honest replicas on weights apart differ in, scale and direction (module docstring: two workers).
_WEIGHTS_MOVE = frozenset(feature for feature in FEATURES if feature == "log_rms" or feature.startswith("direction_"))
# A standardized deviation counts at most this much (a single wild reply cannot trip a worker).
Z_CAP = 12.0
# A reply this many spreads off on some feature is an outlier: too few to flag on, enough to have that
# very reply self-checked (`ReplyVerifier.outlying`). Tiny's honest traffic: 13 replies of 3,840 (two
# runs of 120 global batches, tests/helpers/reply_traffic.py); a x10 output stands about 7 off.
OUTLIER_Z = 6.0
_EMA_WEIGHT = 0.1
# A worker whose CUSUM reached this fraction of the bar is suspected: replies computed from its are
# not judged (module docstring).
_SUSPECT_FRACTION = 0.1
_EPSILON = 1e-30
# A trip is laid on one producer of a worker's inputs when its latest replies, at least this many
# from each of two producers or more, stood off only with that producer's frames.
_ATTRIBUTION_WINDOW = 32
_ATTRIBUTION_MIN_REPLIES = 4


@dataclass(frozen=True)
class VerifierSettings:
    """The bar (module docstring): drift allowance k, threshold h, warm-up and window in replies."""

    drift: float = 3.0
    threshold: float = 30.0
    warmup: int = 32
    window: int = 64
    # The trainer's self checks are on (node/trainer/gradient_checks.py): a trip of one of a stage's two
    # workers is then excused and checked at once, as a lone worker's is (module docstring: two workers).
    self_checks: bool = False

    def __post_init__(self) -> None:
        if not (0 < self.drift < Z_CAP and self.threshold > 0):
            raise ValueError(f"drift must lie in (0, {Z_CAP:g}) and threshold be positive, got {self.drift} and "
                             f"{self.threshold}")
        if self.warmup < 2 or self.window < 2:
            raise ValueError(f"warmup and window must be at least 2, got {self.warmup} and {self.window}")


def _detection_replies(settings: VerifierSettings) -> int:
    return math.floor(settings.threshold / (Z_CAP - settings.drift)) + 1


# Replies of a worker far off in every one of them before it is flagged, under the default bar.
DETECTION_REPLIES = _detection_replies(VerifierSettings())


def projection_directions(width: int) -> torch.Tensor:
    """`PROJECTIONS` fixed unit vectors of the wire's width (the same on every trainer)."""
    generator = torch.Generator().manual_seed(width)
    directions = torch.randn(PROJECTIONS, width, generator=generator, dtype=torch.float64)
    return (directions / directions.norm(dim=1, keepdim=True)).to(torch.float32)


def reply_features(frame: torch.Tensor, request: torch.Tensor | None, directions: torch.Tensor) -> tuple[float, ...]:
    """The reply's features in `FEATURES` order (module docstring); alignment is NaN without a request
    frame of the reply's shape."""
    rows = frame.reshape(-1, frame.shape[-1]).to(torch.float32)
    rms = float(rows.square().mean().sqrt())
    mean = rows.mean(dim=0)
    variation = float((rows - mean).square().mean().sqrt()) / (rms + _EPSILON)
    direction = directions @ mean / (rms + _EPSILON)
    alignment = math.nan
    if request is not None and request.shape == frame.shape:
        other = request.reshape(-1, request.shape[-1]).to(torch.float32)
        cosine = (rows * other).sum(dim=1) / (rows.norm(dim=1) * other.norm(dim=1) + _EPSILON)
        alignment = float(cosine.mean())
    return (math.log(rms + _EPSILON), variation, *(float(value) for value in direction), alignment)


@dataclass(frozen=True)
class Evidence:
    """Why a worker was flagged: the feature whose CUSUM tripped, and where its values stood."""

    stage: int
    kind: str
    peer: str
    feature: str
    direction: str  # "high" or "low"
    cusum: float
    value: float  # the tripping reply's
    mean: float  # the worker's moving average of the feature
    centre: float  # the stage's reference
    spread: float
    replies: int  # this worker's replies of this kind seen

    def describe(self) -> str:
        return (f"stage {self.stage} {self.kind}: {self.feature} {self.direction} (CUSUM {self.cusum:.1f} after "
                f"{self.replies} replies; reply {self.value:.4g}, worker's average {self.mean:.4g}, stage's "
                f"{self.centre:.4g} +- {self.spread:.3g})")

    def fields(self) -> dict:
        return {"stage": self.stage, "kind": self.kind, "peer": self.peer, "feature": self.feature,
                "direction": self.direction, "cusum": round(self.cusum, 2), "value": self.value,
                "worker_mean": self.mean, "stage_centre": self.centre, "stage_spread": self.spread,
                "replies": self.replies}


@dataclass
class _WorkerTrack:
    high: list[float]
    low: list[float]
    mean: list[float]
    replies: int = 0
    peak: float = 0.0  # the largest CUSUM this worker reached (how close honest traffic comes to the bar)
    peak_at: str = ""  # its feature and side ("variation high")
    last_seen: int = 0  # the boundary's reply count at this worker's last reply
    flagged: Evidence | None = None
    # (producer of the reply's request, its standardized deviations) of its latest judged replies
    deviations: deque = field(default_factory=lambda: deque(maxlen=_ATTRIBUTION_WINDOW))
    deflected: set = field(default_factory=set)  # producers a trip of this worker was laid on already
    pardoned: set = field(default_factory=set)  # flagged producers a trip of this worker was excused for
    outlying: bool = False  # its last reply stood OUTLIER_Z spreads off on some feature
    notice: LoneNotice | None = None  # alone, its excused trip not yet vouched for (node/trainer/lone_worker.py)

    @classmethod
    def fresh(cls) -> "_WorkerTrack":
        return cls([0.0] * len(FEATURES), [0.0] * len(FEATURES), [math.nan] * len(FEATURES))

    def average(self, features: tuple[float, ...]) -> None:
        self.replies += 1
        self.mean = [value if math.isnan(old) else old + _EMA_WEIGHT * (value - old)
                     for old, value in zip(self.mean, features)]

    def largest(self) -> float:
        return max(*self.high, *self.low)

    def restart(self) -> None:
        self.high = [0.0] * len(FEATURES)
        self.low = [0.0] * len(FEATURES)


class ReplyVerifier:
    """Per (stage, kind, worker) statistics and the CUSUM that flags a worker (module docstring)."""

    def __init__(self, settings: VerifierSettings = VerifierSettings()):
        self.settings = settings
        self._boundaries: dict[tuple[int, str], Boundary] = {}
        self._directions: dict[int, torch.Tensor] = {}
        self.shifts = 0  # stage-wide shifts seen (every CUSUM of a boundary restarted)
        self.tainted = 0  # replies left unjudged: computed from a suspected worker's
        # (stage, kind, worker, producer, feature) of each trip laid on the producer of its inputs;
        # the trainer takes them (`take_implicated`) to check those producers at once
        self.implicated: list[tuple[int, str, str, str, str]] = []
        # (stage, kind, worker, flagged producer, feature) of each trip excused as that producer's damage
        # (module docstring: whose lie it is); the trainer takes them (`take_pardoned`) to check the worker
        self.pardoned: list[tuple[int, str, str, str, str]] = []
        # (stage, kind, worker, feature) of each trip of a stage's only worker, or of one of its two, excused
        # for a self check at once (node/trainer/lone_worker.py); the trainer takes them (`take_lone_trips`);
        # `lone_trips` and `pair_trips` count them
        self.lone_excused: list[tuple[int, str, str, str]] = []
        self.lone_trips = 0
        self.pair_trips = 0

    def directions(self, width: int) -> torch.Tensor:
        if width not in self._directions:
            self._directions[width] = projection_directions(width)
        return self._directions[width]

    def features(self, frame: torch.Tensor, request: torch.Tensor | None) -> tuple[float, ...]:
        return reply_features(frame, request, self.directions(frame.shape[-1]))

    def flagged(self) -> dict[str, Evidence]:
        """Every flagged worker and the evidence it was flagged on (its first)."""
        return {peer: track.flagged for boundary in self._boundaries.values()
                for peer, track in boundary.workers.items() if track.flagged is not None}

    def peaks(self) -> dict[tuple[int, str, str], float]:
        """The largest CUSUM each (stage, kind, worker) reached."""
        return {(stage, kind, peer): track.peak for (stage, kind), boundary in self._boundaries.items()
                for peer, track in boundary.workers.items()}

    def peak_features(self) -> dict[tuple[int, str, str], str]:
        """The feature and side of each (stage, kind, worker)'s largest CUSUM ("" while none grew): which of
        a boundary's statistics honest traffic brings nearest the bar."""
        return {(stage, kind, peer): track.peak_at for (stage, kind), boundary in self._boundaries.items()
                for peer, track in boundary.workers.items()}

    def observe(self, stage: int, kind: str, peer: str, features: tuple[float, ...],
                upstream: Iterable[Source] = (), present: Iterable[str] | None = None,
                suspected_elsewhere: Callable[[str], bool] = lambda peer: False,
                implicated_elsewhere: Callable[[str], bool] = lambda peer: False,
                version: int | None = None, passes: Callable[[str], int] = lambda peer: 0) -> Evidence | None:
        """Judge one reply of `peer`, a worker of `stage`: None when it is used (and counted into the
        stage's reference), else the evidence against its worker (this reply and every later one).
        `upstream`: the replies of the microbatch's route this one was computed from. `present`: the
        stage's workers the trainer still routes to (None: every worker seen); only their replies make
        the reference (module docstring: a newcomer is held to the workers that are there).
        `suspected_elsewhere`: whether another check suspects a worker (a self check it failed and
        has not cleared): replies computed from its are not judged either. `implicated_elsewhere`:
        whether another check flagged or suspects a worker: a trip of a worker it fed lately is
        excused once (module docstring: whose lie it is), and whether a self check of a lone worker is
        undecided. `version`: the worker's weights the reply was computed on (None: not known); a lone
        worker's reply is held to its replies of those weights (node/trainer/reply_reference.py: weights
        versions). `passes`: a worker's self checks passed so far; one since a lone worker's excused trip
        vouches for it (node/trainer/lone_worker.py)."""
        upstream = list(upstream)
        boundary = self._boundaries.get((stage, kind))
        if boundary is None:
            boundary = self._boundaries[(stage, kind)] = Boundary(deque(maxlen=self.settings.window))
        track = boundary.workers.setdefault(peer, _WorkerTrack.fresh())
        if track.flagged is not None:
            return track.flagged
        track.outlying = False
        if any(self._suspected(source) or suspected_elsewhere(source[2]) for source in upstream):
            self.tainted += 1
            return None
        track.average(features)
        boundary.replies += 1
        track.last_seen = boundary.replies
        live = None if present is None else frozenset(present) | {peer}
        others = self._others(boundary, track, live)
        alone = not others
        # Alone, or one of two with self checks to judge its scale: a trip the statistics cannot lay on it.
        paired = len(others) == 1 and self.settings.self_checks
        if (alone or paired) and vouched(track.notice, passes(peer), implicated_elsewhere(peer)):
            if alone:
                self._restart_history(boundary, peer, track)
            else:
                track.notice = None
                track.restart()
        if len(boundary.entries(live)) >= self.settings.warmup:
            tripped = self._accumulate(boundary, track, features, live, alone, version,
                                       producer=upstream[-1][2] if upstream else None)
            if tripped is not None:
                index, side, value = tripped
                if self._shared_shift(boundary, peer, index, side, live):
                    self.shifts += 1
                    for other in boundary.workers.values():
                        other.restart()
                elif (culprit := self._producer_to_blame(track, index, side)) is not None:
                    track.deflected.add(culprit)
                    track.restart()
                    self.implicated.append((stage, kind, peer, culprit, FEATURES[index]))
                elif (damager := self._implicated_producer(peer, track, implicated_elsewhere)) is not None:
                    track.pardoned.add(damager)
                    track.restart()
                    self.pardoned.append((stage, kind, peer, damager, FEATURES[index]))
                elif (alone or (paired and self._twins_may_differ(kind, index, track))) and \
                        (lone := lone_trip(track.notice, track.replies, self.settings.window,
                                           implicated_elsewhere(peer))) != "flag":
                    track.restart()
                    if lone == "excuse":
                        track.notice = LoneNotice(since=track.replies, passes=passes(peer), version=version)
                        if alone:
                            self.lone_trips += 1
                        else:
                            self.pair_trips += 1
                        self.lone_excused.append((stage, kind, peer, FEATURES[index]))
                else:
                    track.flagged = self._evidence(stage, kind, peer, boundary, track, index, side, value, live,
                                                   held_to(track.notice, version) if alone else None)
                    self._void_evidence_from(peer)
                    return track.flagged
        # A worker on its way to a flag is kept out of the reference it is held to. Alone, that reference
        # is its own history, and frozen it turns honest drift into a flag: then only a reply standing
        # OUTLIER_Z off is kept out (module docstring).
        kept_out = track.outlying if alone else track.largest() >= self.settings.threshold / 2
        if not kept_out:
            boundary.window.append((peer, features, version))
        return None

    def take_lone_trips(self) -> list[tuple[int, str, str, str]]:
        """The trips of a stage's only worker, or of one of two, excused since the last call (see `lone_excused`)."""
        taken, self.lone_excused = self.lone_excused, []
        return taken

    @staticmethod
    def _restart_history(boundary: Boundary, peer: str, track: _WorkerTrack) -> None:
        """A self check vouched for a lone worker since its excused trip: its replies leave the window, so
        its next `warmup` ones make its reference at its new level (node/trainer/lone_worker.py)."""
        kept = [entry for entry in boundary.window if entry[0] != peer]
        boundary.window.clear()
        boundary.window.extend(kept)
        track.notice = None
        track.restart()

    def take_pardoned(self) -> list[tuple[int, str, str, str, str]]:
        """The trips excused as a flagged producer's damage since the last call (see `pardoned`)."""
        taken, self.pardoned = self.pardoned, []
        return taken

    def _implicated_producer(self, peer: str, track: _WorkerTrack, implicated: Callable[[str], bool]) -> str | None:
        """A producer of `peer`'s latest replies' requests, of any kind, that was flagged or is suspected
        since (by another check, or half-way to this one's bar), and that no trip of this track was
        excused for yet; None: none."""
        producers = {producer for boundary in self._boundaries.values()
                     for owner, other in boundary.workers.items() if owner == peer
                     for producer, _ in other.deviations if producer is not None and producer != peer}
        for producer in sorted(producers - track.pardoned):
            if implicated(producer) or self._flagged_here(producer) or self.on_its_way(producer):
                return producer
        return None

    def _flagged_here(self, peer: str) -> bool:
        return any(track.flagged is not None for boundary in self._boundaries.values()
                   for owner, track in boundary.workers.items() if owner == peer)

    def take_implicated(self) -> list[tuple[int, str, str, str, str]]:
        """The trips laid on a producer since the last call (see `implicated`)."""
        taken, self.implicated = self.implicated, []
        return taken

    def forget(self, peer: str) -> None:
        """Another check (spot or gradient checks) flagged `peer`: its replies leave every reference they
        were in, and the CUSUMs measured against those restart (with two replicas its replies were half
        the reference, and the honest one's would otherwise stand off a reference the liar bent)."""
        for boundary in self._boundaries.values():
            if any(entry[0] == peer for entry in boundary.window):
                kept = [entry for entry in boundary.window if entry[0] != peer]
                boundary.window.clear()
                boundary.window.extend(kept)
                for track in boundary.workers.values():
                    track.restart()
        self._void_evidence_from(peer)

    def _void_evidence_from(self, producer: str) -> None:
        """`producer` is flagged: what other workers' replies computed from its frames added to their
        CUSUMs is void, so those start over (their deviations with its frames dropped). A stale body
        made an honest tail's gradients stand off until the tail was flagged after the body."""
        for boundary in self._boundaries.values():
            for track in boundary.workers.values():
                if track.flagged is None and any(source == producer for source, _ in track.deviations):
                    kept = [entry for entry in track.deviations if entry[0] != producer]
                    track.deviations.clear()
                    track.deviations.extend(kept)
                    track.restart()

    def outlying(self, stage: int, kind: str, peer: str) -> bool:
        """Whether `peer`'s last reply of `kind` stood `OUTLIER_Z` spreads or more off its stage's on some
        feature. One such reply cannot flag a worker (a liar that lies in short bursts keeps its CUSUMs
        under the bar: four x10 replies, then four honest), but it is worth a self check of that very
        reply: an honest worker's replies seldom stand that far off, and the check settles it."""
        boundary = self._boundaries.get((stage, kind))
        track = None if boundary is None else boundary.workers.get(peer)
        return track is not None and track.outlying

    def on_its_way(self, peer: str) -> bool:
        """Whether one of `peer`'s CUSUMs is half-way to the bar or past it (its replies are kept out of
        the reference then): a mark honest traffic stays under, unlike the suspicion of a tenth."""
        return any(self._suspected((stage, kind, peer), fraction=0.5) for stage, kind in self._boundaries)

    def _suspected(self, source: Source, fraction: float = _SUSPECT_FRACTION) -> bool:
        stage, kind, peer = source
        boundary = self._boundaries.get((stage, kind))
        track = None if boundary is None else boundary.workers.get(peer)
        return track is not None and (track.flagged is not None or track.largest() >= fraction * self.settings.threshold)

    def _accumulate(self, boundary: Boundary, track: _WorkerTrack, features: tuple[float, ...],
                    live: frozenset[str] | None, alone: bool, version: int | None = None,
                    producer: str | None = None) -> tuple[int, str, float] | None:
        """Add the reply's deviations to the worker's CUSUMs; the feature and side of the largest one
        over the threshold, if any. `alone`: no other worker of the stage is there (its own history is
        the reference); `version`: then, the weights the reply was computed on (None: not known).
        `producer`: the worker whose frame the call carried (None: none)."""
        k, worst = self.settings.drift, None
        deviations = [0.0] * len(features)
        track.deviations.append((producer, deviations))
        floor = LONE_SPREAD_FLOOR if alone else SPREAD_FLOOR
        version = held_to(track.notice, version) if alone else None
        for index, value in enumerate(features):
            reference = boundary.reference(index, floor, live, version)
            if math.isnan(value) or reference is None:
                continue
            centre, spread = reference
            z = max(-Z_CAP, min(Z_CAP, (value - centre) / spread))
            deviations[index] = z
            track.outlying = track.outlying or abs(z) >= OUTLIER_Z
            track.high[index] = max(0.0, track.high[index] + z - k)
            track.low[index] = max(0.0, track.low[index] - z - k)
            for side, cusum in (("high", track.high[index]), ("low", track.low[index])):
                if cusum > track.peak:
                    track.peak, track.peak_at = cusum, f"{FEATURES[index]} {side}"
            # Over the bar together, the content or alignment names the trip: a zero frame's scale and its
            # content trip at once, and only the latter says it is no replica on weights apart.
            content = FEATURES[index] not in _WEIGHTS_MOVE
            for side, cusum in (("high", track.high[index]), ("low", track.low[index])):
                if cusum > self.settings.threshold and (worst is None or (content, cusum) > worst[0]):
                    worst = ((content, cusum), index, side, value)
        return None if worst is None else worst[1:]

    def _shared_shift(self, boundary: Boundary, peer: str, index: int, side: str,
                      live: frozenset[str] | None) -> bool:
        """Whether at least half the stage's other recently active, unflagged workers (one at least)
        are half-way to tripping the same feature the same way."""
        others = self._others(boundary, boundary.workers[peer], live)
        half_way = self.settings.threshold / 2
        moved = [t for t in others if (t.high if side == "high" else t.low)[index] >= half_way]
        return bool(others) and 2 * len(moved) >= len(others)

    def _producer_to_blame(self, track: _WorkerTrack, index: int, side: str) -> str | None:
        """The one producer whose frames the tripping deviation came with (module docstring: whose lie
        it is), or None: the worker's replies stood off whoever produced their input, or too few came
        from each, or this worker laid a trip on that producer before."""
        sign = 1.0 if side == "high" else -1.0
        by_producer: dict[str, list[float]] = {}
        for producer, deviations in track.deviations:
            if producer is not None:
                by_producer.setdefault(producer, []).append(sign * deviations[index])
        means = {producer: statistics.fmean(zs) for producer, zs in by_producer.items()
                 if len(zs) >= _ATTRIBUTION_MIN_REPLIES}
        if len(means) < 2:
            return None
        culprit = max(means, key=means.get)
        others = [mean for producer, mean in means.items() if producer != culprit]
        k = self.settings.drift
        if means[culprit] >= k and max(others) <= k / 2 and culprit not in track.deflected:
            return culprit
        return None

    def _twins_may_differ(self, kind: str, index: int, track: _WorkerTrack) -> bool:
        """Whether a trip of one of a stage's two workers on `index` may be honest weights apart, to be
        excused and self-checked (module docstring: two workers): its scale or a direction, or an input
        gradient's content standing off by less than a constant or zero one does."""
        feature = FEATURES[index]
        if feature in _WEIGHTS_MOVE:
            return True
        if kind != "input_grad" or feature != "variation":
            return False
        recent = list(track.deviations)[-_detection_replies(self.settings):]
        latest = [abs(deviations[index]) for _, deviations in recent]
        return bool(latest) and statistics.median(latest) < OUTLIER_Z

    def _others(self, boundary: Boundary, track: _WorkerTrack, live: frozenset[str] | None) -> list[_WorkerTrack]:
        """The stage's other unflagged workers with a reply in the window's span (and, given `live`,
        still routed to)."""
        recent = boundary.replies - self.settings.window
        return [other for peer, other in boundary.workers.items()
                if other is not track and other.flagged is None and other.last_seen > recent
                and (live is None or peer in live)]

    def _evidence(self, stage: int, kind: str, peer: str, boundary: Boundary, track: _WorkerTrack, index: int,
                  side: str, value: float, live: frozenset[str] | None, version: int | None) -> Evidence:
        floor = SPREAD_FLOOR if self._others(boundary, track, live) else LONE_SPREAD_FLOOR
        centre, spread = boundary.reference(index, floor, live, version)
        cusum = (track.high if side == "high" else track.low)[index]
        return Evidence(stage=stage, kind=kind, peer=peer, feature=FEATURES[index], direction=side, cusum=cusum,
                        value=value, mean=track.mean[index], centre=centre, spread=spread, replies=track.replies)
