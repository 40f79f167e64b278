"""The CPU stage link over a plain socket (comm/socket_channel.py): messages arrive whole and in order,
a message the kernel buffer cannot take at once is finished by the writer thread without blocking the
sender, a closed peer is an error, and the links meet through a store with a token check."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from ppserve.comm.socket_channel import SocketChannel, connect_links


def pair() -> tuple[SocketChannel, SocketChannel]:
    """Two ends of a loopback TCP connection, as two stages on one machine have."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    return SocketChannel(a), SocketChannel(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_messages_round_trip_in_order(dtype):
    tx, rx = pair()
    try:
        sent = [(torch.randn(n, 8).to(dtype), (float(n), 0.25)) for n in (1, 3, 7)]
        for hidden, times in sent:
            tx.send(hidden, times)
        for hidden, times in sent:
            got, got_times = rx.recv(hidden.shape[0], 8, dtype, 2)
            assert torch.equal(got, hidden) and got_times.get() == times
    finally:
        tx.close()
        rx.close()


def test_a_message_larger_than_the_kernel_buffer_does_not_block_the_sender():
    """8 MiB of hidden states: far more than a socket buffer. send returns at once (the writer thread
    finishes it while the receiver is still busy), and the next send waits for that one only."""
    tx, rx = pair()
    try:
        big = torch.randn(2048, 1024)
        t0 = time.perf_counter()
        tx.send(big, (1.0,))
        assert time.perf_counter() - t0 < 0.5  # nobody reads yet
        got: list[torch.Tensor] = []
        reader = threading.Thread(target=lambda: got.append(rx.recv(2048, 1024, torch.float32, 1)[0]))
        time.sleep(0.05)
        reader.start()
        tx.send(torch.ones(1, 1024), (2.0,))  # waits for the big one's rest, then goes
        reader.join(timeout=10)
        assert torch.equal(got[0], big)
        small, times = rx.recv(1, 1024, torch.float32, 1)
        assert torch.equal(small, torch.ones(1, 1024)) and times.get() == (2.0,)
    finally:
        tx.close()
        rx.close()


def test_a_closed_peer_is_a_connection_error():
    tx, rx = pair()
    tx.close()
    with pytest.raises(ConnectionError, match="closed the link"):
        rx.recv(1, 4, torch.float32, 1)
    rx.close()


class DictStore:
    """The two calls of torch.distributed's store the links use; get waits for its key."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            self.cond.wait_for(lambda: key in self.data, timeout=10)
            return self.data[key].encode()


def test_three_stages_meet_through_the_store_in_any_order_and_a_stranger_is_refused():
    store = DictStore()
    links: dict[int, tuple] = {}

    def rank(r: int) -> None:
        links[r] = connect_links(store, r, r - 1 if r > 0 else None, r + 1 if r < 2 else None, "127.0.0.1")

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 0, 1)]
    threads[0].start()
    while "ppserve/stage_link/2" not in store.data:
        time.sleep(0.01)
    host, port = store.data["ppserve/stage_link/2"].split("@")[1].split(":")
    stranger = socket.create_connection((host, int(port)))  # knows the port, not the token
    stranger.sendall(b"x" * 16)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=20)
    try:
        assert links[0][0] is None and links[2][1] is None
        x = torch.arange(6.0).view(2, 3)
        links[0][1].send(x, (0.5,))
        y, times = links[1][0].recv(2, 3, torch.float32, 1)
        links[1][1].send(y * 2, times.get() + (0.25,))
        z, times2 = links[2][0].recv(2, 3, torch.float32, 2)
        assert torch.equal(z, x * 2) and times2.get() == (0.5, 0.25)
        assert stranger.recv(1) == b""  # the receiver closed it
    finally:
        stranger.close()
        for inbound, outbound in links.values():
            for ch in (inbound, outbound):
                if ch is not None:
                    ch.close()
