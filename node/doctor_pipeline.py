"""The doctor's verdict on the pipeline (node/doctor_command.py gathers what it judges): each
stage's capacity, the pipeline's bottleneck, and what this machine would do to it on the stage it
would join.

Design choices:

- A stage's capacity is in microbatches/s: the sum over its members of 1 / their time per
  microbatch. The figures are the authorizer's dry run's (auth/join_check.py ``stage_capacity``:
  each stage's members and their announced compute in all, from the workers' DHT records). A
  worker announces the moving average of its jobs' rates (node/replica/compute.py), and a stage
  runs two jobs per microbatch (a Forward and a Backward) except the last, which runs one (the
  loss and its backward): a member's time per microbatch is that many jobs at the run's microbatch
  size over its announced compute. Exact for jobs of equal cost; where a Backward costs more than a
  Forward it is the jobs' mean, as this machine's own figure is (node/doctor_probes.py).
- A pipeline runs no faster than its stage of least capacity, its bottleneck (ties: the lowest
  index). A stage without members has none: the pipeline does not run until it has one. A stage
  with a member of unknown compute (an authorizer that reads no DHT, a worker before its first
  job) is unknown, and so is the bottleneck, unless some stage has no members at all.
- This machine's stage with it: the routing's predicted share ``s`` (node/doctor_stage.py
  ``predicted_share``) splits each global batch; the members finish their 1 - s at their capacity,
  this machine its s at its own, and the stage is done with the later of the two:
  min(members / (1 - s), own / s). Above the members' capacity alone unless the routing gives this
  machine more than it finishes in time (equal shares within ``BALANCE_SLACK``, or the probes of a
  starved replica far slower than the rest: the batch a probe falls in waits for it), where it
  falls below it.
- The verdict is ok when joining raises the pipeline's bottleneck or leaves it where it is, and
  names the bottleneck as the stage that needs this machine more when its own is not it: spare
  capacity is information, not a fault. It WARNs only when joining would lower the pipeline's
  throughput (its stage falls below the bottleneck it was not, or below its own capacity as the
  bottleneck). It is unknown when a capacity, or this machine's compute, is.
"""

from __future__ import annotations

from typing import Optional, Sequence

from agora.auth.policy import jobs_per_microbatch
from agora.node.doctor import OK, WARN, Check, unknown
from agora.protos.authorizer_adapter import StageCapacity

__all__ = ["UNIT", "stage_rates", "capacity_with", "bottleneck", "capacity_checks",
           "bottleneck_check", "pipeline_checks"]

UNIT = "microbatches/s"


def stage_rates(stages: Sequence[StageCapacity], microbatch_size: int) -> list[Optional[float]]:
    """Each stage's capacity in microbatches/s, in stage order (None: a member's compute is unknown)."""
    return [None if stage.unknown_members else
            stage.samples_per_s / (microbatch_size * jobs_per_microbatch(stage.stage, len(stages)))
            for stage in stages]


def capacity_with(members_per_s: float, own_per_s: float, share: float) -> float:
    """A stage's microbatches/s with this machine taking ``share`` of them (the module docstring)."""
    if share <= 0:
        return members_per_s
    if share >= 1:
        return own_per_s
    return min(members_per_s / (1 - share), own_per_s / share)


def bottleneck(rates: Sequence[Optional[float]]) -> Optional[int]:
    """The stage of least capacity, ties to the lowest index; None while unknown (a stage without
    members is it whatever the unknowns)."""
    known = [(rate, stage) for stage, rate in enumerate(rates) if rate is not None]
    if not known:
        return None
    rate, stage = min(known)
    return stage if rate == 0 or len(known) == len(rates) else None


def _shown(rate: float) -> float:
    return float(f"{rate:.3g}")


def capacity_checks(stages: Sequence[StageCapacity], rates: Sequence[Optional[float]]) -> list[Check]:
    """One line per stage: its capacity and its members, the bottleneck said."""
    slowest = bottleneck(rates)
    checks = []
    for stage, rate in zip(stages, rates):
        name, plural = f"capacity stage {stage.stage}", "s" * (stage.members != 1)
        if rate is None:
            checks.append(unknown(name, f"{stage.members} member{plural}, {stage.unknown_members} of unknown compute "
                                        f"(an authorizer that reads no DHT, or a worker before its first job)"))
            continue
        detail = (f"{stage.members} member{plural} at {stage.samples_per_s:.3g} samples/s in all" if stage.members
                  else "no members: the pipeline does not run until it has one")
        if stage.stage == slowest:
            detail += "; the pipeline's bottleneck"
        checks.append(Check(name, OK, _shown(rate), unit=UNIT, detail=detail))
    return checks


