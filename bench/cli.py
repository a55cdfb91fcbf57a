"""`agora-bench` (also `python -m agora.bench`): the benchmark suite's flags; the suite is bench/suite.py.

A console script of its own rather than a subcommand of agora-node: the benchmarks start swarms
of agora-node roles, so they import the node, and the node never imports them. The flags are
parsed before bench/suite.py is imported (it imports torch), so `--help` and a mistyped flag
answer at once. A user's mistake (an unknown profile or preset, an --update file that is not a
suite record) is one line and exit 2, as with agora-node.
"""

from __future__ import annotations

import argparse
import sys

from agora.bench import SUITE_ROWS
from agora.node.logs import configure_logging

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agora-bench",
                                     description="Run the benchmark suite (wire bytes, swarm vs train-local, the WAN "
                                                 "profiles, averaging at equal time and equal tokens) and write its "
                                                 "table (bench/RESULTS.md); the WAN rows need root.")
    parser.add_argument("--quick", action="store_true",
                        help="every row with a few steps each (minutes): checks the suite runs, not its figures; "
                             "writes to a temporary folder unless --out")
    parser.add_argument("--profile", action="append", default=None, metavar="P",
                        help="WAN profile for row 3 (repeatable; default: every profile, --quick: lan and "
                             "agora-floor)")
    parser.add_argument("--config", action="append", default=None, metavar="PRESET",
                        help="preset for rows 2 and 3 (repeatable; default tiny and small, --quick: tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="the results file (default bench/RESULTS.md; with --update F "
                                                     "of a record other than bench/results/suite.json, F.md)")
    parser.add_argument("--json", default=None, metavar="F", help="also write every raw figure here")
    parser.add_argument("--workdir", default=None, help="keep every run's logs here (default: a temp folder)")
    parser.add_argument("--row", action="append", default=None, choices=SUITE_ROWS, metavar="N",
                        help=f"run only this row (repeatable; one of {', '.join(SUITE_ROWS)})")
    parser.add_argument("--update", default=None, metavar="F",
                        help="with --row: measure those rows again with the plan recorded in F (an earlier "
                             "--json F), keep F's other rows, and write F and the table back")
    parser.add_argument("--run", action="append", default=None, metavar="PROFILE/RUN",
                        help="with --row 3 --update F: measure only this run of row 3 again (repeatable; e.g. "
                             "'lan/tiny report shape x1 adaptive'), keep the row's other runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    configure_logging("INFO")
    try:
        from agora.bench.suite import main as run  # torch and the swarm's roles: not for parsing the flags

        return run(args, command=" ".join(["agora-bench", *argv]))
    except ValueError as error:  # the user's mistake, in one line (pipeline's ConfigError is a ValueError)
        print(f"agora-bench: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agora-bench: interrupted", file=sys.stderr)
        return 130
