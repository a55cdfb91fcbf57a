"""`Blame`: which worker a failed call is counted against, and the ban that follows.

A call's failure is usually its own worker's: it is dead, slow past the deadline, sent a reply
that does not decode, or refused the request. Two cases are not, and both are about values one
worker computes and the trainer relays to the next (docs/design.md "A microbatch's path"):

- A reply whose values lie far beyond what its stage's workers sent lately (`ExtremeReply`, from
  the trainer's `ReplyScales`, node/trainer/stage_client.py) is refused before it is relayed: the
  failure is its sender's, counted per worker beside the ban.
- A worker may refuse the frame another worker produced (`InputRefused`: the values overflowed
  it, or lie far beyond its own recent range; node/replica/request_frames.py `ExtremeInput`). The
  failure is then the producer's, whose call had succeeded: it is banned as if its call had failed,
  the route is abandoned and aborted as after any failure, and the error the route ends with names
  the producer, so the microbatch's next attempt excludes the producer, not the honest refuser.
  Unless the trainer's own scale for those values, warmed up, holds them ordinary and no check
  suspects the producer: a worker crying wolf would otherwise get every producer before it banned,
  so the refuser's claim is then its own failure. (While a scale warms up, the refuser is believed:
  a value that overflows a stage is at float32's limit, no honest stage produces it.) A suspected
  producer is not vouched for by the scale: with two replicas a producer scaling its values by ten
  makes half of what the scale learns from, so the scale soon holds them ordinary, while the
  verifier's statistics are half-way to flagging it within a couple of replies (an honest body
  refusing a x10 tail's gradients was blamed for them in an attack run); a self check it failed
  and has not cleared counts as well.
- A reply within every bound may still be a lie (scaled, sign-flipped, noise, a constant, a replay):
  the trainer's verifier (node/trainer/verification.py) holds each worker's replies to its stage's.
  A worker it flags is excluded for the rest of the run (`Roster.exclude`), counted and logged with
  the evidence, and the reply that showed it is refused like a failed call (`SuspectReply`): the
  route is abandoned and aborted, the microbatch rerun elsewhere. `on_flagged` then hears of it once
  (the trainer reports it to the run's authorizer, node/trainer/reports.py).
"""

from __future__ import annotations

import logging
from typing import Callable

import grpc

from agora.node.trainer.routing import Roster, WorkerView, producer_of_refused
from agora.node.trainer.stage_client import ExtremeReply, InputRefused, ReplyScales, StageCallError
from agora.node.trainer.stats import TrainerStats
from agora.node.trainer.verification import Evidence
from agora.pipeline.codec import WireCodec

__all__ = ["Blame", "ProducerBlamed", "SuspectReply"]

logger = logging.getLogger("agora.node.trainer")


class ProducerBlamed(StageCallError):
    """A worker refused the values another worker of the route produced: the failure is the producer's
    (`address`), whose call had succeeded."""


class SuspectReply(StageCallError):
    """The reply decodes and lies within every bound, but its worker's replies drifted away from its
    stage's: the verifier flagged the worker (`evidence`), and this reply is not used."""

    def __init__(self, evidence: Evidence, *, address: str, method: str):
        super().__init__(grpc.StatusCode.DATA_LOSS, f"worker flagged: {evidence.describe()}", address=address,
                         method=method)
        self.evidence = evidence


class Blame:
    """Counts failures against the right worker (module docstring); one per trainer, on its event loop."""

    def __init__(self, roster: Roster, stats: TrainerStats, scales: ReplyScales, codec: WireCodec,
                 clock: Callable[[], float], on_flagged: Callable[[Evidence], None] = lambda evidence: None,
                 suspected: Callable[[str], bool] = lambda peer: False):
        self.roster, self.stats, self.scales, self.codec, self.clock = roster, stats, scales, codec, clock
        self.on_flagged, self.suspected = on_flagged, suspected

    def failed(self, view: WorkerView, error: StageCallError) -> None:
        """A call to `view`, reserved in the roster, failed through its worker's fault."""
        if isinstance(error, ExtremeReply):
            self.stats.extreme_reply(view.peer_id, view.stage, error.kind)
        self._banned(view, self.roster.failed(view.peer_id, self.clock()), error.code.name)

    def suspect(self, view: WorkerView, evidence: Evidence, method: str) -> SuspectReply:
        """The verifier flagged `view`'s worker on a reply of `method` (first time or again, for a reply
        still in flight when it was flagged): exclude it for the rest of the run, count and log it
        once, and return the error that refuses the reply."""
        if view.peer_id not in self.roster.excluded:
            self.roster.exclude(view.peer_id)
            self.stats.flagged(view.peer_id, view.stage, evidence.kind, evidence.describe())
            logger.warning("stage %d worker %s flagged and excluded for the rest of the run: %s", view.stage,
                           view.endpoint, evidence.describe(),
                           extra={"milestone": "worker_flagged",
                                  "fields": {"endpoint": view.endpoint, **evidence.fields()}})
            self.on_flagged(evidence)
        return SuspectReply(evidence, address=view.endpoint, method=method)

    def refused_input(self, refusal: InputRefused, route: list[WorkerView], stage: int, frame: bytes | memoryview,
                      backward: bool) -> StageCallError:
        """The worker of `stage` on `route` refused the values another worker produced (a Forward's
        wire: the stage before; a Backward's output gradient: the stage after), relayed as `frame`;
        its call's reservation is released already. Counts the failure (module docstring) and
        returns the error that names who failed."""
        refuser, now = route[stage], self.clock()
        producer_index = producer_of_refused(len(route), stage, backward=backward, field=refusal.field)
        if producer_index is not None:
            producer, largest = route[producer_index], self.codec.inspect(frame).largest_magnitude
            scale = self.scales.of(producer.stage, "input_grad" if backward else "output")
            if self.suspected(producer.peer_id) or not scale.vouches(largest):
                return self._blame_producer(refusal, producer, refuser, largest, now)
        self._banned(refuser, self.roster.blamed(refuser.peer_id, now), refusal.code.name)
        return refusal

    def _blame_producer(self, refusal: InputRefused, producer: WorkerView, refuser: WorkerView, largest: float,
                        now: float) -> ProducerBlamed:
        self.stats.blamed(producer.peer_id, producer.stage)
        logger.warning("stage %d worker %s refused the %s stage %d's worker %s produced (values up to %.3g); the "
                       "failure is the producer's", refuser.stage, refuser.endpoint, refusal.field, producer.stage,
                       producer.endpoint, largest,
                       extra={"milestone": "producer_blamed",
                              "fields": {"stage": producer.stage, "endpoint": producer.endpoint,
                                         "field": refusal.field, "refused_by": refuser.endpoint, "largest": largest}})
        self._banned(producer, self.roster.blamed(producer.peer_id, now), f"{refusal.field} refused downstream")
        return ProducerBlamed(refusal.code, f"stage {refuser.stage} refused its {refusal.field}: {refusal.details}",
                              address=producer.endpoint, method=refusal.method)

    def _banned(self, view: WorkerView, ban_s: float, reason: str) -> None:
        if ban_s > 0:
            self.stats.banned()
            logger.info("ban %s (stage %d) for %.1f s: %s", view.endpoint, view.stage, ban_s, reason,
                        extra={"milestone": "ban", "fields": {"stage": view.stage, "endpoint": view.endpoint,
                                                              "seconds": ban_s, "code": reason}})
