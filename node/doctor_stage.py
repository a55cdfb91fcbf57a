"""The doctor's verdicts on the stage it would join (node/doctor_probes.py measures what they judge):
the links from this machine to the stage's current members, and the share of the stage's
microbatches this machine would take.

Design choices:

- Where the members come from: the authorizer's dry run of the Join (CheckJoin) answers a random
  sample of the assigned stage's members and every member's announced compute
  (auth/join_check.py). The DHT holds the same (the workers' records), but every DHT request needs
  a run credential (docs/design.md "The DHT", "Admission and trust"), which a node has only once
  admitted; the authorizer has one (it reads the records with its own operator credential), and
  without a DHT it still knows the addresses its admitted workers announced.
- A link is timed as a TCP connect to the member's announced port: one round trip (SYN, SYN-ACK),
  nothing that needs the member to admit the caller. Where the dry run issued a probe credential
  (auth/join_check.py), each member's link is also probed over mutual TLS (node/doctor_links.py):
  its round trip as a gRPC message each way, which replaces the connect's on the line, and its
  upload and download rates, one line each. The run's floors judge them (the RTT, the upload and
  the download floor), as admission judges the authorizer's link; a member's link past one (or no
  answer: the member may have left since its record) is a WARN, not a FAIL, since admission does
  not hold a node to it. A probe that measured nothing (the member refused it, is busy with other
  probes, runs a version without them) leaves the rates unknown, saying why; with no probe
  credential (an older or --insecure authorizer) there are no rate lines, as before.
- The share is the trainers' routing itself (node/trainer/routing.py ``Roster.choose``, which is
  ``pick_worker`` with its expected-finish and ``BALANCE_SLACK`` equal-shares rules, and its probing
  of starved replicas), run over global batches of the run's microbatches with this machine beside
  the members, each at its announced (or, for this machine, measured) compute. Queues drain between
  batches; ties, which the routing breaks by peer id, fall on each replica in turn (the ids rotate
  from batch to batch), as the arrival order of real calls spreads them. Flow control is not
  modelled: every replica has room for a batch's calls.
- The verdict WARNs when this machine would be the slowest of the stage by more than the slack:
  its time per microbatch over ``BALANCE_SLACK`` times the fastest member's, where the routing stops
  sharing equally with it and it takes only what it finishes in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from agora.node.doctor import OK, UNKNOWN, WARN, Check
from agora.node.trainer.routing import BALANCE_SLACK, Roster, WorkerView

__all__ = ["ProbedLink", "MemberLink", "member_link_checks", "predicted_share", "share_check"]

# Replicas weighed by the routing, at most, in one prediction (batches x microbatches x replicas).
_ROUTING_WORK = 2_000_000


@dataclass(frozen=True)
class ProbedLink:
    """A member's link as a link probe measured it: a round trip and the rates each way (None
    figures: the probe measured nothing, ``error`` says why)."""

    rtt_ms: Optional[float] = None
    upload_mbit: Optional[float] = None
    download_mbit: Optional[float] = None
    error: str = ""


@dataclass(frozen=True)
class MemberLink:
    """This machine's link to one member: its TCP connect's round trip (None when it did not answer,
    ``error`` says why), and its link probe's figures (None: no probe credential to probe with)."""

    address: str
    rtt_ms: Optional[float]
    error: str = ""
    probe: Optional[ProbedLink] = None


_RATE_FIXES = {"upload": "a faster uplink (or nothing else uploading now): each microbatch's activations leave "
                         "over this link",
               "download": "a faster downlink (or nothing else downloading now): each microbatch's activations "
                           "arrive over this link"}


def _floor(value: float) -> Optional[float]:
    return None if value <= 0 or value == float("inf") else value


def member_link_checks(stage: int, links: Sequence[MemberLink], max_rtt_ms: float, *, min_upload_mbit: float = 0.0,
                       min_download_mbit: float = 0.0) -> list[Check]:
    """Per member timed: its round trip against the run's RTT floor (inf: none), and where it was
    probed, its upload and download rates against the run's floors (0: none)."""
    checks = []
    for number, link in enumerate(links, 1):
        checks.append(_round_trip_check(number, stage, link, _floor(max_rtt_ms)))
        if link.probe is not None:
            checks += [_rate_check(number, stage, link, "upload", _floor(min_upload_mbit)),
                       _rate_check(number, stage, link, "download", _floor(min_download_mbit))]
    return checks


def _round_trip_check(number: int, stage: int, link: MemberLink, floor: Optional[float]) -> Check:
    name, where = f"member {number}", f"stage {stage}'s member {link.address}"
    probed = link.probe is not None and link.probe.rtt_ms is not None
    rtt_ms, how = (link.probe.rtt_ms, "a gRPC message each way") if probed else (link.rtt_ms, "TCP connect")
    if rtt_ms is None:
        return Check(name, WARN, link.address, detail=f"{where} did not answer a TCP connect: {link.error}",
                     fix="let this machine open outbound TCP connections to the swarm's ports; if only this member "
                         "fails, it may have left since it announced itself")
    if floor is not None and rtt_ms > floor:
        return Check(name, WARN, round(rtt_ms, 1), floor, "ms", detail=f"round trip ({how}) to {where}, over the "
                                                                        "run's floor",
                     fix="join from a machine nearer the swarm, on a wired link: each microbatch crosses this link")
    return Check(name, OK, round(rtt_ms, 1), floor, "ms", detail=f"round trip ({how}) to {where}")


