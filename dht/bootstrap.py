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
- The parameters live in ``BootstrapOptions`` with ``add_bootstrap_arguments`` /
  ``BootstrapOptions.from_args`` so the CLI can mount them on its own subparser.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Optional, Sequence, TextIO

from agora.dht.swarm import DHTRequestError, SwarmDHT

__all__ = [
    "BootstrapOptions",
    "add_bootstrap_arguments",
    "host_maddrs",
    "main",
    "run_bootstrap",
    "write_ready_file",
]

logger = logging.getLogger(__name__)

# How often the serving loop checks that the DHT process is still alive.
_LIVENESS_PERIOD = 1.0


@dataclass(frozen=True)
class BootstrapOptions:
    host: str = "127.0.0.1"
    port: int = 0
    initial_peers: tuple[str, ...] = ()
    identity_path: Optional[str] = None
    ready_file: Optional[str] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BootstrapOptions:
        return cls(
            host=args.host,
            port=args.port,
            initial_peers=tuple(args.initial_peers or ()),
            identity_path=args.identity_path,
            ready_file=args.ready_file,
        )


def add_bootstrap_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bootstrap's flags to a (sub)parser."""
    defaults = BootstrapOptions()
    parser.add_argument("--host", default=defaults.host, help="IP address to listen on (default %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="TCP port, 0 picks a free one")
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        action="extend",
        default=[],
        metavar="MADDR",
        help="multiaddrs of running peers to join (default: start a new swarm)",
    )
    parser.add_argument("--identity-path", default=None, help="private key file; makes the peer id stable")
    parser.add_argument("--ready-file", default=None, help="write the multiaddrs here once serving")


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
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=".ready-", dir=directory)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write("".join(f"{maddr}\n" for maddr in maddrs))
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def run_bootstrap(
    host: str = "127.0.0.1",
    port: int = 0,
    initial_peers: Sequence[str] = (),
    identity_path: Optional[str] = None,
    ready_file: Optional[str] = None,
    *,
    stop: Optional[threading.Event] = None,
    out: Optional[TextIO] = None,
) -> int:
    """Serve a DHT peer until SIGINT/SIGTERM (or ``stop`` is set); return an exit code.

    Prints the peer's multiaddrs to ``out`` (default stdout) and writes them to
    ``ready_file`` once serving. Without ``stop`` it must run on the main thread.
    Raises ``ValueError`` for a bad host/port and ``DHTRequestError`` if it cannot start.
    """
    out = sys.stdout if out is None else out
    listen = host_maddrs(host, port)
    if stop is None and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_bootstrap needs a stop event when not on the main thread")
    swarm = SwarmDHT.start(initial_peers=initial_peers, host_maddrs=listen, identity_path=identity_path)
    restore: dict[int, object] = {}
    try:
        if stop is None:
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                restore[signum] = signal.signal(signum, lambda *_: stop.set())
        maddrs = swarm.visible_maddrs()
        for maddr in maddrs:
            print(maddr, file=out)
        out.flush()
        if ready_file is not None:
            write_ready_file(ready_file, maddrs)
        logger.info("bootstrap peer %s serving at %s", swarm.peer_id, " ".join(maddrs))
        while not stop.wait(_LIVENESS_PERIOD):
            if not swarm.alive:
                logger.error("the DHT process exited unexpectedly")
                return 1
        logger.info("bootstrap peer shutting down")
        return 0
    finally:
        for signum, handler in restore.items():
            signal.signal(signum, handler)
        swarm.shutdown()
        if ready_file is not None:
            try:
                os.unlink(ready_file)
            except FileNotFoundError:
                pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m agora.dht.bootstrap``: the same as ``agora-node bootstrap``."""
    parser = argparse.ArgumentParser(prog="agora-node bootstrap", description=__doc__.splitlines()[0])
    add_bootstrap_arguments(parser)
    options = BootstrapOptions.from_args(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_bootstrap(
            options.host, options.port, options.initial_peers, options.identity_path, options.ready_file
        )
    except (ValueError, DHTRequestError) as error:
        print(f"agora-node bootstrap: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while still starting
        return 130


if __name__ == "__main__":
    sys.exit(main())
