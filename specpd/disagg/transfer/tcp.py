"""Plain pyzmq page transfer, for machines where Mooncake cannot load. Same interface as the Mooncake backend.

Receiver: a thread owns a ROUTER socket bound to `tcp://host:<random port>` (the session id). A write message
is `[header, page, page, ...]` with header `{"op": "write", "seq", "pages": [[pool, dst_page], ...]}`, one
frame per page (one descriptor per page, as with Mooncake); the thread checks every pool/page/size against
its registered pools, copies the frames into them and replies `{"seq", "ok"}` or `{"seq", "ok": false,
"error"}`. `{"op": "ping"}` answers `{"op": "pong"}`.

Sender: one DEALER per peer (used under the peer's lock). Connecting watches the socket monitor, so a
refused connection (dead peer) fails at once instead of retrying forever; a ping checks the peer answers.
A write call pipelines its messages, then waits for every ack until the deadline; a disconnect seen by the
monitor fails the call early. After any failure the DEALER is closed with linger 0 (queued pages dropped).
"""
from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Sequence

import numpy as np
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from specpd.disagg.messages import PoolLayout
from specpd.disagg.transfer.base import PageCopy, PeerUnreachable, TransferBackend, TransferError

_POLL_MS = 50


class _PeerLink:
    """A connected DEALER to one peer, with its monitor socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str, deadline: float):
        self.endpoint = endpoint
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for a peer that is not connected
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(endpoint)
        try:
            self._wait_handshake(deadline)
        except Exception:
            self.close()
            raise

    def _wait_handshake(self, deadline: float) -> None:
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise PeerUnreachable(f"tcp: no connection to {self.endpoint} before the deadline")
            if not self.monitor.poll(min(left_ms, 4 * _POLL_MS)):
                continue
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event in (zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_DISCONNECTED):
                raise PeerUnreachable(f"tcp: peer {self.endpoint} refused the connection (dead peer)")

    def check_alive(self) -> None:
        """Raise if the monitor saw the connection drop."""
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CONNECT_RETRIED):
                raise PeerUnreachable(f"tcp: peer {self.endpoint} closed the connection mid-transfer")

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


class TcpBackend(TransferBackend):
    name = "tcp"

    def __init__(self, host: str = "127.0.0.1", *, pages_per_message: int = 16, connect_timeout_s: float = 2.0,
                 **options):
        super().__init__(host, **options)
        self.pages_per_message = pages_per_message
        self.connect_timeout_s = connect_timeout_s
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        port = self._router.bind_to_random_port(f"tcp://{host}")
        self._session = f"tcp://{self.advertise_host}:{port}"
        self._links: dict[str, _PeerLink] = {}
        self._seq = itertools.count(1)
        self._stop = threading.Event()
        self._receiver = threading.Thread(target=self._serve, name="specpd-tcp-recv", daemon=True)
        self._receiver.start()

    @property
    def session_id(self) -> str:
        return self._session

    def _register_pool(self, pool_bytes: torch.Tensor) -> int:
        if pool_bytes.device.type != "cpu":
            raise ValueError(f"tcp backend moves CPU pools only, got a {pool_bytes.device} pool")
        return 0

    # -- receiver (its own thread; the ROUTER socket is used nowhere else)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(_POLL_MS):
                continue
            identity, header_frame, *pages = self._router.recv_multipart(copy=False)
            try:
                header = json.loads(bytes(header_frame.buffer))
                reply = self._handle(header, pages)
            except Exception as e:  # noqa: BLE001 - a bad message gets an error reply, never kills the thread
                reply = {"seq": None, "ok": False, "error": f"{type(e).__name__}: {e}"}
            self._router.send_multipart([identity, json.dumps(reply).encode()])
        self._router.close(linger=0)

    def _handle(self, header: dict, pages: list) -> dict:
        seq = header.get("seq")
        if header.get("op") == "ping":
            return {"seq": seq, "op": "pong"}
        if header.get("op") != "write":
            return {"seq": seq, "ok": False, "error": f"unknown op {header.get('op')!r}"}
        targets = header.get("pages", [])
        if len(targets) != len(pages):
            return {"seq": seq, "ok": False, "error": f"{len(targets)} page targets for {len(pages)} frames"}
        views = []
        for (pool, page, offset), frame in zip(targets, pages):  # check all before writing any
            if not (0 <= pool < len(self._pools) and 0 <= page < self._pools[pool].shape[0]):
                return {"seq": seq, "ok": False, "error": f"pool {pool} page {page} out of range"}
            if not 0 <= offset <= offset + len(frame.buffer) <= self._pools[pool].shape[1]:
                return {"seq": seq, "ok": False, "error": f"{len(frame.buffer)} B at offset {offset}: pool {pool} "
                                                          f"pages are {self._pools[pool].shape[1]} B"}
            views.append((self._pools[pool][page].numpy()[offset:offset + len(frame.buffer)], frame))
        for dst, frame in views:
            dst[:] = np.frombuffer(frame.buffer, dtype=np.uint8)
        return {"seq": seq, "ok": True}

    # -- sender (executor threads, under the peer's lock)

    def _link(self, peer: str, deadline: float) -> _PeerLink:
        link = self._links.get(peer)
        if link is None:
            link = _PeerLink(self._ctx, peer, min(deadline, time.monotonic() + self.connect_timeout_s))
            self._links[peer] = link
            self._exchange(link, [[{"op": "ping"}]], deadline)
        return link

    def _write(self, peer_session: str, copies: Sequence[PageCopy], peer_layouts: Sequence[PoolLayout],
               deadline: float) -> None:
        messages = []
        for i in range(0, len(copies), self.pages_per_message):
            group = copies[i:i + self.pages_per_message]
            messages.append([{"op": "write", "pages": [[c.run.dst_pool, c.dst_page, c.run.dst_offset] for c in group]},
                             *(memoryview(self._pools[c.pool][c.src_page].numpy()[c.run.src_offset:][:c.run.num_bytes])
                               for c in group)])
        try:
            self._exchange(self._link(peer_session, deadline), messages, deadline)
        except Exception:
            link = self._links.pop(peer_session, None)
            if link is not None:
                link.close()
            raise

    def _exchange(self, link: _PeerLink, messages: list[list], deadline: float) -> None:
        """Send every message (header dict + payload frames), then wait for all their replies."""
        pending = set()
        for header, *payload in messages:
            header = {**header, "seq": next(self._seq)}
            pending.add(header["seq"])
            frames = [json.dumps(header).encode(), *payload]
            while True:
                link.check_alive()
                try:
                    link.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        raise TransferError(f"tcp: peer {link.endpoint} stopped accepting data (timeout)") from None
                    link.sock.poll(_POLL_MS, zmq.POLLOUT)
        while pending:
            link.check_alive()
            if time.monotonic() > deadline:
                raise TransferError(f"tcp: peer {link.endpoint} did not ack {len(pending)} messages before the "
                                    f"deadline (frozen peer?)")
            if not link.sock.poll(_POLL_MS):
                continue
            reply = json.loads(link.sock.recv())
            if reply.get("ok") is False:
                raise TransferError(f"tcp: peer {link.endpoint} rejected the write: {reply.get('error')}")
            pending.discard(reply.get("seq"))

    def _close(self) -> None:
        self._stop.set()
        self._receiver.join()
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._ctx.destroy(linger=0)
