"""The metrics every role serves: the flags (`MetricsOptions`, a section of the settings schema), the
registry, the port, the endpoint it announces.

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
from typing import Annotated, Literal, Optional

from prometheus_client import CollectorRegistry
from pydantic import Field, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from agora.monitor.metrics import MetricsServer, new_registry, node_info, start_metrics_server
from agora.node.rpc.server import announced_host, host_port, is_wildcard_host
from agora.pipeline.config import ConfigError
from agora.pipeline.files import atomic_write
from agora.pipeline.option_flags import add_option_flags
from agora.pipeline.schema import SECTION, setting

__all__ = ["MetricsOptions", "NodeMetrics", "add_metrics_arguments", "package_version"]

logger = logging.getLogger("agora.node.metrics")


def package_version() -> str:
    try:
        return metadata.version("agora-node")
    except metadata.PackageNotFoundError:  # running from a source tree without an install
        return "0+unknown"


@pydantic_dataclass(frozen=True, config=SECTION)
class MetricsOptions:
    """Where a role serves its metrics: a section of the settings schema (pipeline/schema.py), so a
    bad value is one line naming `metrics.<field>` before the role starts anything."""

    port: Annotated[StrictInt, Field(ge=0, le=65535)] | Literal["auto"] = setting(
        0, "serve Prometheus metrics on this port at /metrics (0: do not serve them; auto: a free port the system "
        "picks, announced in the node's DHT record)", flag="--metrics-port", metavar="P")
    host: StrictStr = setting("127.0.0.1", "address the metrics server listens on (0.0.0.0 for a remote Prometheus)",
                              flag="--metrics-host", metavar="H", min_length=1)
    file: StrictStr | None = setting(
        None, "once serving, write the metrics endpoint (host:port, one line) to this file, for a launcher's scrape "
        "targets (with --metrics-port auto: the port the system picked)", flag="--metrics-file", metavar="F",
        min_length=1)

    @model_validator(mode="after")
    def _served(self) -> "MetricsOptions":
        if self.file is not None and self.port == 0:
            raise ValueError("file: needs a metrics server (--metrics-port P or auto)")
        return self


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    add_option_flags(parser.add_argument_group("metrics (Prometheus)"), MetricsOptions)


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
        auto = self.options.port == "auto"
        try:
            self.server = start_metrics_server(self.registry, self.options.host, 0 if auto else self.options.port)
        except OSError as error:
            port = "a free port" if auto else self.options.port
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