def _rate_check(number: int, stage: int, link: MemberLink, way: str, floor: Optional[float]) -> Check:
    name, where = f"member {number} {way}", f"stage {stage}'s member {link.address}"
    rate = getattr(link.probe, f"{way}_mbit")
    if rate is None:
        return Check(name, UNKNOWN, link.address, detail=f"the link probe of {where} measured no rate: "
                                                         f"{link.probe.error}")
    what = f"{way} rate {'to' if way == 'upload' else 'from'} {where} (link probe over mutual TLS)"
    if floor is not None and rate < floor:
        return Check(name, WARN, round(rate, 1), floor, "Mbit/s", detail=what + ", under the run's floor",
                     fix=_RATE_FIXES[way])
    return Check(name, OK, round(rate, 1), floor, "Mbit/s", detail=what)


def predicted_share(own_samples_per_s: float, member_samples_per_s: Sequence[float], microbatches: int,
                    microbatch_size: int) -> float:
    """The fraction of the stage's microbatches the trainers' routing would send this machine, beside
    members announcing ``member_samples_per_s`` (0: unknown, as routing treats a newcomer), over
    global batches of ``microbatches`` (the module docstring)."""
    rates = [*member_samples_per_s, own_samples_per_s]
    replicas, own = len(rates), len(rates) - 1
    # Every rotation of the ids, several times (the probing of starved replicas counts), within a
    # bound on the routing's work (a pick weighs every replica): seconds on a stage of hundreds.
    batches = max(1, min(4 * replicas, _ROUTING_WORK // (microbatches * replicas)))
    idle, taken = [0] * replicas, 0
    for batch in range(batches):
        ids = [f"{(index + batch) % replicas:06d}" for index in range(replicas)]
        roster = Roster(microbatch_size)
        roster.refresh([WorkerView(ids[index], str(index), 0, announced_samples_per_s=rate,
                                   announced_credits=microbatches, idle_batches=idle[index])
                        for index, rate in enumerate(rates)])
        shares: dict[str, int] = {}
        for _ in range(microbatches):
            chosen = roster.choose(0, 0.0, shares=shares)
            roster.started(chosen.peer_id)
            shares[chosen.peer_id] = shares.get(chosen.peer_id, 0) + 1
        roster.batch_done(0, shares)
        idle = [roster.workers[ids[index]].idle_batches for index in range(replicas)]
        taken += shares.get(ids[own], 0)
    return taken / (batches * microbatches)


def _rates(member_samples_per_s: Sequence[float]) -> str:
    low, high = min(member_samples_per_s), max(member_samples_per_s)
    return f"{low:.3g} samples/s" if low == high else f"{low:.3g}-{high:.3g} samples/s"


def share_check(stage: int, own_samples_per_s: float, member_samples_per_s: Sequence[float], microbatches: int,
                microbatch_size: int, *, share: Optional[float] = None) -> Check:
    """The share of stage ``stage``'s microbatches this machine would take, and whether it would be the
    stage's slowest by more than the routing's slack (WARN). ``share``: ``predicted_share``'s answer,
    when the caller has it already."""
    name, own = f"share stage {stage}", f"this machine {own_samples_per_s:.3g} samples/s"
    members = len(member_samples_per_s)
    if not members:
        return Check(name, OK, 100.0, unit="%", detail=f"would take all of stage {stage}'s microbatches (no current "
                                                         f"members; {own})")
    if share is None:
        share = predicted_share(own_samples_per_s, member_samples_per_s, microbatches, microbatch_size)
    share *= 100
    if not all(rate > 0 for rate in member_samples_per_s):
        return Check(name, UNKNOWN, round(share, 1), unit="%",
                     detail=f"stage {stage} has {members} members whose compute the authorizer does not know (it "
                            f"reads no DHT): as newcomers to the routing they would leave this machine about "
                            f"{share:.0f}% ({own})")
    plural = "s" * (members > 1)
    detail = f"would take about {share:.0f}% of stage {stage}'s microbatches ({members} member{plural} at " \
             f"{_rates(member_samples_per_s)}; {own})"
    fastest = max(member_samples_per_s)
    if own_samples_per_s * BALANCE_SLACK < fastest and own_samples_per_s < min(member_samples_per_s):
        return Check(name, WARN, round(share, 1), unit="%", detail=detail + f": the stage's slowest, over "
                     f"{BALANCE_SLACK:g}x slower than its fastest member, so it takes only what it finishes in time",
                     fix="a faster accelerator (--device picks which one), or --dtype bf16 where it has bf16; "
                         "another stage (--stage) may need this machine more")
    return Check(name, OK, round(share, 1), unit="%", detail=detail)
