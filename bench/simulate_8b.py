"""Predictions for the Pluralis-8B geometry: throughput, rounds, churn and the bottleneck, by simulation.

    python -m agora.bench.simulate_8b [--replicas 10,25,50,100] [--trainers 10,30,60] [--seconds 20]
                                      [--churn-days 40] [--out bench/results/simulate_8b.md]

Geometry: pipeline/config.py's pluralis-8b preset (7 stages, layers 6/4/4/4/4/4/6, one 4096-token
sequence per microbatch, 2048 per global batch, SPARTA 5% every 20 steps). Compute per microbatch:
the body stage measured on an H200 (bench/results/gpu.md, compiled: 74.6 + 225.8 ms per 5 x 4096
tokens, 44.4% MFU), other stages scaled by their FLOPs per token (gpu_parts.model_flops_per_token
over each stage's trainable parameters, pipeline's own stage definitions). Frames: row 1's SSN bf16,
106 bytes per token each way. Trainer: row F1's 9.2 ms of relay CPU per microbatch. Links: the
report's mix, 200 Mbit/s at 80 ms, 1 Gbit/s at 40 ms and 5 Gbit/s at 20 ms in equal shares for the
workers; trainers on 1 Gbit/s at 40 ms. DHT operation: a get's and a store's p50 as
bench/dht_scale.py measured them at 8 to 64 admitted peers on 80 ms links (bench/results/
dht_scale.json: 92 to 97 ms, flat in N), read past 64 peers along the last two sizes' power law
(node/simulate/network.py's `at_size`): beyond what was measured. Averaged slice: 5% of a stage's
parameters in fp32.

Each (replicas, trainers) point is two simulations: the microbatches (tokens/s, utilization, latency,
bottleneck over `--seconds` measured once the trainers, one starting every `START_EVERY_S`, have all
started and `SETTLE_S` more have passed), then the rounds at that run's pace (a global batch every
2048 x 4096 / tokens-per-s seconds) for three rotations' worth of rounds (round durations against
the compute window between rounds: the report's Figure 4 regime, where communication no longer
hides behind compute). Churn: the run's 669 joins and 607 departures over 40 days, on 7 x 10
replicas at the 10-replica pace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agora.bench.gpu_parts import model_flops_per_token
from agora.node.averaging.sparta import stage_parameter_numels
from agora.node.simulate.scenario import scenario_from_dict
from agora.node.simulate.swarm import simulate
from agora.pipeline.config import load_config

ROOT = Path(__file__).resolve().parent
BODY_MS, BODY_FORWARD_SHARE = (74.6 + 225.8) / 5, 74.6 / (74.6 + 225.8)  # per 4096 tokens, compiled on an H200
REPORT_TOKENS_PER_S = 170_000
LINKS = [{"name": "floor", "up_mbit": 200.0, "down_mbit": 200.0, "rtt_ms": 80.0},
         {"name": "gigabit", "up_mbit": 1000.0, "down_mbit": 1000.0, "rtt_ms": 40.0},
         {"name": "fast", "up_mbit": 5000.0, "down_mbit": 5000.0, "rtt_ms": 20.0}]
JOINS, DEPARTURES, DAYS = 669, 607, 40
# Trainers start one a second (all at once, their first depths queued a minute of the tail's work at 60
# trainers before any had measured a microbatch), and the measured part begins this long after the last.
START_EVERY_S, SETTLE_S = 1.0, 20.0
TRAINER_UP_MBIT, WIRE_BYTES_PER_TOKEN = 1000.0, 106.0  # the trainers' link; a frame's bytes (row 1's SSN bf16)


def geometry() -> dict:
    config = load_config("pluralis-8b")
    stages = len(config.model.layer_split)
    trainable = [sum(stage_parameter_numels(config.model, i)) for i in range(stages)]
    flops = [model_flops_per_token(config, i, trainable[i], config.train.seq_len, recompute=True) for i in range(stages)]
    body = flops[1]
    return {"stages": stages, "ms": [BODY_MS * f / body for f in flops], "tokens": config.train.seq_len,
            "microbatches": config.train.microbatches, "every_steps": config.sync.every_steps,
            "fraction": config.sync.fraction, "n_slices": config.sync.n_slices,
            "vector_bytes": int(4 * config.sync.fraction * max(trainable)),
            "state_bytes": int(12 * trainable[1]),  # fp32 weights and two Adam moments of a body stage
            "optimizer_sync_steps": config.sync.optimizer_sync_steps}


def measured_dht(results: Path = ROOT / "results") -> dict:
    """The DHT section: [nodes, ms] of a get's and a store's p50 from bench/results/dht_scale.json."""
    rows = json.loads((results / "dht_scale.json").read_text())["rows"]
    return {"get_ms_at": [[float(r["nodes"]), r["get_p50_ms"]] for r in rows],
            "store_ms_at": [[float(r["nodes"]), r["store_p50_ms"]] for r in rows]}


def base_scenario(g: dict, replicas: int, trainers: int, seconds: float) -> dict:
    """`seconds` measured after the warm-up: the trainers' starts, then `SETTLE_S`."""
    warmup_s = (trainers - 1) * START_EVERY_S + SETTLE_S
    return {
        "run": {"seconds": warmup_s + seconds, "warmup_s": warmup_s, "stages": g["stages"],
                "tokens_per_microbatch": g["tokens"], "microbatches": g["microbatches"]},
        "compute": {"ms": g["ms"], "forward_share": BODY_FORWARD_SHARE},
        "links": [{**link, "share": 1.0} for link in LINKS] + [{"name": "trainer", "up_mbit": TRAINER_UP_MBIT,
                                                                "down_mbit": TRAINER_UP_MBIT, "rtt_ms": 40.0,
                                                                "share": 0.0}],
        "trainers": {"count": trainers, "link": "trainer", "cpu_ms": 9.2, "start_every_s": START_EVERY_S},
        "workers": {"replicas": replicas, "credits": 8},
        "wire": {"forward_bytes_per_token": WIRE_BYTES_PER_TOKEN,
                 "backward_bytes_per_token": WIRE_BYTES_PER_TOKEN},
        "dht": measured_dht(),
        "averaging": {"method": "none"},
    }


