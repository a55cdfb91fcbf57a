"""`agora-node simulate --scenario FILE [--json]`: run a scenario and print what came of it.

The scenario (node/simulate/scenario.py) is the command's only settings: a TOML file of typed
sections, so the command has no flags of its own beside the file and the output's form. A bad
file is one line naming the field, exit 2, as for any config.
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_simulate_command"]


def _cmd_simulate(args: argparse.Namespace) -> int:
    from agora.node.simulate.results import format_result
    from agora.node.simulate.scenario import load_scenario
    from agora.node.simulate.swarm import simulate

    result = simulate(load_scenario(args.scenario))
    print(json.dumps(result.as_dict(), indent=1) if args.json else format_result(result))
    return 0


def add_simulate_command(commands) -> None:
    simulate = commands.add_parser(
        "simulate", help="predict a swarm's throughput, rounds and joins from a scenario (discrete-event)",
        description="Simulates trainers, workers, links, DHT operations, averaging rounds and churn in "
                    "simulated time, calling the daemon's own routing, in-flight depth, leases, averaging "
                    "schedule, sync phases and rebalancing. Prints tokens/s, each stage's utilization, round "
                    "durations, newcomers' time to member and the bottleneck. Needs simpy.")
    simulate.add_argument("--scenario", required=True, metavar="FILE", help="the scenario, a TOML file")
    simulate.add_argument("--json", action="store_true", help="print the result as one JSON object")
    simulate.set_defaults(handler=_cmd_simulate)
