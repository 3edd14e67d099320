#!/usr/bin/env python3
"""Delay and loss on a network namespace's link where the kernel has no
sch_netem: the packets themselves are held and dropped in the kernel's
netfilter path, through a netfilter queue (NFQUEUE) that this program serves.

iptables rules in the namespace send every IPv4 packet that leaves or enters
its link to queue N (`iptables -A OUTPUT -o eth0 -j NFQUEUE --queue-num N`,
and the same on INPUT). The kernel holds each queued packet until a verdict
comes back; this program gives each one NF_ACCEPT `delay` after it was queued
(one batch verdict releases every packet due, in arrival order) or, with
probability `loss`, NF_DROP at once. A dropped packet had already left the
sender's TCP stack (queueing returns success to it), so TCP sees it exactly as
a packet lost on the wire and retransmits it; a held one adds `delay` to
every round trip. The effect is tc netem's `delay D loss P` on that link.

The nfnetlink_queue protocol is spoken directly over a NETLINK_NETFILTER
socket (Linux's include/uapi/linux/netfilter/nfnetlink_queue.h); no library
is needed. Runs in the namespace (`ip netns exec NS nfq_netem.py ...`), binds
the queue, prints `ready` on stdout, serves until SIGTERM/SIGINT, then prints
one JSON line of counters: {"queued", "accepted", "dropped", "max_held"}.
"""
import argparse
import collections
import json
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 2
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 1, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1  # the packet's metadata only: its id is all we need
NF_DROP, NF_ACCEPT = 0, 1

NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big-endian queue number)


def attr(kind, data):
    pad = (4 - len(data) % 4) % 4
    return struct.pack("=HH", 4 + len(data), kind) + data + b"\0" * pad


class Queue:
    def __init__(self, num, maxlen):
        self.num, self.seq = num, 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.bind((0, 0))
        # A deep buffer: a burst of queued packets must not overflow it. If it
        # ever does, nothing is lost for good: the batch verdict below releases
        # every packet up to an id, the ones we never heard of too.
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.request(NFQNL_MSG_CONFIG, attr(NFQA_CFG_CMD, struct.pack(">BxH", NFQNL_CFG_CMD_BIND, 0)))
        self.request(NFQNL_MSG_CONFIG, attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)))
        self.request(NFQNL_MSG_CONFIG, attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", maxlen)))

    def send(self, kind, attrs, flags=NLM_F_REQUEST):
        self.seq += 1
        body = NFGENMSG.pack(socket.AF_UNSPEC, 0, socket.htons(self.num)) + attrs
        hdr = NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags,
                             self.seq, 0)
        self.sock.send(hdr + body)

    def request(self, kind, attrs):
        """A configuration message, answered by the kernel's ack or error."""
        self.send(kind, attrs, NLM_F_REQUEST | NLM_F_ACK)
        while True:
            for mtype, payload in self.messages(self.sock.recv(65536)):
                if mtype == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", payload)
                    if err:
                        raise OSError(-err, f"nfnetlink_queue config of queue {self.num}")
                    return

    def verdict(self, verdict, packet_id, batch=False):
        kind = NFQNL_MSG_VERDICT_BATCH if batch else NFQNL_MSG_VERDICT
        self.send(kind, attr(NFQA_VERDICT_HDR, struct.pack(">II", verdict, packet_id)))

    @staticmethod
    def messages(buf):
        off = 0
        while off + NLMSG_HDR.size <= len(buf):
            length, mtype, _, _, _ = NLMSG_HDR.unpack_from(buf, off)
            if length < NLMSG_HDR.size:
                break
            yield mtype, buf[off + NLMSG_HDR.size:off + length]
            off += (length + 3) & ~3

    @staticmethod
    def packet_id(payload):
        off = NFGENMSG.size
        while off + 4 <= len(payload):
            length, kind = struct.unpack_from("=HH", payload, off)
            if length < 4:
                break
            if kind & 0x7FFF == NFQA_PACKET_HDR:
                return struct.unpack_from(">I", payload, off + 4)[0]
            off += (length + 3) & ~3
        return None


def serve(q, delay, loss, rng, stop):
    held = collections.deque()  # (due, packet id), in arrival (= id) order
    stats = {"queued": 0, "accepted": 0, "dropped": 0, "max_held": 0}
    packet = (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET
    while not stop[0]:
        wait = 0.05 if not held else max(0.0, held[0][0] - time.monotonic())
        try:
            ready, _, _ = select.select([q.sock], [], [], wait)
        except InterruptedError:
            continue
        if ready:
            # Drain what is there without blocking, then release what is due.
            while True:
                try:
                    buf = q.sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                now = time.monotonic()
                for mtype, payload in q.messages(buf):
                    pid = q.packet_id(payload) if mtype == packet else None
                    if pid is None:
                        continue
                    stats["queued"] += 1
                    if rng.random() < loss:
                        q.verdict(NF_DROP, pid)
                        stats["dropped"] += 1
                    else:
                        held.append((now + delay, pid))
            stats["max_held"] = max(stats["max_held"], len(held))
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
            stats["accepted"] += 1
        if last is not None:
            q.verdict(NF_ACCEPT, last, batch=True)
    # Let everything still held go, so that stopping never strands a packet.
    if held:
        q.verdict(NF_ACCEPT, held[-1][1], batch=True)
        stats["accepted"] += len(held)
    return stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True, help="the NFQUEUE number to serve")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="hold each packet this long")
    ap.add_argument("--loss", type=float, default=0.01, help="drop each packet with this probability")
    ap.add_argument("--maxlen", type=int, default=65536, help="packets the kernel may hold queued")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if not 0 <= args.loss < 1 or args.delay_ms < 0:
        ap.error("--loss must be in [0, 1) and --delay-ms >= 0")
    stop = [False]

    def on_signal(signum, frame):
        stop[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        q = Queue(args.queue, args.maxlen)
    except OSError as e:
        print(f"nfq_netem: cannot serve netfilter queue {args.queue}: {e}", file=sys.stderr)
        return 1
    print("ready", flush=True)
    stats = serve(q, args.delay_ms / 1000.0, args.loss, random.Random(args.seed), stop)
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
