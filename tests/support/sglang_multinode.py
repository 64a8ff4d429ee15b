"""A stand-in for how the nodes of one multi-node sglang 0.5.23 group start: the ports each node binds or
connects to, in sglang's order, on real sockets, so that a launcher's wait can be tried against it here.

    node = SglangNode(node_args(argv), timeout_s=8)   # argv: the node's sglang command (reads it with sglang's parser)
    node.start()                                       # a thread, as `python -m sglang.launch_server` would be
    node.joined.wait(5)                                # True once the group has formed, as this node sees it
    node.stop()

The order, read in sglang 0.5.23 (deploy/ops/group.py cites the lines; docs/multi-node-start.md tells it):
- With attention DP, node 0 binds the worker-port handshake, a ZMQ REP socket on the dist-init port + 13, and
  answers until `nnodes - 1` nodes have asked it for the worker ports; only then do its schedulers start, and
  torch.distributed's rendezvous listens on the dist-init port. A node > 0 asks from a ZMQ REQ socket, which
  connects (and reconnects) by itself and waits for the answer (sglang: 600 s), then joins the rendezvous.
- Without attention DP there is no handshake: node 0 listens on the dist-init port at once.
- Joining the rendezvous: a node > 0 connects to the dist-init port, retrying until its timeout as torch's
  TCPStore client does, and says its rank; node 0 counts the ranks (a connection that says nothing, such as
  a launcher's TCP probe, is no node) and answers each once all are in, as a store barrier would.
"""

from __future__ import annotations

import argparse
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

__all__ = ["HANDSHAKE_PORT_DELTA", "NodeArgs", "SglangNode", "node_args"]

# srt/server_args.py:729 (DP_ATTENTION_HANDSHAKE_PORT_DELTA).
HANDSHAKE_PORT_DELTA = 13
POLL_S = 0.05
JOINED = b"joined"


@dataclass(frozen=True)
class NodeArgs:
    """What one node's sglang command says about the group."""

    dist_host: str
    dist_port: int
    nnodes: int
    node_rank: int
    attn_dp_size: int

    @property
    def handshake_port(self) -> int:
        return self.dist_port + HANDSHAKE_PORT_DELTA


def node_args(argv: Sequence[str]) -> NodeArgs:
    """The group's layout as sglang 0.5.23's own parser reads `argv` (`-m sglang.launch_server ...`), the
    deprecated `--dp-size N --enable-dp-attention` turned into attention DP N as its parallel hook does
    (srt/arg_groups/parallel_hook.py:39-60)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = list(argv)
    if args[:2] == ["-m", "sglang.launch_server"]:
        args = args[2:]
    parsed = parser.parse_args(args)
    attn_dp = int(parsed.attn_dp_size)
    if attn_dp == 1 and parsed.enable_dp_attention:
        attn_dp = int(parsed.dp_size)
    host, _, port = str(parsed.dist_init_addr).rpartition(":")
    return NodeArgs(host.strip("[]"), int(port), int(parsed.nnodes), int(parsed.node_rank), attn_dp)


class SglangNode:
    """One node of the group, started as a thread; `joined` is set once the group has formed, `state` says
    where it is, `error` why it gave up (its timeout passed, or a port was taken)."""

    def __init__(self, args: NodeArgs, timeout_s: float) -> None:
        self.args = args
        self.timeout_s = timeout_s
        self.joined = threading.Event()
        self.state = "not started"
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sglang-node-{args.node_rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread, wherever it waits (a no-op when it never started)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        end = time.monotonic() + self.timeout_s
        ctx = zmq.Context()
        try:
            if self.args.attn_dp_size > 1:
                if self.args.node_rank == 0:
                    self._serve_handshake(ctx, end)
                else:
                    self._ask_handshake(ctx, end)
            if self.args.node_rank == 0:
                self._rendezvous_as_master(end)
            else:
                self._rendezvous_as_client(end)
        except (TimeoutError, OSError, zmq.ZMQError) as exc:
            self.error = f"{self.state}: {exc}"
        finally:
            ctx.destroy(linger=0)

    def _serve_handshake(self, ctx: zmq.Context, end: float) -> None:
        # data_parallel_controller.py:530-564: a REP socket on dist-init + 13, one answer per other node.
        rep = ctx.socket(zmq.REP)
        rep.bind(f"tcp://{self.args.dist_host}:{self.args.handshake_port}")
        answered = 0
        while answered < self.args.nnodes - 1:
            self.state = f"handshake: answered {answered} of {self.args.nnodes - 1} nodes"
            if not rep.poll(int(POLL_S * 1000)):
                self._check(end)
                continue
            rep.recv()
            rep.send(b"worker ports")
            answered += 1
        rep.close()

    def _ask_handshake(self, ctx: zmq.Context, end: float) -> None:
        # data_parallel_controller.py:584-611: a REQ socket; connect() returns at once and keeps retrying.
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://{self.args.dist_host}:{self.args.handshake_port}")
        req.send(str(self.args.node_rank).encode())
        self.state = "handshake: waiting for node 0's answer"
        while not req.poll(int(POLL_S * 1000)):
            self._check(end)
        req.recv()
        req.close()

    def _rendezvous_as_master(self, end: float) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((self.args.dist_host, self.args.dist_port))
            server.listen()
            members: dict[socket.socket, bytes] = {}
            pending: list[socket.socket] = []
            try:
                while len(members) < self.args.nnodes - 1:
                    self.state = f"rendezvous: {len(members)} of {self.args.nnodes - 1} nodes joined"
                    ready, _, _ = select.select([server, *pending], [], [], POLL_S)
                    self._check(end)
                    for sock in ready:
                        if sock is server:
                            pending.append(server.accept()[0])
                            continue
                        pending.remove(sock)
                        rank = sock.recv(64)
                        if rank:
                            members[sock] = rank
                        else:  # a probe that connected and left: no node
                            sock.close()
                for sock in members:
                    sock.sendall(JOINED)
                self.state = "joined"
                self.joined.set()
            finally:
                for sock in [*members, *pending]:
                    sock.close()

    def _rendezvous_as_client(self, end: float) -> None:
        address = (self.args.dist_host, self.args.dist_port)
        self.state = f"rendezvous: connecting to {address[0]}:{address[1]}"
        while True:
            try:
                sock = socket.create_connection(address, timeout=1.0)
                break
            except OSError:
                self._check(end)
                self._stop.wait(POLL_S)
        with sock:
            sock.sendall(str(self.args.node_rank).encode())
            self.state = "rendezvous: waiting for every node"
            while not select.select([sock], [], [], POLL_S)[0]:
                self._check(end)
            if sock.recv(len(JOINED)) == JOINED:
                self.state = "joined"
                self.joined.set()

    def _check(self, end: float) -> None:
        if self._stop.is_set():
            raise TimeoutError("stopped")
        if time.monotonic() > end:
            raise TimeoutError(f"gave up after {self.timeout_s:.0f} s")
