"""`python -m agora.bench.wan`: the WAN harness by hand (root).

    python -m agora.bench.wan check --profile agora-floor      # build, measure, print, tear down
    python -m agora.bench.wan demo --profile residential -- --stages 3 --steps 40 --insecure
    python -m agora.bench.wan cleanup                          # namespaces a crashed run left

`demo` takes `agora-node demo`'s own flags after `--` and prints the measured links and the
demo's summary as one JSON object. Ctrl-C tears everything down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from agora.bench.wan.links import PROBE_NODE, LinksUnfaithful, measure_faithful
from agora.bench.wan.profiles import PROFILES, LinkSpec, profile_named
from agora.bench.wan.topology import TopologyError, WanTopology, cleanup_leftovers, harness_available


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _check(args) -> int:
    profile = profile_named(args.profile)
    cleanup_leftovers()
    nodes = {f"node-{i}": link for i, link in enumerate(profile.links())}
    nodes[PROBE_NODE] = LinkSpec(None, None, profile.link.rtt_ms)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="agora-wan-"))
    with WanTopology(nodes, workdir) as topology:
        measured, attempts = measure_faithful(topology, profile.name, [name for name in nodes if name != PROBE_NODE],
                                              rate_seconds=args.seconds)
    print(json.dumps({"profile": profile.name, "links": [m.as_dict() for m in measured], "attempts": attempts}))
    return 0


def _demo(args, demo_flags: list[str]) -> int:
    from agora.bench.wan.swarm import run_wan_demo
    from agora.node.cli import build_parser
    from agora.node.demo.demo import DemoOptions

    options = DemoOptions.from_args(build_parser().parse_args(["demo", *demo_flags]))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="agora-wan-"))
    run = run_wan_demo(profile_named(args.profile), options, workdir, rate_seconds=args.seconds, quiet=False)
    print(json.dumps({"profile": run.profile, "links": [m.as_dict() for m in run.links], "relay": run.relay,
                      "load_before": run.load_before, "summary": run.summary}))
    return run.code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    demo_flags: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, demo_flags = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(prog="python -m agora.bench.wan", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("check", "demo"):
        sub = commands.add_parser(name)
        sub.add_argument("--profile", required=True, choices=sorted(PROFILES))
        sub.add_argument("--seconds", type=float, default=4.0, help="each bulk transfer of the link check")
        sub.add_argument("--workdir", default=None)
    commands.add_parser("cleanup")
    args = parser.parse_args(argv)
    problem = harness_available()
    if problem:
        print(f"agora.bench.wan: error: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command == "cleanup":
            print(json.dumps({"removed": cleanup_leftovers()}))
            return 0
        return _check(args) if args.command == "check" else _demo(args, demo_flags)
    except (LinksUnfaithful, TopologyError) as error:
        print(f"agora.bench.wan: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("agora.bench.wan: interrupted; namespaces removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
