"""The rows of the suite (bench/suite.py): each function runs one item's variants side by side and
returns plain data (the report, bench/suite_report.py, turns it into RESULTS.md).

What each folds in rather than copies: row 1 is bench/wire_bytes.py's measurement, row 2
bench/swarm_vs_local.py's runs, row 5 bench/averaging.py's references (train-local, its dense
control, and the same recipe averaged exactly in one process). Rows 3 and 4 run the demo on the
WAN harness (bench/wan/). Variants of one row alternate (A, B, A, B) so that load from elsewhere on
the machine weighs on each alike, and every run records the load average before and after it.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from agora.bench import averaging as averaging_bench
from agora.bench import swarm_vs_local, trainer_relay, wire_bytes
from agora.bench.wan.profiles import LinkSpec, Profile, profile_named
from agora.bench.wan.swarm import chaos_spares, wan_session
from agora.node.demo.demo import DemoOptions
from agora.pipeline.config import load_config

__all__ = ["SuitePlan", "Shape", "shapes", "wire_row", "local_row", "profiles_row", "equal_time_row",
           "convergence_row", "relay_row", "join_row", "profile_runs", "Row3Session", "row3_sessions",
           "row3_run_names"]

# The Agora report's AsyncSPARTA cadence: 5% of a stage every 20 local steps.
REPORT_FRACTION, REPORT_EVERY = 0.05, 20


@dataclass(frozen=True)
class SuitePlan:
    quick: bool
    configs: tuple[str, ...]  # rows 2 and 3
    profiles: tuple[str, ...]  # row 3 (lan is always measured first: the reference)
    stages: dict[str, int]
    steps: dict[str, int]  # row 3, per config
    repeats: int  # A, B, A, B
    equal_time_s: float  # row 4: each run's training time
    crossover_mbit: tuple[float, ...]  # row 4: link rates at the report's 80 ms
    convergence_steps: int  # row 5
    keep_graphs: int  # row 2's kept-graph variant
    local_steps: dict[str, int]  # row 2, per config
    equal_time_repeats: int = 1  # row 4
    local_variants: tuple[str, ...] = ("sync", "async", "async, kept graphs", "async, half a batch in flight")
    # Row 3: every variant on these profiles (and the tuned ones), the adaptive depth alone on the rest.
    depth_variants: tuple[str, ...] = ("adaptive", "half a batch", "adaptive, staleness 4")
    depth_profiles: tuple[str, ...] = ("lan", "agora-floor")
    profile_repeats: int = 1  # row 3 (every variant of a profile in turn on the same topology)
    equal_time_variants: tuple[str, ...] = ("sparta, the report's cadence", "everything every step", "no averaging")
    convergence_swarms: tuple[str, ...] = ("demo --replicas 2 (sparta)", "demo --replicas 1")  # row 5
    insecure: bool = False  # rows 2, 4 and 5 without admission (row 3 is always admitted)
    tuned_profiles: tuple[str, ...] = ()  # row 3 again with hosts that keep the window after idle
    relay_geometries: tuple[str, ...] = ("tiny", "pluralis-8b")  # the relay fix's before and after
    relay_microbatches: int = 200
    join_profiles: tuple[str, ...] = ("lan", "agora-floor", "residential")  # row 7: chaos newcomers
    join_budget_s: float = 150.0  # row 7: each run's training time
    join_chaos_s: float = 30.0  # row 7: seconds between kills
    seed: int = 0
    rate_seconds: float = 4.0  # each bulk transfer of a link check
    # The report's batch shape, scaled down (rows 2 and 3): per config, (sequences, microbatches) per
    # global batch and the global batches a run trains. And the report's own many microbatches per
    # batch on tiny's dimensions (None: not run), measured on `report_profiles` in row 3.
    wide: dict[str, tuple[int, int]] = field(default_factory=lambda: {"tiny": (32, 32), "small": (32, 32)})
    wide_steps: dict[str, int] = field(default_factory=lambda: {"tiny": 24, "small": 6})
    report_shape: tuple[int, int] | None = (256, 256)
    report_steps: int = 3
    report_profiles: tuple[str, ...] = ("lan", "agora-floor")
    # Row 3: the wide shape of `wide_trainer_configs` with each of these trainer counts on `wide_profiles`
    # (one trainer elsewhere, and for the other configs).
    wide_trainers: tuple[int, ...] = (1, 2, 4)
    wide_profiles: tuple[str, ...] = ("lan", "agora-floor", "residential")
    wide_trainer_configs: tuple[str, ...] = ("tiny",)


@dataclass(frozen=True)
class Shape:
    """One batch shape of a config, as rows 2 and 3 label it: "tiny" (the preset's), "tiny wide",
    "tiny report shape"."""

    label: str
    config: str
    batch_size: int | None  # None: the preset's
    microbatches: int | None
    local_steps: int  # row 2's runs
    steps: int  # row 3's runs

    @property
    def narrow(self) -> bool:
        return self.batch_size is None

    def flags(self) -> list[str]:
        if self.narrow:
            return []
        return ["--batch-size", str(self.batch_size), "--microbatches", str(self.microbatches)]


def shapes(plan: SuitePlan) -> list[Shape]:
    """Every config in its preset's shape, then wide, then tiny in the report's shape."""
    narrow = [Shape(config, config, None, None, plan.local_steps[config], plan.steps[config]) for config in plan.configs]
    wide = [Shape(f"{config} wide", config, *plan.wide[config], plan.wide_steps[config], plan.wide_steps[config])
            for config in plan.configs if config in plan.wide]
    report = [] if plan.report_shape is None or "tiny" not in plan.configs else [
        Shape("tiny report shape", "tiny", *plan.report_shape, plan.report_steps, plan.report_steps)]
    return narrow + wide + report


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _figures(summary: dict) -> dict:
    """What the report reads from a demo summary."""
    return {key: summary.get(key) for key in ("tokens_per_s", "heldout_loss", "steps", "tokens", "wall_s",
                                              "time_split_by_stage", "trainer_split", "in_flight", "outcome",
                                              "calls", "busy_retries", "busy_share", "bans", "reroutes",
                                              "dht_requests", "compute_by_stage", "cpu_by_process", "host_cpu")}


# ----------------------------------------------------------------------------- row 1


def wire_row() -> dict:
    rows = {}
    for geometry in wire_bytes.geometries():
        measured = {f"{mode}-{dtype}": wire_bytes.measure(geometry, mode, dtype) for mode, dtype in wire_bytes.VARIANTS}
        rows[geometry.name] = {name: {"forward_per_token": r.per_token(r.forward_bytes),
                                      "backward_per_token": r.per_token(r.backward_bytes)}
                               for name, r in measured.items()}
        rows[geometry.name]["d_over_k"] = geometry.d_model / geometry.rank
    return rows


# ----------------------------------------------------------------------------- row 2


def local_row(plan: SuitePlan, work: Path) -> dict:
    """Swarm tokens/s over train-local's on loopback, per config in its preset's shape: sync, async
    (adaptive depth), async with kept forward graphs, and async at half a global batch (the former
    fixed default); in the wide and the report's shape, async against train-local of that shape."""
    result = {}
    for shape in shapes(plan):
        config = shape.config
        run = swarm_vs_local.run_flags(config, plan.stages[config], shape.local_steps, plan.seed) + shape.flags()
        half = max(1, load_config(config).train.microbatches // 2)
        variants = {"sync": ["--sync"], "async": [], "async, kept graphs": ["--keep-graphs", str(plan.keep_graphs)],
                    "async, half a batch in flight": ["--max-in-flight", str(half)]}
        security = ["--insecure"] if plan.insecure else []
        variants = {name: flags + security for name, flags in variants.items()
                    if name in plan.local_variants and (shape.narrow or name == "async")}
        runs: dict[str, list[dict]] = {name: [] for name in ["train-local", *variants]}
        folder = work / f"local-{shape.label.replace(' ', '-')}"
        folder.mkdir(parents=True, exist_ok=True)
        for repeat in range(plan.repeats):
            before = _load()
            rate, heldout = swarm_vs_local.train_local(run, folder)
            runs["train-local"].append({"tokens_per_s": rate, "heldout_loss": heldout, "load": [before, _load()]})
            for name, flags in variants.items():
                before = _load()
                summary = swarm_vs_local.demo(run, flags, folder, f"{name.replace(' ', '_')}-{repeat}")
                runs[name].append({**_figures(summary), "load": [before, _load()]})
        result[shape.label] = {"stages": plan.stages[config], "steps": shape.local_steps, "runs": runs,
                               "batch": _batch(shape)}
    return result


def _batch(shape: Shape) -> dict:
    """The global batch a shape's runs train on: sequences and microbatches."""
    train = load_config(shape.config).train
    return {"sequences": shape.batch_size or train.batch_size, "microbatches": shape.microbatches or train.microbatches}


# ----------------------------------------------------------------------------- row 3


def wide_runs(plan: SuitePlan, profile: str) -> list[tuple[Shape, int]]:
    """Row 3's runs of the wide and the report's shape on `profile`: (shape, trainers), adaptive depth,
    one replica per stage."""
    runs = []
    for shape in shapes(plan):
        if shape.narrow:
            continue
        if shape.label.endswith("report shape"):
            if profile in plan.report_profiles:
                runs.append((shape, 1))
            continue
        several = profile in plan.wide_profiles and shape.config in plan.wide_trainer_configs
        counts = plan.wide_trainers if several else plan.wide_trainers[:1]
        runs += [(shape, count) for count in counts]
    return runs


def wide_key(shape: Shape, trainers: int) -> str:
    return f"{shape.label} x1 adaptive" + (f", {trainers} trainers" if trainers > 1 else "")


def profile_runs(plan: SuitePlan) -> list[tuple[str, bool, list[int], tuple[str, ...]]]:
    """Row 3's sessions in order: (profile, tuned hosts, replica counts, depth variants). lan comes
    first and is the reference for every other; a profile with a straggler runs 2 replicas per stage,
    so lan then runs 2 as well, or that ratio would have nothing to divide by."""
    names = ["lan"] + [name for name in plan.profiles if name != "lan"]
    sessions = [(name, False) for name in names] + [(name, True) for name in plan.tuned_profiles]
    straggled = any(profile_named(name).straggler is not None for name, _ in sessions)
    runs = []
    for name, tuned in sessions:
        if profile_named(name).straggler is not None:
            replicas = [2]
        else:
            replicas = [1, 2] if name == "lan" and straggled else [1]
        depth = plan.depth_variants if (name in plan.depth_profiles or tuned) else plan.depth_variants[:1]
        runs.append((name, tuned, replicas, depth))
    return runs


@dataclass(frozen=True)
class Row3Session:
    """One WAN session of row 3: a profile (on tuned hosts or not), the widest swarm its topology
    must hold, and its runs in the order they run: (key, repeat, demo options)."""

    name: str
    tuned: bool
    widest: DemoOptions
    runs: tuple[tuple[str, int, DemoOptions], ...]

    @property
    def label(self) -> str:
        return f"{self.name} (tuned hosts)" if self.tuned else self.name

    @property
    def folder(self) -> str:
        return f"wan-{self.label.replace(' ', '_').replace('(', '').replace(')', '')}"


def row3_sessions(plan: SuitePlan) -> list[Row3Session]:
    """Row 3's sessions and runs, as `profiles_row` runs them: per profile, the narrow shape's depth
    variants per config and replica count, then the wide and report shapes (`wide_runs`)."""
    sessions = []
    for name, tuned, replicas, names in profile_runs(plan):
        wide = [] if tuned else wide_runs(plan, name)
        trainers = max([1] + [count for _, count in wide])
        widest = DemoOptions(stages=max(plan.stages.values()), replicas=max(replicas), trainers=trainers)
        runs = []
        for config in plan.configs:
            half = max(1, load_config(config).train.microbatches // 2)
            for count in replicas:
                variants = {variant: overrides for variant, overrides in
                            (("adaptive", {}), ("half a batch", {"max_in_flight": half}),
                             ("adaptive, staleness 4", {"max_staleness": 4.0}))
                            if variant in names and (count == 1 or variant == "adaptive")}
                for repeat in range(plan.profile_repeats):
                    for variant, overrides in variants.items():
                        runs.append((f"{config} x{count} {variant}", repeat, DemoOptions(
                            config=config, stages=plan.stages[config], steps=plan.steps[config], seed=plan.seed,
                            replicas=count, **overrides)))
        for repeat in range(plan.profile_repeats):
            for shape, count in wide:
                runs.append((wide_key(shape, count), repeat, DemoOptions(
                    config=shape.config, stages=plan.stages[shape.config], steps=shape.steps, seed=plan.seed,
                    trainers=count, settings={"train.batch_size": shape.batch_size,
                                              "train.microbatches": shape.microbatches})))
        sessions.append(Row3Session(name, tuned, widest, tuple(runs)))
    return sessions


def row3_run_names(plan: SuitePlan) -> list[str]:
    """Every run of row 3 as `--run` names it: "PROFILE/RUN" (e.g. "lan/tiny report shape x1 adaptive")."""
    return list(dict.fromkeys(f"{s.label}/{key}" for s in row3_sessions(plan) for key, _, _ in s.runs))


def profiles_row(plan: SuitePlan, work: Path, only: frozenset[str] | None = None) -> dict:
    """Tokens/s under each profile over tokens/s on lan, per config, at the adaptive depth and at
    half a global batch in flight; the straggler profile with 2 replicas per stage (against lan with 2);
    the wide shape with 1, 2 and 4 trainers, and the report's shape (`wide_runs`). `only`: these runs
    alone ("PROFILE/RUN", `row3_run_names`), each in its session as the whole row would run it (the
    same topology, sized for the session's widest swarm); sessions with none of them are skipped."""
    result: dict = {"profiles": {}}
    for session in row3_sessions(plan):
        runs = [run for run in session.runs if only is None or f"{session.label}/{run[0]}" in only]
        if not runs:
            continue
        entry: dict = {"runs": {}}
        folder = work / session.folder
        with wan_session(profile_named(session.name), session.widest, folder, rate_seconds=plan.rate_seconds,
                         tuned_hosts=session.tuned) as wan:
            entry["links"] = [m.as_dict() for m in wan.links]
            entry["link_check_attempts"] = wan.link_check_attempts
            for key, repeat, options in runs:
                run = wan.run(options, folder / f"{key.replace(' ', '_').replace(',', '')}-{repeat}")
                entry["runs"].setdefault(key, []).append(
                    {**_figures(run.summary), "load": [list(run.load_before), _load()], "code": run.code})
            entry["relay"] = wan.topology.relay_stats()
        result["profiles"][session.label] = entry
    return result


# ----------------------------------------------------------------------------- row 4


def _averaging(summary: dict) -> dict:
    figures = averaging_bench.averaging_figures(summary) if summary.get("tokens_per_s") else {}
    return {"outcomes": figures.get("outcomes"), "bytes_per_param_per_local_step": figures.get(
        "bytes_per_param_per_local_step"), "blocked_fraction": figures.get("blocked_fraction"),
        "bytes_per_global_step": figures.get("bytes_per_global_step"), "lag_steps": figures.get("lag_steps")}


EQUAL_TIME_VARIANTS = {
    "sparta, the report's cadence": {"settings": {"sync.method": "sparta", "sync.fraction": REPORT_FRACTION,
                                                  "sync.every_steps": REPORT_EVERY}},
    "everything every step": {"settings": {"sync.method": "sparta", "sync.fraction": 1.0, "sync.every_steps": 1}},
    "no averaging": {"settings": {"sync.method": "none"}},
}


def equal_time_row(plan: SuitePlan, work: Path) -> dict:
    """Held-out loss after the same training time over agora-floor, 2 replicas per stage, for the
    report's sparse cadence, full averaging every step and none; then the first two again at other
    link rates (same 80 ms round trip) to find where full averaging stops paying."""
    base = profile_named("agora-floor")
    points = [(base.link.upload_mbit, base)]
    for mbit in plan.crossover_mbit:
        if mbit != base.link.upload_mbit:
            points.append((mbit, Profile(f"{mbit:g} Mbit/s, 80 ms", LinkSpec(mbit, mbit, base.link.rtt_ms),
                                         f"{mbit:g} Mbit/s each way, 80 ms RTT")))
    steps = 4000  # the schedule's length: no run reaches it within the time budget
    result: dict = {"time_budget_s": plan.equal_time_s, "schedule_steps": steps, "points": {}}
    for mbit, profile in points:
        variants = {k: v for k, v in EQUAL_TIME_VARIANTS.items() if k in plan.equal_time_variants
                    and (profile is base or k != "no averaging")}
        widest = DemoOptions(stages=3, replicas=2, trainers=1, insecure=plan.insecure)
        folder = work / f"equal-time-{mbit:g}"
        point: dict = {"runs": {}}
        with wan_session(profile, widest, folder, rate_seconds=plan.rate_seconds) as session:
            point["links"] = [m.as_dict() for m in session.links]
            for repeat in range(plan.equal_time_repeats):
                for name, overrides in variants.items():
                    options = DemoOptions(config="tiny", stages=3, replicas=2, steps=steps, seed=plan.seed,
                                          time_budget_s=plan.equal_time_s, insecure=plan.insecure, **overrides)
                    run = session.run(options, folder / f"{name.replace(' ', '_').replace(',', '')}-{repeat}")
                    point["runs"].setdefault(name, []).append(
                        {**_figures(run.summary), **_averaging(run.summary), "load": [list(run.load_before), _load()]})
        result["points"][f"{mbit:g}"] = point
    return result


# ----------------------------------------------------------------------------- row 5


def convergence_row(plan: SuitePlan, work: Path) -> dict:
    """Held-out loss after equal tokens on loopback (tiny, 3 stages, 2 replicas, tiny's sparta
    cadence): the swarm against the same recipe run exactly in one process, against train-local, and
    the subspace model against its dense control."""
    steps = plan.convergence_steps
    base = load_config("tiny")
    config = replace(base, seed=plan.seed, model=replace(base.model, basis_seed=plan.seed),
                     data=replace(base.data, seed=plan.seed),
                     optim=replace(base.optim, total_steps=steps)).with_stages(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        local = averaging_bench.train_local(config, steps)
        dense = averaging_bench.train_local(replace(config, model=replace(config.model, rank=None)), steps)
        exact = averaging_bench.ideal_sparta(config, steps, 2)
    finally:
        torch.set_num_threads(threads)
    run = ["--config", "tiny", "--stages", "3", "--steps", str(steps), "--schedule-steps", str(steps),
           "--seed", str(plan.seed)] + (["--insecure"] if plan.insecure else [])
    folder = work / "convergence"
    folder.mkdir(parents=True, exist_ok=True)
    swarms = {}
    for name, flags in (("demo --replicas 2 (sparta)", ["--replicas", "2", "--averaging", "sparta"]),
                        ("demo --replicas 1", ["--replicas", "1"])):
        if name not in plan.convergence_swarms:
            continue
        before = _load()
        summary = swarm_vs_local.demo(run, flags, folder, name.split()[-1].strip("()"))
        swarms[name] = {**_figures(summary), **_averaging(summary), "load": [before, _load()]}
    sync = config.sync
    return {"steps": steps, "sync": {"fraction": sync.fraction, "every_steps": sync.every_steps},
            "train_local": local, "dense": dense, "exact_in_process": exact, "swarm": swarms}


# ----------------------------------------------------------------------------- row 7


def join_row(plan: SuitePlan, work: Path) -> dict:
    """Seconds from a newcomer's start to member, per profile: `demo --chaos` (a worker or the trainer
    killed -9 every `join_chaos_s`, a newcomer with a new identity and empty state started in its
    place, on a spare node of the profile's link) on tiny, 3 stages x 2 replicas. Member: the first
    line of the newcomer's log that says so; state: its download finished (node/demo/chaos.py); a
    worker that never got there by the end (killed, or still syncing) is kept as None, so the table
    can say so."""
    result: dict = {"chaos_s": plan.join_chaos_s, "time_budget_s": plan.join_budget_s, "profiles": {}}
    widest = DemoOptions(stages=3, replicas=2, trainers=1, insecure=plan.insecure)
    for name in plan.join_profiles:
        folder = work / f"join-{name}"
        with wan_session(profile_named(name), widest, folder, rate_seconds=plan.rate_seconds,
                         spares=chaos_spares(widest)) as session:
            # More steps than the budget allows: the trainers' time budget ends the run (a newcomer
            # trainer's starts at its own start), not the step count.
            options = DemoOptions(config="tiny", stages=3, replicas=2, steps=4000, seed=plan.seed,
                                  insecure=plan.insecure, time_budget_s=plan.join_budget_s,
                                  chaos_s=plan.join_chaos_s, chaos_seed=plan.seed, lease_s=5.0)
            run = session.run(options, folder / "chaos")
        churn = run.summary.get("churn") or {}
        workers = [j for j in churn.get("joins", []) if j.get("name", "").startswith("worker")]
        result["profiles"][name] = {"links": [m.as_dict() for m in session.links], "kills": churn.get("kills"),
                                    "worker_joins_s": [j.get("seconds_to_member") for j in workers],
                                    "worker_states_s": [j.get("seconds_to_state") for j in workers],
                                    "units": churn.get("units"),
                                    "load": [list(run.load_before), _load()], "outcome": run.summary.get("outcome"),
                                    "code": run.code}
    return result


# ----------------------------------------------------------------------------- the relay fix


def relay_row(plan: SuitePlan) -> dict:
    """The trainer's CPU per microbatch relaying frames, before and after (bench/trainer_relay.py)."""
    return trainer_relay.measure(list(plan.relay_geometries), plan.relay_microbatches, repeats=plan.repeats + 1)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None
