"""`ReplyChecks`: what a trainer holds each worker's reply to, beyond its format and scale.

Three checks, each in its own module, and this one to wire them into the pipeline's path and to
each other:

- the verifier (node/trainer/verification.py): every reply's statistics against its stage's, before
  the reply is relayed;
- spot checks (node/trainer/spot_checks.py): a share of head and body Forwards sent again, held
  out, to another replica of the stage, and the two outputs compared in the background;
- self checks (node/trainer/gradient_checks.py): a share of each worker's replies checked against
  its own held-out answers on the same weights, in the background.

They share one fate for the worker they name (`flagged`: excluded for the rest of the run through
`Blame.suspect`, and its replies taken out of the verifier's references) and one notion of
suspicion (`suspected`): a worker half-way to a verifier flag, or with a self check failed and not
cleared, carries the blame for what it fed others: the replies computed from its are not judged,
and a refusal of its values downstream is its failure (node/trainer/blame.py). A worker whose
verifier trip came only with one producer's frames gets that producer checked at once instead, and
a worker whose own statistics get half-way to a trip gets its next reply self-checked at once, as
does a reply standing far off its stage's on its own, and a stage's only worker whose statistics
trip is checked at once instead of flagged (node/trainer/lone_worker.py: a passed check vouches
for it, a second trip without one flags it).
Without these, a liar's victims downstream were named in its place.

The background checks send held-out Forwards through `held_out`, the trainer's timed call to a
worker (its credits reserved here, released by the call's outcome like any other).
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import torch

from agora.node.trainer.blame import Blame
from agora.node.trainer.gradient_checks import GradientChecks, Probe
from agora.node.trainer.options import TrainerOptions
from agora.node.trainer.repeats import RepeatJudge
from agora.node.trainer.routing import Roster, WorkerView
from agora.node.trainer.spot_checks import SpotChecks, SpotJudge
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence, ReplyVerifier, Source, VerifierSettings
from agora.pipeline.codec import WireCodec

__all__ = ["HeldOut", "ReplyChecks"]

logger = logging.getLogger("agora.node.trainer")

Frame = bytes | memoryview

# (worker, probe id, tokens, encoded wire or None, targets or None, full precision) -> the timed call
HeldOut = Callable[[WorkerView, str, torch.Tensor, Frame | None, torch.Tensor | None, bool], Awaitable]


class ReplyChecks:
    """The verifier, spot checks and self checks of one trainer (module docstring); on its event loop."""

    def __init__(self, options: TrainerOptions, codec: WireCodec, roster: Roster, stats: TrainerStats,
                 blame: Blame, clock: Callable[[], float], held_out: HeldOut):
        self.codec, self.roster, self.blame, self.clock, self.held_out = codec, roster, blame, clock, held_out
        # What each stage's workers send, per worker, against their stage's (None: not checked).
        self.verifier = ReplyVerifier(VerifierSettings(
            drift=options.verify_drift, threshold=options.verify_threshold, warmup=options.verify_warmup,
            window=max(2 * options.verify_warmup, 64), self_checks=options.gradient_check_share > 0)) \
            if options.verify_replies else None
        self.repeats = RepeatJudge() if options.verify_replies else None
        self.spot = SpotChecks(options.spot_check_share, SpotJudge(options.spot_check_tolerance), codec, stats,
                               flag=self.flagged)
        self.gradients = GradientChecks(options.gradient_check_share, stats, flag=self.flagged)
        blame.suspected = self.suspected

    def suspected(self, peer: str) -> bool:
        """Whether a check suspects `peer`: its verifier statistics half-way to a flag, or a self check it
        failed and has not cleared."""
        return (self.verifier is not None and self.verifier.on_its_way(peer)) or self.gradients.suspected(peer)

    def _implicated(self, peer: str) -> bool:
        """Whether a check other than the verifier's statistics flagged or suspects `peer`."""
        return peer in self.roster.excluded or self.gradients.suspected(peer)

    def flagged(self, evidence: Evidence) -> None:
        """Spot or self checks named a worker: the verifier's path (excluded, counted, logged
        `worker_flagged`); its replies leave the verifier's references."""
        view = self.roster.workers.get(evidence.peer) or WorkerView(evidence.peer, evidence.peer, evidence.stage)
        if self.verifier is not None and view.peer_id not in self.roster.excluded:
            self.verifier.forget(view.peer_id)
            self.repeats.forget(view.peer_id)
        self.blame.suspect(view, evidence, "Forward")

    def request(self, frame: Frame | None) -> torch.Tensor | None:
        """A call's request frame decoded for the verifier (None: no frame, or nothing is verified)."""
        return self.codec.decode(frame) if self.verifier is not None and frame else None

    def verify(self, view: WorkerView, kind: str, frame: Frame, request: torch.Tensor | None, method: str,
               upstream: list[Source], tokens: torch.Tensor, version: int | None = None) -> None:
        """Hold one reply's `kind` frame (none: nothing to hold) to its worker's earlier replies and to its
        stage's; `request`: the decoded frame the call carried that the reply answers token for token (a
        Forward's wire, a Backward's output gradient); `tokens`: the microbatch's; `upstream`: the route's
        replies it was computed from, to which it is added; `version`: the worker's weights the reply names.
        Raises `SuspectReply` when its worker is (or was already) flagged."""
        if self.verifier is None or not frame:
            return
        decoded = self.codec.decode(frame)
        repeated = self.repeats.observe(view.stage, kind, view.peer_id, tokens, decoded)
        if repeated is not None:
            self.flagged(repeated)
            raise self.blame.suspect(view, repeated, method)
        features = self.verifier.features(decoded, request)
        present = [worker.peer_id for worker in self.roster.of_stage(view.stage)]
        evidence = self.verifier.observe(view.stage, kind, view.peer_id, features, upstream, present,
                                         suspected_elsewhere=self.gradients.suspected,
                                         implicated_elsewhere=self._implicated, version=version,
                                         passes=self.gradients.judge.passes)
        for stage, frames, peer, producer, feature in self.verifier.take_implicated():
            logger.info("stage %d worker %s's %s stood off only with the frames %s produced: checking %s at once",
                        stage, peer, feature, producer, producer,
                        extra={"milestone": "producer_implicated",
                               "fields": {"stage": stage, "kind": frames, "peer": peer, "producer": producer,
                                          "feature": feature}})
            self.gradients.check_now(producer)
        for stage, frames, peer, producer, feature in self.verifier.take_pardoned():
            logger.info("stage %d worker %s's %s stood off after it took frames of %s, flagged or suspected since: "
                        "checking it at once instead of flagging it", stage, peer, feature, producer,
                        extra={"milestone": "victim_checked",
                               "fields": {"stage": stage, "kind": frames, "peer": peer, "producer": producer,
                                          "feature": feature}})
            self.gradients.check_now(peer)
        for stage, frames, peer, feature in self.verifier.take_lone_trips():
            whom = "only worker" if len(self.roster.of_stage(stage)) <= 1 else "worker (one of two)"
            logger.info("stage %d's %s %s: %s stood off, and no third replica says whose values moved; checking "
                        "it at once instead of flagging it", stage, whom, peer, feature,
                        extra={"milestone": "lone_worker_checked",
                               "fields": {"stage": stage, "kind": frames, "peer": peer, "feature": feature}})
            self.gradients.check_now(peer)
        if evidence is not None:
            raise self.blame.suspect(view, evidence, method)
        if self.verifier.outlying(view.stage, kind, view.peer_id):
            self.gradients.check_now(view.peer_id)  # this very reply (`ReplyVerifier.outlying`)
        self.gradients.suspicion(view.peer_id, self.verifier.on_its_way(view.peer_id))
        upstream.append((view.stage, kind, view.peer_id))

    def spot_check(self, primary: WorkerView, microbatch_id: str, tokens: torch.Tensor, wire: Frame | None,
                   output: Frame) -> None:
        """Maybe send the same Forward, held out, to another replica with a credit free, and compare the
        outputs in the background."""
        checker = self.spot.checker(primary, self.roster.of_stage(primary.stage), self.clock())
        if checker is not None:
            self.roster.started(checker.peer_id)
            duplicate = self.held_out(checker, f"{microbatch_id}.spot", tokens, wire, None, False)
            self.spot.launch(primary, checker, output, duplicate)

    def self_check(self, worker: WorkerView, microbatch_id: str, tokens: torch.Tensor, targets: torch.Tensor | None,
                   wire: Frame | None, input_grad: Frame, output_grad: Frame | None, version: int,
                   trained: tuple[Frame | float, int]) -> None:
        """When one is due, check `worker`'s reply in the background on its own held-out Forwards: its
        input gradient (computed on weights `version`; none at the head) by finite differences against
        `output_grad` (None: the tail's loss), and its training answer `trained` (the output frame or the
        tail's loss, and its weights version) by replay."""
        checks = self.gradients
        if not checks.due(worker.peer_id):
            return
        answer, trained_version = trained
        decode = self.codec.decode
        probe = Probe(decode(wire) if wire else None, decode(input_grad) if input_grad else None,
                      None if output_grad is None else decode(output_grad), tokens, targets, version,
                      trained=answer if isinstance(answer, float) else decode(answer), trained_version=trained_version)
        if not checks.probeable(probe):
            # Before any credit is reserved: a check that sends no probe releases none (a tail sending
            # zeros had two credits taken at every reply, was starved of traffic and never flagged).
            checks.stats.gradient_check_skipped(worker.stage)
            return
        probes = 2 if input_grad else 1
        checker = checks.checker(worker, self.roster.of_stage(worker.stage), self.clock(), probes=probes)
        if checker is None:
            return
        for _ in range(probes):  # the probes' credits, reserved now (free ones, or past them for an overdue check)
            self.roster.started(checker.peer_id)

        def call(view: WorkerView, probe_id: str, tokens: torch.Tensor, frame: bytes | None, targets):
            return self.held_out(view, probe_id, tokens, frame, targets, True)
        checks.launch(worker, checker, microbatch_id, probe, call)

    async def drain(self) -> None:
        """Wait for the background checks in flight."""
        await self.spot.drain()
        await self.gradients.drain()

    def verification_summary(self) -> dict:
        """The verifier's account (the workers it flagged are the stats' `flagged_by_peer`): stage-wide
        shifts it let pass, trips of a stage's only worker it excused for a self check at once, replies
        it left unjudged (computed from a suspected worker's), and the largest CUSUM each worker reached by
        stage and kind (how close honest traffic came to the bar) with the feature and side it grew on."""
        if self.verifier is None:
            return {"enabled": False}
        return {"enabled": True, "threshold": self.verifier.settings.threshold,
                "shifts": self.verifier.shifts, "lone_trips": self.verifier.lone_trips,
                "pair_trips": self.verifier.pair_trips,
                "tainted": self.verifier.tainted,
                "peak_cusum": {f"{stage}/{kind}/{peer}": round(peak, 2)
                               for (stage, kind, peer), peak in sorted(self.verifier.peaks().items())},
                "peak_feature": {f"{stage}/{kind}/{peer}": feature
                                 for (stage, kind, peer), feature in sorted(self.verifier.peak_features().items())}}
