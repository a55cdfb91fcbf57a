"""`python -m agora.node ...` is `agora-node ...` (the console script's entry point too).

SIGTERM is taken over before anything heavy is imported. A swarm role (bootstrap, join, trainer,
monitor, authorizer) told to stop while it is still starting (importing torch, being admitted,
joining the DHT) stops there and exits 0: it has nothing to withdraw or save, and it installs its
own handler (a clean leave) once it serves. Any other command stops as if interrupted (exit 130).
"""

import os
import signal
import sys


SERVICES = {"bootstrap", "join", "trainer", "monitor", "authorizer"}


def _stop_while_starting(signum, frame) -> None:
    if len(sys.argv) > 1 and sys.argv[1] in SERVICES:
        os.write(2, b"agora-node: stopped (SIGTERM) before it was serving\n")
        raise SystemExit(0)
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, _stop_while_starting)
    from agora.node.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
