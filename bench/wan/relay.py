"""The delay relay: a userspace switch that holds every frame for its link's one-way delay.

This kernel has no netem, so delay cannot come from `tc`. The harness (bench/wan/topology.py)
gives every node namespace one veth whose other end sits in a hub namespace; this process runs
in the hub and is the only thing joining those ends. It reads each frame a node sends from an
AF_PACKET socket on the node's hub-side interface, holds it until `now + delay(src, dst)`, and
writes it to the destination's hub-side interface. Rates are not this module's business: `tc tbf`
on both ends of every veth shapes upload (the node's end) and download (the hub's end, which the
frames written here pass through), in the kernel.

Design choices:
- PACKET_VNET_HDR on every socket: each frame comes with its virtio header (GSO type and size,
  partial checksum), and going out again with the same header lets the kernel finish checksums
  and segment where needed. Without it, frames with offloaded checksums would arrive corrupt, and
  the relay would have to handle MTU-sized frames one by one (tens of thousands per second at
  1 Gbit/s, too many for Python); with it, TCP hands over up to 64 KiB per frame.
- Forwarding is by destination MAC from a static table (the harness chose every MAC); broadcast,
  multicast and unknown addresses go to every other port, like a switch that has not learnt yet.
- The delay of a frame from node a to node b is (rtt_a + rtt_b) / 4: each port has an access
  round trip, and two ports of the same round trip R see R between them. Frames of one pair keep
  their order (same delay, FIFO by due time). A frame is never sent before it is due.
- One thread, one epoll: receive everything readable, send everything due, sleep until the next
  due frame or the next arrival. A full send queue (the download shaper's) drops the frame, as a
  router would; drops are counted and reported on exit.
- Real-time scheduling (SCHED_FIFO, low priority) where permitted: a relay that waits for a core
  holds every frame longer than its delay, so the links would depend on the machine's load. It
  sleeps in epoll between frames; the kernel's real-time throttling bounds it in any case.
- Ready handshake: the relay writes its ready file once every socket is bound. SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import errno
import heapq
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RelayPort", "frame_delay_s", "Relay", "main"]

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33
VNET_HEADER_BYTES = 10  # struct virtio_net_hdr
MAX_FRAME_BYTES = 65536 + VNET_HEADER_BYTES + 64
SOCKET_BUFFER_BYTES = 64 * 2**20
REALTIME_PRIORITY = 10  # of 1..99: above every ordinary process, below the kernel's own threads


@dataclass(frozen=True)
class RelayPort:
    interface: str  # the hub-side end of one node's veth
    mac: str  # the node's own MAC ("02:..."), lower case
    rtt_s: float  # the node's access round trip


def frame_delay_s(source: RelayPort, destination: RelayPort) -> float:
    """One-way delay of a frame from `source` to `destination` (see the module docstring)."""
    return (source.rtt_s + destination.rtt_s) / 4


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(part, 16) for part in mac.split(":"))


class Relay:
    def __init__(self, ports: list[RelayPort], clock=time.monotonic):
        self.ports = ports
        self.clock = clock
        self.sockets: list[socket.socket] = []
        self.by_mac: dict[bytes, int] = {_mac_bytes(p.mac): i for i, p in enumerate(ports)}
        self.delay = [[frame_delay_s(a, b) for b in ports] for a in ports]
        self.frames = 0
        self.dropped = 0
        self.bytes = 0

    def open(self) -> None:
        for port in self.ports:
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
            sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames we send ourselves
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, SOCKET_BUFFER_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, SOCKET_BUFFER_BYTES)
            sock.bind((port.interface, ETH_P_ALL))
            sock.setblocking(False)
            self.sockets.append(sock)

    def _destinations(self, source: int, frame: bytes) -> range | tuple[int, ...]:
        mac = frame[VNET_HEADER_BYTES:VNET_HEADER_BYTES + 6]
        if not mac[0] & 1:  # unicast
            port = self.by_mac.get(mac)
            if port is not None:
                return () if port == source else (port,)
        return tuple(i for i in range(len(self.ports)) if i != source)

    def run(self) -> None:
        """Relay until interrupted (the caller's signal handler raises)."""
        poller = select.epoll()
        for index, sock in enumerate(self.sockets):
            poller.register(sock.fileno(), select.EPOLLIN)
        by_fd = {sock.fileno(): index for index, sock in enumerate(self.sockets)}
        due: list[tuple[float, int, int, bytes]] = []
        sequence = 0
        while True:
            timeout = -1.0 if not due else max(0.0, due[0][0] - self.clock())
            events = poller.poll(timeout)
            now = self.clock()
            for fd, _ in events:
                source = by_fd[fd]
                sock = self.sockets[source]
                while True:
                    try:
                        frame = sock.recv(MAX_FRAME_BYTES)
                    except BlockingIOError:
                        break
                    for destination in self._destinations(source, frame):
                        sequence += 1
                        heapq.heappush(due, (now + self.delay[source][destination], sequence, destination, frame))
            now = self.clock()
            while due and due[0][0] <= now:
                _, _, destination, frame = heapq.heappop(due)
                try:
                    self.sockets[destination].send(frame)
                    self.frames += 1
                    self.bytes += len(frame) - VNET_HEADER_BYTES
                except OSError as error:
                    if error.errno not in (errno.ENOBUFS, errno.EAGAIN, errno.ENETDOWN, errno.ENXIO):
                        raise
                    self.dropped += 1

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


class _Stopped(Exception):
    """SIGTERM or SIGINT: leave the loop (epoll would otherwise resume waiting after the handler)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="delay relay between the harness's namespaces (run in the hub)")
    parser.add_argument("--ports", required=True, help="JSON file: a list of {interface, mac, rtt_s}")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--stats-file", default=None, help="frames relayed and dropped, written on exit")
    args = parser.parse_args(argv)
    ports = [RelayPort(**entry) for entry in json.loads(Path(args.ports).read_text())]
    relay = Relay(ports)

    def on_signal(signum, frame):
        raise _Stopped

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
    except OSError as error:
        print(f"relay: running without real-time priority ({error}): delays grow with the machine's load",
              file=sys.stderr)
    relay.open()
    ready = Path(args.ready_file)
    ready.with_suffix(".tmp").write_text("ready\n")
    ready.with_suffix(".tmp").rename(ready)
    try:
        relay.run()
    except _Stopped:
        pass
    finally:
        relay.close()
        if args.stats_file:
            Path(args.stats_file).write_text(json.dumps(
                {"frames": relay.frames, "dropped": relay.dropped, "bytes": relay.bytes}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
