"""`agora-node bootstrap`: a DHT peer that the rest of the swarm joins first.

Design choices:

- The bootstrap peer is an ordinary DHT peer (it stores records like any other); it is
  only special in being started first and having its addresses handed out.
- Its multiaddrs go to stdout, one per line and nothing else, so scripts can capture them
  (``agora-node bootstrap > peers.txt``); logs go to the logging handlers (stderr).
- ``ready_file`` is the readiness handshake for tests and the demo: it is written
  atomically (temp file + rename) only once the peer serves, so a reader that sees the
  file sees all of it; it is removed again on clean shutdown, since the addresses in it
  stop working then.
- SIGINT/SIGTERM handlers are installed only after the DHT process has forked, so the
  child keeps default signal behaviour and the parent can still terminate it. Callers
  that run the bootstrap off the main thread (tests) pass their own ``stop`` event.
- The parameters are ``BootstrapOptions``, a section of the settings schema: ``add_bootstrap_arguments``
  mounts its generated flags on the CLI's subparser, ``options_from_args`` reads them back.
- Admission: ``--state-dir D`` holds the bootstrap's credential (an operator credential from
  ``agora-node authorizer issue --role operator --out D``; any role that may store works): the
  peer then runs the token authorizer and record validators of dht/security.py, its peer
  id is the credential's, and uncredentialed peers cannot join through it. ``--insecure`` runs
  an open peer and says so in a warning. Neither is refused: an open bootstrap is never started
  by accident, since every peer that joins through it would be open too. Admitted, it reads the
  run's ban list like every node (dht/bans.py), so it stops serving a banned peer too.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Annotated, Callable, Optional, Sequence, TextIO

from pydantic import AfterValidator, StrictBool, StrictInt, StrictStr, model_validator
from pydantic.dataclasses import dataclass

from agora.pipeline.files import atomic_write
from agora.pipeline.option_flags import add_option_flags, options_from_args
from agora.pipeline.schema import SECTION, setting

if TYPE_CHECKING:
    from agora.dht.security import DHTSecurity
    from agora.dht.swarm import SwarmDHT

__all__ = [
    "BootstrapOptions",
    "add_bootstrap_arguments",
    "host_maddrs",
    "main",
    "run_bootstrap",
    "security_from_options",
    "write_ready_file",
]

logger = logging.getLogger(__name__)

# How often the serving loop checks that the DHT process is still alive.
_LIVENESS_PERIOD = 1.0


def _ip_address(text: str) -> str:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError("expected an IPv4 or IPv6 address") from None
    return text


@dataclass(frozen=True, config=SECTION)
class BootstrapOptions:
    """The bootstrap peer's settings: a section of the settings schema (pipeline/schema.py), its
    flags generated (pipeline/option_flags.py); a bad one is one line naming `bootstrap.<field>`."""

    host: Annotated[StrictStr, AfterValidator(_ip_address)] = setting("127.0.0.1", "IP address to listen on",
                                                                      flag="--host")
    port: StrictInt = setting(0, "TCP port (0: pick a free one)", flag="--port", ge=0, le=65535)
    initial_peers: tuple[StrictStr, ...] = setting(
        (), "multiaddrs of running peers to join; repeatable (default: start a new swarm)", flag="--initial-peers",
        metavar="MADDR")
    identity_path: StrictStr | None = setting(
        None, "private key file; makes the peer id stable (--insecure only: a --state-dir holds one)",
        flag="--identity-path", min_length=1)
    ready_file: StrictStr | None = setting(None, "write the multiaddrs here once serving", flag="--ready-file",
                                           min_length=1)
    state_dir: StrictStr | None = setting(
        None, "the bootstrap's credential directory (`agora-node authorizer issue --role operator --out DIR`): only "
        "admitted peers can join and write", flag="--state-dir", metavar="DIR", min_length=1)
    insecure: StrictBool = setting(
        False, "run an open DHT peer: no credentials, unsigned records (local experiments only)", flag="--insecure")

    @model_validator(mode="after")
    def _one_identity(self) -> "BootstrapOptions":
        if self.insecure and self.state_dir is not None:
            raise ValueError("insecure: an open peer has no credential; drop --state-dir (or --insecure)")
        if self.identity_path is not None and self.state_dir is not None:
            raise ValueError("identity_path: the --state-dir holds the peer's identity; give one or the other")
        return self


def add_bootstrap_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bootstrap's flags to a (sub)parser."""
    add_option_flags(parser, BootstrapOptions)


