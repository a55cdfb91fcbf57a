"""`TrainerOptions`: how one trainer runs, beside the run's config (a section of the settings
schema, pipeline/schema.py; `trainer`'s flags come from here). Light: the CLI imports it to build
its parser, before torch."""

from __future__ import annotations

from typing import Literal

from pydantic import StrictBool, StrictFloat, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.dht.key_families import MAX_HEARTBEAT_S
from agora.dht.records import MAX_LEASE_S
from agora.node.tracing_options import TracingOptions
from agora.pipeline.schema import SECTION, like, setting

__all__ = ["TrainerOptions", "TrainLocalOptions", "WireDtype"]

# How boundary tensors are encoded on the wire (pipeline/codec.py); a receiver decodes any.
WireDtype = Literal["fp32", "bf16", "fp16", "int8"]


@dataclass(frozen=True, config=SECTION)
class TrainerOptions:
    """How one trainer runs, beside the run's config; the fields with a flag are `trainer`'s options."""

    run_id: StrictStr = setting(help="the run's identifier", min_length=1)
    trainer_index: StrictInt = setting(
        0, "this trainer's index among --trainers: its stripe of units, preferred when it claims",
        flag="--trainer-index", ge=0)
    trainers: StrictInt = setting(1, "trainers expected to share the run (a hint for claiming; any number may join)",
                                  flag="--trainers", ge=1)
    synchronous: StrictBool = setting(
        False, "synchronous mode: one replica per stage, step barrier after every global batch", flag="--sync")
    max_in_flight: StrictInt | None = setting(
        None, "a fixed number of microbatches in the pipeline at once (default: adaptive, enough to hide the "
        "measured round trips behind the busiest stage's compute, at most --max-staleness global batches; "
        "synchronous mode: half a global batch); either way within the workers' credits",
        flag="--max-in-flight", gt=0)
    max_staleness: StrictFloat = setting(
        1.0, "adaptive depth: at most this many global batches' microbatches in flight (more in flight is faster "
        "over long round trips and converges worse)", flag="--max-staleness", gt=0)
    max_attempts: StrictInt = setting(6, "routes tried per microbatch before its global batch is given back", ge=1)
    call_timeout_s: StrictFloat = setting(60.0, "deadline of one call to a worker", gt=0)
    wait_notice_s: StrictFloat = setting(
        10.0, "a stage without a routable worker is waited for (with backoff) as long as it takes, with a line "
        "every this many seconds saying what the trainer waits for", gt=0)
    unit_failures: StrictInt = setting(
        5, "global batches failing in a row (all routes exhausted) before the run stops", ge=1)
    roster_refresh_s: StrictFloat = setting(2.0, "between two reads of the workers' records", gt=0)
    reply_bound_factor: StrictFloat = setting(
        1000.0, "a reply whose values reach beyond this many times the median largest value of its stage's recent "
        "replies (outputs and input gradients apart) is refused before it is relayed, its worker banned and the "
        "microbatch rerouted", gt=1)
    reply_bound_warmup: StrictInt = setting(
        32, "replies of a stage (of each kind) accepted before that bound applies", ge=1)
    verify_replies: StrictBool = setting(
        True, "hold every worker's replies to its stage's (node/trainer/verification.py): a worker whose values "
        "drift away from the stage's is excluded for the rest of the run and the reply that showed it is not used")
    verify_drift: StrictFloat = setting(
        3.0, "the verifier's drift allowance: standardized deviations below it add nothing to a worker's CUSUM (one "
        "counts at most 12)", gt=0, lt=12)
    verify_threshold: StrictFloat = setting(
        30.0, "the verifier's bar: a worker is flagged when a CUSUM of its deviations passes it (one reply adds at most "
        "12 minus the drift allowance: more than bar / (12 - drift) replies far off are needed)", gt=0)
    verify_warmup: StrictInt = setting(
        32, "replies of a stage (of each kind) accepted before the verifier judges any", ge=2)
    spot_check_share: StrictFloat = setting(
        0.0, "share of head and body training Forwards also sent, as a held-out Forward, to another replica of "
        "the stage with a credit free, and the two outputs compared (node/trainer/spot_checks.py): catches replayed "
        "and content lies no statistic sees, at one extra forward without autograd per check (0.02 costs under 1% of "
        "those stages' compute and names a lone liar among three replicas after some 2,400 of its stage's Forwards); "
        "a worker whose replies disagree far more often than its stage's others is excluded. 0: off (stages with "
        "fewer than three replicas can only count disagreements)", flag="--spot-check-share", ge=0, le=1)
    spot_check_tolerance: StrictFloat = setting(
        0.25, "spot checks: two answers closer than this (their L2 distance over their RMS) always agree; above it "
        "the stage's honest drift (recent agreeing checks, median + 4 spreads) sets the bar", gt=0, le=2)
    gradient_check_share: StrictFloat = setting(
        0.05, "share of each worker's training replies checked against its own held-out answers on the same "
        "weights (node/trainer/gradient_checks.py), in the background: a tail's and body's input gradient by finite "
        "differences (two held-out Forwards of its input moved along the returned gradient), which also replay its "
        "output or loss, and a head's output by one held-out replay; a check falls every 1/share replies of a "
        "worker on average, at most 2/share apart. Catches sign-flipped, scaled and noisy gradients and noisy or "
        "stale outputs no statistic sees, with any number of replicas, at some 3% of the checked stages' compute "
        "at 0.05; a failed check has the worker's next 6 replies checked, and a worker failing 2 of its "
        "last 6 is excluded. 0: off",
        flag="--gradient-check-share", ge=0, le=1)
    ledger_url: StrictStr | None = setting(
        None, "the monitor keeping the run's ledger of verified work (http://HOST:PORT): the receipts this trainer "
        "signs (with a credential, one per worker for the microbatches and tokens it accepted from it, every "
        "--receipt-every global batches, each handed to its worker too) are also posted there "
        "(node/trainer/receipts.py); needs a credential. None: the workers alone get them",
        flag="--ledger-url", pattern=r"^https?://[^\s/]+(/[^\s]*)?$")
    receipt_every_batches: StrictInt = setting(
        20, "global batches this trainer finishes between two rounds of receipts (the last round when the run "
        "ends, however short); a trainer with a credential signs them and hands each worker its own",
        flag="--receipt-every", ge=1, le=100_000)
    wire_dtype: WireDtype = setting(
        "fp32", "encoding of the boundary tensors this trainer sends (it decodes any)", flag="--wire-dtype")
    heartbeat_s: StrictFloat = setting(5.0, "seconds between announces of this trainer's progress in the DHT",
                                       flag="--heartbeat", gt=0, le=MAX_HEARTBEAT_S)
    lease_s: StrictFloat = setting(
        30.0, "seconds a claimed global batch stays this trainer's without a renewal (renewed every third of it); "
        f"a trainer that dies gives its batches back after this; peers refuse leases over {MAX_LEASE_S:g} s",
        flag="--lease", gt=0, le=MAX_LEASE_S)
    start_step: StrictInt = setting(
        0, "take the run's global batches below STEP as done (a run resumed from checkpoints of that step); the "
        "log is appended to", flag="--start-step", ge=0)
    time_budget_s: StrictFloat | None = setting(
        None, "start no global batch after this many seconds of training (those in flight finish, then the "
        "held-out evaluation); --steps still sets the schedule", flag="--time-budget", gt=0)
    log_json: StrictStr | None = setting(
        None, "write one JSON object per global batch here (appended to from --start-step on)", flag="--log-json",
        metavar="FILE")
    summary_json: StrictStr | None = setting(None, "write the final summary here", flag="--summary-json",
                                             metavar="FILE")
    evaluate: StrictBool = setting(True, "skip the held-out evaluation at the end", flag="--no-eval")
    tracing: TracingOptions = setting(default_factory=TracingOptions)

    @model_validator(mode="after")
    def _agree(self) -> "TrainerOptions":
        if self.trainer_index >= self.trainers:
            raise ValueError(f"trainer_index: {self.trainer_index} out of range for trainers={self.trainers}")
        return self


@dataclass(frozen=True, config=SECTION)
class TrainLocalOptions:
    """`train-local`'s options: the centralized reference run, which encodes its stage boundaries as a
    trainer does, so that the swarm can be compared with it at the same precision, and the files it
    writes and resumes from."""

    wire_dtype: WireDtype = like(TrainerOptions, "wire_dtype", description=(
        "encoding of the boundary tensors between stages (fp32: lossless)"))
    log_json: StrictStr | None = setting(None, "write one JSON object per step to this file", flag="--log-json",
                                         metavar="FILE")
    checkpoint_dir: StrictStr | None = setting(None, "write atomic checkpoints here", flag="--checkpoint-dir",
                                               metavar="DIR")
    resume: StrictBool = setting(False, "continue from the newest checkpoint in --checkpoint-dir", flag="--resume")

    @model_validator(mode="after")
    def _agree(self) -> "TrainLocalOptions":
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume: --resume needs --checkpoint-dir")
        return self
