"""The hivemind DHT process a ``SwarmDHT`` owns: forked from ours, watched, stopped and reaped.

Design choices:

- hivemind runs its DHT node in a process of its own; this module is everything about that
  process as a process, so dht/swarm.py reads as the requests it sends there.
- A kill -9 of the owning process must not leave hivemind's DHT process (and its p2pd)
  serving forever: the DHT process started here exits once it is orphaned.
- A process hivemind forks from ours begins by leaving what it inherited alone
  (``begin_forked_process``); the averager's process (dht/averaging.py) begins the same way.
- What runs inside the DHT process through ``run_coroutine`` is a module-level coroutine here,
  so that it pickles by name.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from typing import Any

import hivemind

__all__ = ["READ_BEAM", "OwnedDHT", "begin_forked_process", "node_caches_locally", "node_client_mode", "node_peer_id", "node_visible_maddrs",
           "stop_process"]

logger = logging.getLogger(__name__)
# Peers a read keeps in its search (dht/swarm.py and dht/reads.py); hivemind stores a value on 5.
READ_BEAM = 8
# How often the DHT process checks that its owner is still alive.
_OWNER_CHECK_PERIOD = 1.0


class OwnedDHT(hivemind.DHT):
    """A ``hivemind.DHT`` whose process exits when the process that started it is gone.

    hivemind's DHT process survives an owner killed with SIGKILL and keeps serving; a
    watcher thread in it notices the reparenting and exits (p2pd follows its parent).
    It is a thread, not a task on the DHT's event loop, so it also works while that loop
    is busy or broken.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._owner_pid = os.getpid()
        super().__init__(*args, **kwargs)

    def run(self) -> None:
        begin_forked_process(self._owner_pid)
        super().run()


def begin_forked_process(owner_pid: int) -> None:
    """What a process hivemind forks from ours does first: leave what it inherited alone, and
    exit once its owner is gone.

    A fork copies every object of the owner, its garbage cycles too, but only the thread that
    forked; a collection here would run the inherited garbage's finalizers in this process.
    One that joins a thread waits forever (a DHT process hung so, collecting in the middle of
    a store, after the test process that forked it had run worker threads); one that calls into
    gRPC finds a core whose threads and locks did not come along (gRPC skips its fork handlers
    while a thread is in a call). Freezing moves everything inherited to the permanent
    generation, which is never collected (nor copied page by page by collections walking it);
    only what this process makes is collected.
    """
    gc.freeze()
    threading.Thread(target=_exit_when_orphaned, args=(owner_pid,), name="agora-owner-watch", daemon=True).start()


def _exit_when_orphaned(owner_pid: int) -> None:
    while os.getppid() == owner_pid:
        time.sleep(_OWNER_CHECK_PERIOD)
    logger.warning("the process that started this DHT peer is gone; exiting")
    os._exit(0)


def stop_process(dht: hivemind.DHT) -> None:
    # hivemind's shutdown asks the node to stop (it also stops p2pd), then terminates it
    # after its grace period; join so no zombie is left behind.
    try:
        dht.shutdown()
    finally:
        if dht.pid is not None:  # it was started
            if dht.is_alive():
                dht.terminate()
            dht.join(timeout=5)


# Run inside the DHT process through run_coroutine; module-level so they pickle by name.
async def node_peer_id(_dht: hivemind.DHT, node: Any) -> str:
    return str(node.peer_id)


async def node_client_mode(_dht: hivemind.DHT, node: Any) -> bool:
    return bool(node.protocol.client_mode)


async def node_caches_locally(_dht: hivemind.DHT, node: Any) -> bool:
    return bool(node.cache_locally)


async def node_visible_maddrs(_dht: hivemind.DHT, node: Any) -> list[str]:
    return [str(maddr) for maddr in await node.get_visible_maddrs()]
