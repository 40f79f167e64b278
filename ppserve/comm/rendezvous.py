"""A stage link with NCCL's strictest point-to-point semantics, on CPU: `parallel.stage_link: rendezvous`.

The CPU links forgive what NCCL does not: NCCL may block a send until the peer has posted the matching
receive, sets a pair's connection up lazily at its first contact (blocking both sides until both
arrive), and matches messages to receives by order alone. Code that relies on anything kinder can hang
on GPUs and pass every CPU test, so this link enforces the strict contract (comm/channel.py):

- the first operation on a link, either side, blocks the host until the other side's first operation;
- a message is delivered only once the receiver has posted its receive (`post_recv` or `recv`). As
  NCCL's send blocks the GPU, not the host, `send` returns at once and the link's own thread (its
  "stream") waits for the posted receive; the host blocks at its next send on the link and at `close`;
- each message carries its sequence number, step and shape; a receive that does not match is an error
  on both sides, naming both stages and steps;
- a wait longer than the link's timeout is reported as the deadlock it almost surely is, naming who
  blocks, on what and on whom (NCCL itself would hang silently).

Each end is a TCP socket met through the distributed store like the socket link's
(`socket_channel.connect_links`); the receiver's posts travel back on the same socket.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ppserve.comm.channel import LinkValues, PostedRecv
from ppserve.comm.socket_channel import _bytes_of

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "PPSERVE_RENDEZVOUS_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0  # under parallel.stage_timeout_s's default, so the named error comes first

CLOSE_WAIT_S = 5.0
_HEADER = struct.Struct("<c6q")  # kind, sequence number, step, tokens, hidden size, dtype code, values
_HELLO, _POST, _DATA, _ERROR = b"H", b"P", b"D", b"E"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


class RendezvousDeadlock(RuntimeError):
    """A side of a rendezvous link waited past the link's timeout: on NCCL this would be a hang."""


@dataclass(frozen=True)
class _Message:
    seq: int
    step: int
    num_tokens: int
    hidden_size: int
    dtype: int
    num_times: int

    def describe(self) -> str:
        return (f"#{self.seq} of step {self.step} ([{self.num_tokens}, {self.hidden_size}] "
                f"{_DTYPES[self.dtype]}, {self.num_times} values)")


def timeout_s() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    return float(value) if value else DEFAULT_TIMEOUT_S