def host_maddrs(host: str, port: int) -> list[str]:
    """The listen multiaddr for an IP address and port; ValueError names the bad field."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host: expected an IPv4 or IPv6 address, got {host!r}") from None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port: expected an integer in [0, 65535], got {port!r}")
    return [f"/ip{address.version}/{address}/tcp/{port}"]


def write_ready_file(path: str, maddrs: Sequence[str]) -> None:
    """Write one multiaddr per line so that readers never see a partial file."""
    atomic_write(path, "".join(f"{maddr}\n" for maddr in maddrs).encode())


def security_from_options(state_dir: Optional[str], insecure: bool) -> Optional[DHTSecurity]:
    """The admission of a DHT peer from ``--state-dir`` / ``--insecure`` (one of them: the section
    refuses both); ``ValueError`` names what is missing or wrong in one line."""
    if insecure:
        logger.warning("--insecure: this DHT peer admits anyone and accepts unsigned records")
        return None
    if state_dir is None:
        raise ValueError("--state-dir: give the credential directory of an admitted node "
                         "(`agora-node authorizer issue --role operator --out DIR`), or --insecure for an open swarm")
    from agora.auth.credentials import CredentialError
    from agora.dht.security import DHTSecurity

    try:
        security = DHTSecurity.from_state_dir(state_dir)
    except (CredentialError, OSError) as error:
        raise ValueError(f"--state-dir {state_dir}: {error}") from None
    if not security.may_store:
        raise ValueError(f"--state-dir {state_dir}: a {security.role} credential is read-only; a bootstrap stores "
                         "records (use an operator credential)")
    return security


def _read_bans(swarm: SwarmDHT) -> None:
    """The ban list, as every node reads it each heartbeat: this peer's validators need it too."""
    from agora.dht.swarm import DHTRequestError

    try:
        swarm.refresh_bans()
    except DHTRequestError as error:
        logger.warning("reading the ban list failed: %s", error)


def run_bootstrap(
    options: BootstrapOptions,
    *,
    stop: Optional[threading.Event] = None,
    out: Optional[TextIO] = None,
    on_started: Optional[Callable[[SwarmDHT], None]] = None,
) -> int:
    """Serve a DHT peer until SIGINT/SIGTERM (or ``stop`` is set); return an exit code.

    Exactly one of ``options.state_dir`` (the credential directory: admission on) and
    ``options.insecure``. Prints the peer's multiaddrs to ``out`` (default stdout) and writes them to
    ``options.ready_file`` once serving. Without ``stop`` it must run on the main thread.
    ``on_started(swarm)`` runs once the DHT process has forked (where a caller may start threads: a
    metrics server). Raises ``ValueError`` for a missing or unusable credential and
    ``DHTRequestError`` if it cannot start.
    """
    from agora.dht.swarm import SwarmDHT  # hivemind (and torch): not for parsing the flags

    out = sys.stdout if out is None else out
    listen = host_maddrs(options.host, options.port)
    security = security_from_options(options.state_dir, options.insecure)
    if stop is None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_bootstrap needs a stop event when not on the main thread")
    swarm = SwarmDHT.start(initial_peers=options.initial_peers, host_maddrs=listen,
                           identity_path=options.identity_path, security=security)
    restore: dict[int, object] = {}
    try:
        if stop is None:
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                restore[signum] = signal.signal(signum, lambda *_: stop.set())
        if on_started is not None:
            on_started(swarm)
        maddrs = swarm.visible_maddrs()
        for maddr in maddrs:
            print(maddr, file=out)
        out.flush()
        if options.ready_file is not None:
            write_ready_file(options.ready_file, maddrs)
        logger.info("bootstrap peer %s serving at %s", swarm.peer_id, " ".join(maddrs))
        while not stop.wait(_LIVENESS_PERIOD):
            if not swarm.alive:
                logger.error("the DHT process exited unexpectedly")
                return 1
            _read_bans(swarm)
        logger.info("bootstrap peer shutting down")
        return 0
    finally:
        for signum, handler in restore.items():
            signal.signal(signum, handler)
        swarm.shutdown()
        if options.ready_file is not None:
            try:
                os.unlink(options.ready_file)
            except FileNotFoundError:
                pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m agora.dht.bootstrap``: the same as ``agora-node bootstrap``."""
    from agora.dht.swarm import DHTRequestError

    parser = argparse.ArgumentParser(prog="agora-node bootstrap", description=__doc__.splitlines()[0])
    add_bootstrap_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_bootstrap(options_from_args(BootstrapOptions, parser.parse_args(argv), "bootstrap"))
    except (ValueError, DHTRequestError) as error:  # (ConfigError is a ValueError)
        print(f"agora-node bootstrap: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while still starting
        return 130


if __name__ == "__main__":
    sys.exit(main())
