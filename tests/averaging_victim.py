"""A replica that joins one averaging round and then hangs inside its all-reduce, to be killed.

Run by tests/test_averaging.py as a child process in its own session; the test kills the whole
session with SIGKILL once this peer is in the all-reduce (a machine that vanished mid-round).
Handshakes are files written atomically: `<marker>.ready` once the averager is up (its DHT
multiaddrs inside), `<marker>` once it has entered the all-reduce of the round.

    python averaging_victim.py MARKER PREFIX SIZE ROUND GROUP_SIZE INITIAL_PEER...
"""

import asyncio
import os
import sys

import torch


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as handle:
        handle.write(text)
    os.replace(path + ".tmp", path)


def main() -> None:
    marker, prefix, size, round_number, group_size, *peers = sys.argv[1:]
    torch.set_num_threads(1)

    from agora.dht import averaging
    from agora.dht.swarm import SwarmDHT

    original = averaging._AveragerProcess._run_allreduce_inplace_

    async def stall(self, *args, **kwargs):
        # In the averager process: the group is formed, the all-reduce is about to start. Say so
        # and never send a part: the others must drop this peer and finish without it.
        _write(marker, "in all-reduce\n")
        await asyncio.sleep(3600)
        await original(self, *args, **kwargs)

    averaging._AveragerProcess._run_allreduce_inplace_ = stall  # before the fork: the child inherits it
    swarm = SwarmDHT.start(initial_peers=peers)
    averager = averaging.SliceAverager.start(swarm.hivemind_dht, prefix=prefix, size=int(size), matchmaking_s=3.0,
                                             request_s=1.0, sender_s=2.0, reducer_s=4.0, round_s=20.0,
                                             part_size_bytes=16 * 1024)
    _write(marker + ".ready", "\n".join(swarm.visible_maddrs()) + "\n")
    averager.average(torch.full((int(size),), 100.0), round_number=int(round_number), weight=1.0,
                     group_size=int(group_size))
    # Only reached if nobody killed us: leave nothing behind.
    averager.shutdown()
    swarm.shutdown()


if __name__ == "__main__":
    main()