def rounds_at_pace(g: dict, replicas: int, tokens_per_s: float) -> object:
    batch_s = g["tokens"] * g["microbatches"] / tokens_per_s
    scenario = base_scenario(g, replicas, 1, 3 * g["n_slices"] * g["every_steps"] * batch_s / 20)
    scenario["run"].update(batch_s=batch_s, warmup_s=0.0)
    scenario["averaging"] = {"method": "sparta", "every_steps": g["every_steps"], "fraction": g["fraction"],
                             "vector_bytes": g["vector_bytes"], "optimizer_sync_steps": g["optimizer_sync_steps"]}
    return simulate(scenario_from_dict(scenario))


def churn(g: dict, tokens_per_s: float, days: float) -> object:
    replicas = 10
    batch_s = g["tokens"] * g["microbatches"] / tokens_per_s
    population = g["stages"] * replicas + (JOINS - DEPARTURES) / 2
    scenario = base_scenario(g, replicas, 1, days * 86400.0)
    scenario["run"].update(batch_s=batch_s, warmup_s=0.0)
    scenario["averaging"] = {"method": "sparta", "every_steps": g["every_steps"], "fraction": g["fraction"],
                             "vector_bytes": g["vector_bytes"], "optimizer_sync_steps": g["optimizer_sync_steps"]}
    scenario["churn"] = {"arrivals_per_hour": JOINS / (DAYS * 24), "admission_s": 60.0,
                         "mean_lifetime_h": population * DAYS * 24 / DEPARTURES, "state_bytes": g["state_bytes"]}
    return simulate(scenario_from_dict(scenario))


def _fmt(value, digits=0, suffix="") -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def point(g: dict, replicas: int, trainers: int, seconds: float) -> dict:
    """One (replicas, trainers) point: the microbatches' run, then the rounds at its pace."""
    result = simulate(scenario_from_dict(base_scenario(g, replicas, trainers, seconds)))
    rounds = rounds_at_pace(g, replicas, result.tokens_per_s)
    return {"replicas": replicas, "trainers": trainers, "seconds": seconds, "tokens_per_s": result.tokens_per_s,
            "utilization": result.stage_utilization, "latency_s": result.latency_s,
            "round_s": rounds.round_mean_s, "window_s": rounds.round_window_s, "bottleneck": result.bottleneck}


