"""The metrics every role serves: the flags, the registry, the port, the endpoint it announces.

    --metrics-port P     serve Prometheus metrics at http://HOST:P/metrics (0, the default: none;
                         auto: a port the system picks, announced in the node's DHT record)
    --metrics-host H     the address it listens on (default 127.0.0.1)
    --metrics-file F     write the endpoint it serves at (host:port) here once serving

Design choices:

- One registry per process (monitor/metrics.py `new_registry`), made here by the role's
  command and passed to everything that updates a metric; `agora_node_info` names the role.
- The server starts only after a role's forks (hivemind's DHT and averager processes): a
  process with a running thread does not fork reliably. `NodeMetrics.serve()` is that moment.
- What a node announces (its DHT record's `metrics_endpoint`) is the address scrapers dial: the
  bound host, or for a wildcard bind the node's announced host (a worker's `--announce-host`),
  else the outbound interface's (node/rpc/server.announced_host). Empty when not serving.
- `--metrics-port auto` binds a port the kernel picks, in the same call that serves it. A
  launcher (the demo) that picks a free port and hands it down races every other process on the
  machine for it: under load another one took it in between ("Address already in use") and the
  node exited before it was ready. Nodes with a DHT record announce the port they got; those
  without one (bootstrap, authorizer) write it to `--metrics-file` once serving (one line,
  host:port, written atomically, removed when the server closes), where the launcher reads its
  scrape target.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Optional

from prometheus_client import CollectorRegistry

from agora.monitor.metrics import MetricsServer, new_registry, node_info, start_metrics_server
from agora.node.rpc.server import announced_host, host_port, is_wildcard_host
from agora.pipeline.config import ConfigError
from agora.pipeline.files import atomic_write

__all__ = ["MetricsOptions", "NodeMetrics", "add_metrics_arguments", "package_version", "AUTO_PORT"]

logger = logging.getLogger("agora.node.metrics")


def package_version() -> str:
    try:
        return metadata.version("agora-node")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


# `--metrics-port auto`: any free port, bound when the server starts.
AUTO_PORT = -1


def _metrics_port(text: str) -> int:
    if text.strip().lower() == "auto":
        return AUTO_PORT
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or 'auto', got {text!r}") from None


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("metrics (Prometheus)")
    group.add_argument("--metrics-port", type=_metrics_port, default=0, metavar="P",
                       help="serve Prometheus metrics on this port at /metrics (default 0: do not serve them; "
                            "auto: a free port the system picks, announced in the node's DHT record)")
    group.add_argument("--metrics-host", default="127.0.0.1", metavar="H",
                       help="address the metrics server listens on (default 127.0.0.1; 0.0.0.0 for a remote "
                            "Prometheus)")
    group.add_argument("--metrics-file", default=None, metavar="F",
                       help="once serving, write the metrics endpoint (host:port, one line) to this file, for a "
                            "launcher's scrape targets (with --metrics-port auto: the port the system picked)")


@dataclass(frozen=True)
class MetricsOptions:
    port: int = 0  # 0: no metrics server; AUTO_PORT: any free port
    host: str = "127.0.0.1"
    file: Optional[str] = None  # where the endpoint is written once serving

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "MetricsOptions":
        return cls(port=getattr(args, "metrics_port", 0), host=getattr(args, "metrics_host", "127.0.0.1"),
                   file=getattr(args, "metrics_file", None)).validate()

    def validate(self) -> "MetricsOptions":
        if self.port != AUTO_PORT and not 0 <= self.port < 65536:
            raise ConfigError(f"--metrics-port: must be in 0..65535 (0: no metrics) or 'auto', got {self.port}")
        if self.file is not None and self.port == 0:
            raise ConfigError("--metrics-file: needs a metrics server (--metrics-port P or auto)")
        return self


@dataclass
class NodeMetrics:
    """One process's registry and (once `serve()`d) its metrics server."""

    options: MetricsOptions
    registry: CollectorRegistry = field(default_factory=new_registry)
    server: Optional[MetricsServer] = None
    endpoint: str = ""  # what the node announces; "" while not serving

    @classmethod
    def for_role(cls, options: MetricsOptions, *, role: str, run_id: str, version: str,
                 stage: Optional[int] = None) -> "NodeMetrics":
        metrics = cls(options)
        node_info(metrics.registry, role=role, run_id=run_id, version=version, stage=stage)
        return metrics

    def serve(self, announce_host: Optional[str] = None) -> str:
        """Start the server (when a port is set); the endpoint to announce, or ""."""
        if self.options.port == 0 or self.server is not None:
            return self.endpoint
        try:
            self.server = start_metrics_server(self.registry, self.options.host,
                                               0 if self.options.port == AUTO_PORT else self.options.port)
        except OSError as error:
            port = "a free port" if self.options.port == AUTO_PORT else self.options.port
            raise ConfigError(f"--metrics-port: cannot listen on {self.options.host}:{port}: "
                              f"{error.strerror or error}") from None
        host = self.options.host
        self.endpoint = host_port(announced_host(host, announce_host if is_wildcard_host(host) else None),
                                  self.server.port)
        if self.options.file is not None:
            try:
                atomic_write(self.options.file, (self.endpoint + "\n").encode(), mode=0o644)
            except OSError as error:
                self.close()
                raise ConfigError(f"--metrics-file {self.options.file}: cannot write it: "
                                  f"{error.strerror or error}") from None
        logger.info("metrics at http://%s/metrics", self.endpoint)
        return self.endpoint

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            if self.options.file is not None:
                Path(self.options.file).unlink(missing_ok=True)
