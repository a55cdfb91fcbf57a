"""`agora-node monitor`: admit the monitor, start its read-only DHT peer and its credential's
renewer, and serve the swarm's view (monitor/service.py). monitor/ reads the DHT and never node/,
so the assembly with admission lives here; the options are monitor/'s (`MonitorOptions`), read and
checked before admission. Light at the top (no hivemind): the CLI mounts the command from here.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from agora.monitor.options import MonitorOptions
from agora.node.admission import (Admission, AdmissionOptions, add_admission_arguments, admit_node, config_chooser,
                                  starting_dht_security)
from agora.node.observability import MetricsOptions, NodeMetrics, package_version
from agora.node.run_flags import add_run_arguments, run_config
from agora.node.swarm_options import SwarmOptions, add_swarm_flags
from agora.pipeline.config import ConfigError
from agora.pipeline.option_flags import add_option_flags, options_from_args

__all__ = ["add_monitor_command"]


def add_monitor_command(commands) -> None:
    monitor = commands.add_parser("monitor", help="the swarm's status page, Prometheus service discovery and metrics",
                                  description="Join the DHT read-only and serve, on one HTTP port: / (a live "
                                              "status page), /api/swarm (the same as JSON), /sd (Prometheus HTTP "
                                              "service discovery of every node's metrics endpoint) and /metrics "
                                              "(swarm-level gauges).")
    add_run_arguments(monitor, steps_help="planned run length (only for the run fingerprint at admission)")
    add_swarm_flags(monitor)
    add_option_flags(monitor.add_argument_group("monitor", "what it serves, and how often it reads the swarm"),
                     MonitorOptions)
    add_admission_arguments(monitor)
    monitor.set_defaults(handler=_cmd_monitor)


def _cmd_monitor(args: argparse.Namespace) -> int:
    from agora.dht.swarm import DHTRequestError, SwarmDHT
    from agora.monitor.service import run_monitor

    swarm_options = options_from_args(SwarmOptions, args, "swarm")
    options = options_from_args(MonitorOptions, args, "monitor")
    admission_options = options_from_args(AdmissionOptions, args, "admission")
    admission = admit_node(admission_options, role="monitor", run_id=swarm_options.run_id, stage=None,
                           config_for=config_chooser(args, run_config), initial_peers=swarm_options.initial_peers)
    credentials = admission.credentials
    if not admission.initial_peers:
        print("agora-node monitor: WARNING: no --initial-peers (and none from an authorizer): this starts a new, "
              "empty swarm to watch", file=sys.stderr)
    if options.ledger is not None and credentials is None:
        raise ConfigError("--ledger: receipts are verified against the run's root certificate; a monitor without a "
                          "credential (--insecure) has none")
    security = starting_dht_security(admission.authorizer, credentials)
    try:  # read-only: a client peer (a monitor credential's stores are refused anyway)
        swarm = SwarmDHT.start(initial_peers=admission.initial_peers, client_mode=True, security=security)
    except DHTRequestError as error:
        raise ConfigError(f"--initial-peers: {error}") from None
    metrics = NodeMetrics.for_role(MetricsOptions(), role="monitor", run_id=admission.run_id,
                                   version=package_version())

    def serving(url: str) -> None:
        print(f"monitor of run {admission.run_id!r}: status page {url}  Prometheus: {url}metrics, "
              f"service discovery {url}sd", flush=True)

    try:
        return run_monitor(swarm, options, metrics.registry, run_id=admission.run_id,
                           n_stages=len(admission.config.layer_split), on_serving=serving,
                           companions=_renewers(admission, metrics),
                           root_pem=credentials.root_pem() if credentials is not None else None)
    except OSError as error:
        raise ConfigError(f"--host/--port: cannot listen on {options.host}:{options.port} "
                          f"({error.strerror or error})") from None
    finally:
        with contextlib.suppress(Exception):
            swarm.shutdown()


def _renewers(admission: Admission, metrics: NodeMetrics) -> list:
    """The credential's renewer, when there is an authorizer to renew with (and its metrics)."""
    from agora.auth.admission import CredentialRenewer
    from agora.monitor.metrics import CredentialMetrics

    credentials = admission.credentials
    if credentials is None or not admission.authorizer:
        return []
    renewer = CredentialRenewer(admission.authorizer, credentials,
                                on_revoked=lambda reason: logging.error("monitor credential revoked: %s", reason))
    CredentialMetrics(metrics.registry, credentials.remaining_s, lambda: renewer.renewals)
    return [renewer]
