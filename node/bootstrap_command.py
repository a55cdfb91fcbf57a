"""`agora-node bootstrap`: a DHT peer others join first, with its metrics. The peer itself and its
flags are dht/bootstrap.py's (dht/ imports nothing of node/); this module adds the metrics and the
run its credential is for."""

from __future__ import annotations

import argparse

from agora.dht.bootstrap import BootstrapOptions, add_bootstrap_arguments, run_bootstrap
from agora.node.observability import MetricsOptions, NodeMetrics, add_metrics_arguments, package_version
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import options_from_args

__all__ = ["add_bootstrap_command"]


def add_bootstrap_command(commands) -> None:
    bootstrap = commands.add_parser("bootstrap", help="start a DHT peer that others join first",
                                    description="Start a hivemind DHT peer and print the multiaddrs that other "
                                                "peers pass as --initial-peers; serves until SIGINT/SIGTERM.")
    add_bootstrap_arguments(bootstrap)
    add_metrics_arguments(bootstrap)
    bootstrap.set_defaults(handler=_cmd_bootstrap)


def _cmd_bootstrap(args: argparse.Namespace) -> int:
    from agora.dht.swarm import DHTRequestError  # hivemind: not for --help

    options = options_from_args(BootstrapOptions, args, "bootstrap")
    metrics = NodeMetrics.for_role(options_from_args(MetricsOptions, args, "metrics"), role="bootstrap",
                                   run_id=_bootstrap_run(options), version=package_version())
    try:
        return run_bootstrap(options, on_started=lambda swarm: _serve_bootstrap_metrics(metrics, swarm))
    except (ValueError, DHTRequestError) as error:
        raise ConfigError(str(error)) from None
    finally:
        metrics.close()


def _serve_bootstrap_metrics(metrics, swarm) -> None:
    from agora.monitor.dht_metrics import DHTMetrics

    # Its requests and what its DHT carries; secured: refusals, the ban list.
    DHTMetrics(metrics.registry, swarm.bans, swarm.timings, swarm.traffic)
    metrics.serve()


def _bootstrap_run(options: BootstrapOptions) -> str:
    """The run a bootstrap's credential is for ("" for an open --insecure peer, which serves any run)."""
    if options.insecure or not options.state_dir:
        return ""
    import time

    from agora.auth.credentials import CredentialError
    from agora.auth.node_state import NodeCredentials

    try:
        return NodeCredentials(options.state_dir, clock=time.time).identity().run_id
    except (CredentialError, OSError, ValueError):
        return ""  # run_bootstrap reports the unusable state directory in one line