def _row(p: dict) -> str:
    ratio = None if not (p["round_s"] and p["window_s"]) else p["round_s"] / p["window_s"]
    util = "/".join(f"{u * 100:.0f}" for u in p["utilization"])
    return (f"| {p['replicas']} | {p['trainers']} | {p['tokens_per_s']:,.0f} | "
            f"{p['tokens_per_s'] / REPORT_TOKENS_PER_S:.2f} | {util} | {_fmt(p['latency_s'], 2, ' s')} | "
            f"{_fmt(p['round_s'], 1, ' s')} | {_fmt(p['window_s'], 0, ' s')} | {_fmt(ratio, 3)} | {p['bottleneck']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="10,25,50,100")
    parser.add_argument("--trainers", default="10,30,60")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="simulated seconds measured in each throughput run, after its trainers' starts")
    parser.add_argument("--churn-days", type=float, default=DAYS, help="0: no churn run")
    parser.add_argument("--merge", type=Path, action="append", default=[],
                        help="another run's .json (its points join this run's table and plot)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "simulate_8b.md")
    args = parser.parse_args(argv)
    g = geometry()
    points = []
    for replicas in [int(r) for r in args.replicas.split(",") if r]:  # "": only --merge's points
        for trainers in [int(t) for t in args.trainers.split(",") if t]:
            points.append(point(g, replicas, trainers, args.seconds))
            print(_row(points[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    replicas = args.replicas or '""'
    command = (f"python -m agora.bench.simulate_8b --replicas {replicas} --trainers {args.trainers} "
               f"--seconds {args.seconds:g} --churn-days {args.churn_days:g}")
    commands = [command]
    for other in args.merge:
        merged = json.loads(other.read_text())
        points += merged["points"]
        commands += merged["commands"]
    # Every point of the table and the commands that made them: another run can merge this file whole.
    args.out.with_suffix(".json").write_text(json.dumps({"points": points, "commands": commands}))
    points.sort(key=lambda p: (p["replicas"], p["trainers"]))
    ten = max((p["tokens_per_s"] for p in points if p["replicas"] == 10), default=REPORT_TOKENS_PER_S)
    text = "\n".join([
        "# Pluralis-8B predictions (agora-node's simulator)\n",
        "Written by " + "; ".join(f"`{c}`" for c in reversed(commands)) + " (the points of each, merged). "
        "Inputs and method: bench/simulate_8b.py's docstring. Per stage, ms of compute per microbatch per replica: "
        + ", ".join(f"{ms:.0f}" for ms in g["ms"]) + ".\n",
        "| replicas per stage | trainers | tokens/s | / the report's ~170k | stage utilization % | microbatch latency | "
        "round | compute window between rounds | round / window | bottleneck |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|", *map(_row, points), "",
        _churn_line(g, ten, args.churn_days) if args.churn_days > 0 else "", "", _reading(g, points), ""])
    args.out.write_text(text)
    _plot(points, args.out.with_suffix(".png"))
    print(text)
    return 0


# A point whose microbatches take this long is no pace: its trainers' send queues or first depths (`_reading`).
FLOOD_LATENCY_S = 10.0


def _span(values: list[float], digits: int = 0, suffix: str = "") -> str:
    low, high = min(values), max(values)
    return _fmt(low, digits, suffix) if f"{low:.{digits}f}" == f"{high:.{digits}f}" else \
        f"{_fmt(low, digits)}-{_fmt(high, digits, suffix)}"


def _reading(g: dict, points: list[dict]) -> str:
    """What the points say, computed from them: the compute bound beside them, where the bottleneck is,
    the rounds against their windows, and which points were still draining their first depth."""
    per_replica = g["tokens"] / (max(g["ms"]) / 1000.0)
    busiest = max(range(len(g["ms"])), key=lambda stage: g["ms"][stage])
    bounds = ", ".join(f"{r} replicas {r * per_replica:,.0f}" for r in (10, 25, 50, 100))
    simulated = sorted({p["replicas"] for p in points})

    def of_bound(p: dict) -> float:
        return p["tokens_per_s"] / (p["replicas"] * per_replica)

    # Microbatches are counted as they finish in the measured part: a part that ends with fewer in flight
    # than it began with counts a few percent past the bound (10 x 30: 1.1%); far past it, a first depth's.
    steady = [p for p in points if p["latency_s"] is not None and p["latency_s"] < FLOOD_LATENCY_S
              and of_bound(p) <= 1.03]
    draining = [p for p in points if p not in steady]
    lines = ["## Reading\n",
             f"- The compute bound (the busiest stage, stage {busiest} at {max(g['ms']):.0f} ms per microbatch, times "
             f"its replicas): {bounds} tokens/s; the report's ~170k is that bound at "
             f"{REPORT_TOKENS_PER_S / per_replica:.1f} replicas per stage of this H200 body stage's speed. Simulated "
             f"here: {', '.join(map(str, simulated))} replicas per stage."]
    if steady:
        shares = [of_bound(p) for p in steady]
        compute = [p for p in steady if p["bottleneck"].startswith("compute")]
        others = [u for p in compute for stage, u in enumerate(p["utilization"]) if stage not in (0, busiest)]
        lines.append(f"- At the {len(steady)} points past their trainers' first depths (a microbatch's latency under "
                     f"{FLOOD_LATENCY_S:g} s, tokens/s within the bound), tokens/s is {_span([100 * r for r in shares], 0, '%')} of the "
                     f"compute bound; the bottleneck is the compute of a stage at {len(compute)} of them"
                     + (f", the middle stages running at {_span([100 * u for u in others], 0, '%')} of their time"
                        if others else "") + ". A stage-balanced split (fewer layers on the busiest stage, or more "
                     "replicas there) moves it.")
    depth_bound = [p for p in points if p["bottleneck"].startswith("latency")]
    if depth_bound:
        lines.append(
            "- A trainer's adaptive depth is the microbatches that keep one replica of the busiest stage busy "
            "(node/trainer/inflight.py's `fill_depth`: a microbatch's unqueued latency over that stage's compute per "
            "microbatch), whatever the stage's replicas, so T trainers keep about T of a stage's R replicas busy "
            "until T reaches R. Where latency is the bottleneck: "
            + "; ".join(f"{p['replicas']} x {p['trainers']}: {of_bound(p):.0%} "
                        f"of the bound against T / R = {min(1.0, p['trainers'] / p['replicas']):.0%}" for p in depth_bound)
            + ". A depth that counted the stage's replicas (latency over its compute per replica) would let fewer "
            "trainers fill it, at more microbatches in flight each, hence staler; not changed here.")
    uplink_bound = [p for p in points if p["bottleneck"].startswith("the trainers' uplinks")]
    if uplink_bound:
        lines.append(_uplink_reading(g, per_replica, uplink_bound))
    timed = [p for p in points if p["round_s"] and p["window_s"]]
    if timed:
        lines.append(f"- Rounds: a round (5% of a stage, fp32, over the slowest member's link) takes "
                     f"{_span([p['round_s'] for p in timed], 0, ' s')}, against a compute window of "
                     f"{_span([p['window_s'] for p in timed], 0, ' s')} between rounds (round / window "
                     f"{_span([p['round_s'] / p['window_s'] for p in timed], 3)})" + _regime(timed) + ".")
    if draining:
        lines.append(f"- Not a pace: at {len(draining)} point(s) a microbatch took {FLOOD_LATENCY_S:g} s or more (a "
                     "trainer's send queue, or its first depths still draining), or more microbatches finished in "
                     "the measured part than the busiest stage can compute (work queued before it finishing within "
                     "it), so its tokens/s counts what happened to finish there: "
                     + "; ".join(f"{p['replicas']} x {p['trainers']} (latency {p['latency_s']:,.0f} s against "
                                 f"{p['seconds']:g} s measured, tokens/s "
                                 f"{of_bound(p):.0%} of the bound)" for p in draining)
                     + ". Read those rows as the first minutes of such a run.")
    return "\n".join(lines)


def _regime(timed: list[dict]) -> str:
    """Where the rounds stand against the report's Figure 4 regime (communication past the compute window):
    the window shrinks as tokens/s grows (a round falls due every `every_steps` global batches)."""
    over = [p for p in timed if p["round_s"] >= p["window_s"]]
    near = [p for p in timed if p["window_s"] > p["round_s"] >= 0.5 * p["window_s"]]
    if over:
        return (": communication exceeds the compute window at " + ", ".join(f"{p['replicas']} x {p['trainers']}"
                                                                           for p in over))
    if near:
        return (": averaging still hides behind compute, but takes half the window or more at "
                + ", ".join(f"{p['replicas']} x {p['trainers']} ({p['round_s'] / p['window_s']:.2f})" for p in near)
                + ", where the window shrinks with the pace")
    return ": averaging hides behind compute at every point, far from the regime where communication exceeds the window"


def _uplink_reading(g: dict, per_replica: float, bound: list[dict]) -> str:
    """Where the trainers' uplinks bound the points: what one trainer relays per microbatch, the tokens/s
    that caps a trainer at, and the trainers a swarm's compute bound then needs."""
    frames = 2 * (g["stages"] - 1)  # each stage's input wire but the head's, each gradient but the tail's
    megabits = frames * WIRE_BYTES_PER_TOKEN * g["tokens"] * 8 / 1e6 + 4 * g["tokens"] * 8 / 1e6
    full = g["tokens"] / (megabits / TRAINER_UP_MBIT)
    rates = [min(TRAINER_UP_MBIT, link["down_mbit"]) for link in LINKS]  # equal shares of the workers
    serial = g["tokens"] / (megabits / (len(rates) / sum(1 / r for r in rates)))
    needs = ", ".join(f"{r} replicas {r * per_replica / full:.0f}-{r * per_replica / serial:.0f}" for r in (10, 25, 50, 100))
    latencies = [p["latency_s"] for p in bound if p.get("latency_s") is not None]
    return (f"- The trainers' uplinks bound {len(bound)} point(s): "
            + ", ".join(f"{p['replicas']} x {p['trainers']}" for p in bound)
            + f". Every frame of a microbatch goes through its trainer ({frames} frames of "
            f"{WIRE_BYTES_PER_TOKEN * g['tokens'] / 1e3:,.0f} kB up per {g['tokens']}-token microbatch, "
            f"{megabits:.0f} Mbit), so a trainer on {TRAINER_UP_MBIT:,.0f} Mbit/s relays at most {full:,.0f} tokens/s, "
            f"and {serial:,.0f} where its frames go evenly over the link mix, as the simulator sends them: one message at "
            f"a time per uplink at the slower end's rate (a frame to a {min(rates):.0f} Mbit/s worker holds the whole "
            f"uplink; routing sends more to the faster ones). Trainers the compute bound needs between those two: "
            f"{needs}. A trainer's adaptive depth counts a frame's wait on the wire beyond its link's floor as "
            "queueing (node/trainer/inflight.py's `WireFloor`), so it does not grow into its own send queue"
            + (f": there a microbatch takes {_span(latencies, 1, ' s')}." if latencies else "."))


def _churn_line(g: dict, tokens_per_s: float, days: float) -> str:
    moved = churn(g, tokens_per_s, days)
    joined = [n for n in moved.newcomers if n.to_state_s is not None]
    members = [n.to_member_s for n in joined if n.to_member_s is not None]
    return (f"Churn at the run's rate ({JOINS} joins, {DEPARTURES} departures over {DAYS} days), 7 x 10 replicas at "
            f"{tokens_per_s:,.0f} tokens/s, {days:g} days simulated: {len(moved.newcomers) - moved.moves} joins, {moved.departures} "
            f"departures, {moved.moves} rebalancing moves; newcomers to state: mean "
            f"{_fmt(sum(n.to_state_s for n in joined) / len(joined) if joined else None, 0, ' s')}, to member: mean "
            f"{_fmt(sum(members) / len(members) if members else None, 0, ' s')} "
            f"({_fmt(sum(members) / len(members) / 3600 if members else None, 1, ' h')}; {len(members)} of "
            f"{len(joined)} members by the end).")


def _plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    for trainers in sorted({p["trainers"] for p in points}):
        line = sorted((p["replicas"], p["tokens_per_s"]) for p in points if p["trainers"] == trainers)
        axis.plot([r for r, _ in line], [tokens / 1000 for _, tokens in line], marker="o", label=f"{trainers} trainers")
    axis.axhline(REPORT_TOKENS_PER_S / 1000, color="grey", linestyle="--", label="the report's ~170k tokens/s")
    axis.set_xlabel("replicas per stage (7 stages)")
    axis.set_ylabel("simulated tokens/s (thousands)")
    axis.set_title("Pluralis-8B over the report's link mix")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
