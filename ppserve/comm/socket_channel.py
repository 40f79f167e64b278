"""Hidden states over a plain TCP socket: the link between CPU stages (`parallel.stage_link: auto`).

Gloo's point-to-point is a rendezvous: the receiver's `irecv` tells the sender it is ready, and the
sending process's own background thread then writes the data. On busy cores that thread waits for a core
and the next stage waits for the data (docs/decisions.md#socket-stage-link).

A socket has no rendezvous: `send` writes the message into the kernel's buffer from the calling thread
(`MSG_DONTWAIT`, so it never blocks the stage) and the receiver reads it whenever it asks. Only what the
buffer does not take at once (a long prefill chunk's hidden states) is finished by a writer thread, at
most one message outstanding, as the torch channel allows. The receiver knows every message's size (the
SchedulerOutput says its tokens), so a message is the hidden states' bytes then the float64 times, no
header. GPUs keep torch.distributed (NCCL reads device memory directly).

The two ends meet through the torch.distributed store the ranks already share (`connect_links`): a
receiving rank listens and publishes its address with a random token, its sender connects and sends the
token first, and the receiver accepts only a connection that does (anything else on the port is closed).
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ppserve.comm.channel import Deferred, LinkValues, PostedRecv

STORE_KEY = "ppserve/stage_link/{rank}"  # "token@host:port" that a rank's inbound link listens on
# the same for stage 0's inbound token ring (scheduler.token_ring)
RING_STORE_KEY = "ppserve/token_ring/{rank}"
TOKEN_BYTES = 16
TOKEN_TIMEOUT_S = 30.0  # a connection that does not send its token by then is not the sender


class SocketChannel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small message per step: no batching
        self._sock = sock
        self._writer: threading.Thread | None = None  # finishing the previous message, when it did not fit
        self._error: BaseException | None = None

    def send(self, hidden: Tensor, times: tuple[float, ...], step: int = -1) -> None:
        self._wait_pending()  # at most one message outstanding, as over torch.distributed
        parts = [_bytes_of(hidden), np.asarray(times, dtype=np.float64).tobytes()]
        total = sum(len(p) for p in parts)
        try:
            sent = self._sock.sendmsg(parts, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent == total:
            return
        rest = b"".join(parts)[sent:]  # rare (a long chunk, a full buffer): a copy is fine here
        self._writer = threading.Thread(target=self._write, args=(rest,), name="stage-link-writer",
                                        daemon=True)
        self._writer.start()

    def _write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except BaseException as e:  # reported by the next send or close, on the stage's own thread
            self._error = e

    def _wait_pending(self) -> None:
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise ConnectionError(f"stage link: sending to the next stage failed: {error}") from error

    def post_recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
                  step: int = -1) -> PostedRecv:
        # data waits in the buffer
        return Deferred(lambda: self.recv(num_tokens, hidden_size, dtype, num_times, step))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
             step: int = -1) -> tuple[Tensor, LinkValues]:
        n_hidden = num_tokens * hidden_size * dtype.itemsize
        buf = bytearray(n_hidden + 8 * num_times)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError(f"stage link: the previous stage closed the link after {got} of "
                                      f"{len(buf)} bytes of a microbatch")
            got += n
        hidden = (torch.frombuffer(buf, dtype=dtype, count=num_tokens * hidden_size)
                  .view(num_tokens, hidden_size))
        times = np.frombuffer(buf, dtype=np.float64, count=num_times, offset=n_hidden)
        return hidden, LinkValues(tuple(float(t) for t in times))

    def close(self) -> None:
        try:
            self._wait_pending()
        finally:
            self._sock.close()


def _bytes_of(t: Tensor) -> Any:
    """A contiguous CPU tensor's bytes, without a copy (bf16 has no numpy dtype: viewed as bytes first)."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def connect_links(store: Any, rank: int, prev_rank: int | None, next_rank: int | None,
                  host: str, store_key: str = STORE_KEY,
                  channel: Callable[[socket.socket, bool], Any] | None = None) -> tuple[Any, Any]:
    """This rank's (inbound, outbound) socket links, met through the shared torch.distributed `store`
    under `store_key` (the token ring's links, last stage to stage 0, use their own). Every rank listens
    before it waits on anyone, so the ranks of a pipeline can call this in any order. `channel(sock,
    outbound)` makes each end (default: a SocketChannel; the rendezvous link passes its own)."""
    make = channel or (lambda sock, outbound: SocketChannel(sock))
    listener = None
    token = secrets.token_hex(TOKEN_BYTES)
    if prev_rank is not None:
        listener = socket.create_server((host, 0))
        store.set(store_key.format(rank=rank), f"{token}@{host}:{listener.getsockname()[1]}")
    outbound = None
    if next_rank is not None:
        published = store.get(store_key.format(rank=next_rank)).decode()  # waits until the next rank listens
        peer_token, address = published.split("@", 1)
        peer_host, port = address.rsplit(":", 1)
        sock = socket.create_connection((peer_host, int(port)))
        sock.sendall(bytes.fromhex(peer_token))
        outbound = make(sock, True)
    inbound = None
    if listener is not None:
        with listener:
            while inbound is None:
                conn, _ = listener.accept()
                if _read_exactly(conn, TOKEN_BYTES) == bytes.fromhex(token):
                    inbound = make(conn, False)
                else:
                    conn.close()  # not our sender
    return inbound, outbound


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    conn.settimeout(TOKEN_TIMEOUT_S)
    data = b""
    try:
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        return b""
    conn.settimeout(None)
    return data
