"""A replica that joins one averaging round and then hangs inside its all-reduce, to be killed.

Run by tests/integration/test_averaging.py as a child process in its own session; the test kills the whole
session with SIGKILL once this peer is in the all-reduce (a machine that vanished mid-round).
Handshakes are lines on a pipe the test passes as file descriptor FD: `ready` once the averager
is up, `in all-reduce` once it has entered the all-reduce of the round (written by the averager
process, which inherits the descriptor). It starts matchmaking when the test writes `go` to its
stdin, as the survivors start theirs: a peer that began alone, seconds earlier, would find its
matchmaking window spent when the first survivor arrives and form a group of two without the other.

    python averaging_victim.py FD PREFIX SIZE ROUND GROUP_SIZE MATCHMAKING_S INITIAL_PEER...
"""

import asyncio
import os
import sys

import torch


def main() -> None:
    fd, prefix, size, round_number, group_size, matchmaking_s, *peers = sys.argv[1:]
    fd = int(fd)
    torch.set_num_threads(1)

    from agora.dht import averaging
    from agora.dht.swarm import SwarmDHT

    original = averaging._AveragerProcess._run_allreduce_inplace_

    async def stall(self, *args, **kwargs):
        # In the averager process: the group is formed, the all-reduce is about to start. Say so
        # and never send a part: the others must drop this peer and finish without it.
        os.write(fd, b"in all-reduce\n")
        await asyncio.Event().wait()  # until killed
        await original(self, *args, **kwargs)

    averaging._AveragerProcess._run_allreduce_inplace_ = stall  # before the fork: the child inherits it
    swarm = SwarmDHT.start(initial_peers=peers)
    averager = averaging.SliceAverager.start(swarm.hivemind_dht, prefix=prefix, size=int(size),
                                             matchmaking_s=float(matchmaking_s),
                                             request_s=1.0, sender_s=2.0, reducer_s=4.0, round_s=20.0,
                                             part_size_bytes=16 * 1024)
    os.write(fd, b"ready\n")
    if sys.stdin.readline() == "go\n":  # else the test is gone
        averager.average(torch.full((int(size),), 100.0), round_number=int(round_number), weight=1.0,
                         group_size=int(group_size))
    # Only reached if nobody killed us: leave nothing behind.
    averager.shutdown()
    swarm.shutdown()


if __name__ == "__main__":
    main()