class RendezvousChannel:
    """One end of a link: `outbound` ends send, the others receive. `me` and `peer` name the two
    stages in messages ("stage 0", "stage 1 (token ring)")."""

    def __init__(self, sock: socket.socket, outbound: bool, me: str, peer: str,
                 timeout: float | None = None) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small messages both ways, every step
        self._sock = sock
        self.outbound = outbound
        self.me, self.peer = me, peer
        self.timeout = timeout_s() if timeout is None else timeout
        self._met = False
        self._seq = 0  # messages sent (outbound end) or receives posted (inbound end)
        self._posted: deque[_Message] = deque()  # inbound: posted, not yet waited on
        self._in_flight: threading.Thread | None = None  # outbound: the message waiting for its receive
        self._error: BaseException | None = None

    # ---- both ends --------------------------------------------------------------------------------
    def _meet(self, what: str) -> None:
        """The pair's first contact: both sides block here until both have arrived."""
        if self._met:
            return
        self._sock.sendall(_HEADER.pack(_HELLO, 0, 0, 0, 0, 0, 0))
        kind, _ = self._read_header(f"at its first contact with {self.peer} ({what}): {self.peer} never "
                                    "reached its side of the link")
        if kind != _HELLO:
            raise RuntimeError(f"rendezvous link {self.me} <- {self.peer}: expected the first contact, "
                               f"got {kind!r}")
        self._met = True

    def _read_exactly(self, n: int, blocked: str) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        deadline = time.monotonic() + self.timeout
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousDeadlock(f"rendezvous link: {self.me} blocked {self.timeout:.0f} s {blocked} "
                                         "(NCCL would hang here: a deadlock)")
            self._sock.settimeout(left)
            try:
                k = self._sock.recv_into(view[got:])
            except TimeoutError:
                continue
            finally:
                self._sock.settimeout(None)
            if k == 0:
                raise ConnectionError(f"rendezvous link: {self.peer} closed the link while {self.me} was "
                                      f"{blocked}")
            got += k
        return bytes(buf)

    def _read_header(self, blocked: str) -> tuple[bytes, _Message]:
        kind, *fields = _HEADER.unpack(self._read_exactly(_HEADER.size, blocked))
        if kind == _ERROR:
            text = self._read_exactly(fields[0], "reading its peer's error").decode()
            raise RuntimeError(text)
        return kind, _Message(*fields)

    # ---- the sending end ----------------------------------------------------------------------------
    def send(self, hidden: Tensor, times: tuple[float, ...], step: int = -1) -> None:
        msg = _Message(self._seq, step, hidden.shape[0], hidden.shape[1] if hidden.dim() > 1 else 1,
                       _DTYPES.index(hidden.dtype), len(times))
        self._wait_in_flight()
        self._meet(f"sending {msg.describe()}")
        self._seq += 1
        # The tensor is read when the message goes, as NCCL reads it: a stage that overwrote a buffer still
        # in flight would corrupt its message here as it would there.
        self._in_flight = threading.Thread(target=self._deliver, args=(msg, hidden.contiguous(), times),
                                           daemon=True, name=f"rendezvous {self.me} -> {self.peer}")
        self._in_flight.start()

    def _deliver(self, msg: _Message, hidden: Tensor, times: tuple[float, ...]) -> None:
        """The link's stream: wait for the receive of `msg` to be posted, check that it matches, send."""
        try:
            kind, posted = self._read_header(f"sending {msg.describe()} to {self.peer}, which never posted "
                                             "the matching receive")
            if kind != _POST:
                raise RuntimeError(f"rendezvous link {self.me} -> {self.peer}: expected a posted receive, "
                                   f"got {kind!r}")
            if posted != msg:
                error = (f"rendezvous link {self.me} -> {self.peer}: {self.peer} posted its receive "
                         f"{posted.describe()}, but {self.me} sends {msg.describe()}: a receive posted out "
                         "of order")
                data = error.encode()
                self._sock.sendall(_HEADER.pack(_ERROR, len(data), 0, 0, 0, 0, 0) + data)
                raise RuntimeError(error)
            header = _HEADER.pack(_DATA, msg.seq, msg.step, msg.num_tokens, msg.hidden_size, msg.dtype,
                                  msg.num_times)
            self._sock.sendall(header + bytes(_bytes_of(hidden))
                               + np.asarray(times, dtype=np.float64).tobytes())
        except BaseException as e:  # raised on the stage's thread at its next send or close; logged now
            logger.error("%s", e)
            self._error = e

    def _wait_in_flight(self) -> None:
        """Block until the message in flight was delivered (its receive posted); raise what it met."""
        if self._in_flight is not None:
            self._in_flight.join()
            self._in_flight = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ---- the receiving end --------------------------------------------------------------------------
    def post_recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
                  step: int = -1) -> PostedRecv:
        msg = _Message(self._seq, step, num_tokens, hidden_size, _DTYPES.index(dtype), num_times)
        self._meet(f"posting the receive {msg.describe()}")
        self._seq += 1
        self._posted.append(msg)
        self._sock.sendall(_HEADER.pack(_POST, msg.seq, msg.step, msg.num_tokens, msg.hidden_size, msg.dtype,
                                        msg.num_times))
        return _Posted(self, msg)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, num_times: int,
             step: int = -1) -> tuple[Tensor, LinkValues]:
        return self.post_recv(num_tokens, hidden_size, dtype, num_times, step).wait()

    def _wait(self, msg: _Message) -> tuple[Tensor, LinkValues]:
        if not self._posted or self._posted[0] != msg:
            raise RuntimeError(f"rendezvous link {self.me} <- {self.peer}: waited on receive "
                               f"{msg.describe()} before an earlier posted one: receives complete in "
                               "posting order")
        kind, got = self._read_header(f"waiting for {msg.describe()} from {self.peer}, which never sent it")
        if kind != _DATA or got != msg:
            raise RuntimeError(f"rendezvous link {self.me} <- {self.peer}: expected {msg.describe()}, "
                               f"got {got.describe()}")
        self._posted.popleft()
        dtype = _DTYPES[msg.dtype]
        n_hidden = msg.num_tokens * msg.hidden_size * dtype.itemsize
        data = self._read_exactly(n_hidden + 8 * msg.num_times, f"reading {msg.describe()}")
        hidden = (torch.frombuffer(bytearray(data[:n_hidden]), dtype=dtype,
                                   count=msg.num_tokens * msg.hidden_size)
                  if n_hidden else torch.empty(0, dtype=dtype))
        values = np.frombuffer(data, dtype=np.float64, count=msg.num_times, offset=n_hidden)
        return hidden.view(msg.num_tokens, msg.hidden_size), LinkValues(tuple(float(v) for v in values))

    def close(self) -> None:
        """Give the message in flight a moment to be taken, then close (shutdown: its peer may be gone)."""
        if self._in_flight is not None:
            self._in_flight.join(timeout=CLOSE_WAIT_S)
        self._sock.close()


class _Posted:
    def __init__(self, channel: RendezvousChannel, msg: _Message) -> None:
        self._channel, self._msg = channel, msg

    def wait(self) -> tuple[Tensor, LinkValues]:
        return self._channel._wait(self._msg)