def _becomes(rates: Sequence[Optional[float]], stage: int, after: float) -> tuple[Optional[int], Optional[float]]:
    """The bottleneck, and its capacity, once ``stage`` runs at ``after``."""
    joined = [after if index == stage else rate for index, rate in enumerate(rates)]
    slowest = bottleneck(joined)
    return slowest, None if slowest is None else joined[slowest]


def _unknown_why(stage: int, slowest: Optional[int], pipeline: Optional[float], before: Optional[float]) -> str:
    named = "" if slowest is None else f"the pipeline's bottleneck is stage {slowest} ({pipeline:.3g} {UNIT}); "
    if before is None:
        return named + f"stage {stage}'s capacity is unknown: some of its members' compute is"
    if slowest is None:
        return "some stages' capacity is unknown: some of their members' compute is"
    return named + f"stage {stage}'s capacity with this machine is unknown: its compute was not timed"


def bottleneck_check(stage: int, rates: Sequence[Optional[float]], after: Optional[float]) -> Check:
    """Whether ``stage`` is the pipeline's bottleneck, and would be with this machine on it at
    ``after`` microbatches/s (None: unknown), judged as the module docstring says."""
    slowest = bottleneck(rates)
    before = rates[stage]
    pipeline = None if slowest is None else rates[slowest]
    if pipeline is None or before is None or after is None:
        return unknown("bottleneck", _unknown_why(stage, slowest, pipeline, before))
    then, pipeline_then = _becomes(rates, stage, after)
    assert then is not None and pipeline_then is not None
    moves = f"stage {stage} would go from {before:.3g} to {after:.3g} {UNIT} with this machine"
    if pipeline_then < pipeline:
        return Check("bottleneck", WARN, _shown(after), _shown(pipeline), UNIT, against="bottleneck",
                     detail=f"{moves}, below the pipeline's {pipeline:.3g} {UNIT} now: it would "
                            f"{'remain' if slowest == stage else 'become'} the bottleneck, slower (its share of the "
                            f"routing, probes included, takes it longer than the members take the rest)",
                     fix="a faster accelerator (--device picks which one), or --dtype bf16 where it has bf16")
    if slowest != stage:
        detail = (f"the pipeline's bottleneck is stage {slowest} ({pipeline:.3g} {UNIT}); {moves}, which does not "
                  f"raise it: stage {slowest} needs this machine more (--stage {slowest})")
    elif then == stage:
        detail = f"{moves}: it is the pipeline's bottleneck and would remain it"
    else:
        detail = f"{moves}: it is the pipeline's bottleneck now, stage {then} ({pipeline_then:.3g} {UNIT}) " \
                 "would be then"
    return Check("bottleneck", OK, _shown(after), _shown(pipeline), UNIT, against="bottleneck", detail=detail)


def pipeline_checks(stage: int, stages: Sequence[StageCapacity], n_stages: int, microbatch_size: int, *,
                    own_samples_per_s: Optional[float], share: Optional[float]) -> list[Check]:
    """Every stage's capacity line and the bottleneck's, for this machine on ``stage`` at
    ``own_samples_per_s`` taking ``share`` of its microbatches (None: not timed)."""
    if [capacity.stage for capacity in stages] != list(range(n_stages)):
        why = ("the authorizer reports no stage capacities (a version before them)" if not stages else
               f"the authorizer reported capacities of stages {[capacity.stage for capacity in stages]}, the run has "
               f"{n_stages}")
        return [unknown("bottleneck", why)]
    rates = stage_rates(stages, microbatch_size)
    members = rates[stage]
    after = None
    if members is not None and own_samples_per_s is not None and share is not None:
        own = own_samples_per_s / (microbatch_size * jobs_per_microbatch(stage, n_stages))
        after = capacity_with(members, own, share)
    return capacity_checks(stages, rates) + [bottleneck_check(stage, rates, after)]
