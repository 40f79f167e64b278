"""The control plane's connections send at once: TCP_NODELAY on both ends (comm/tcp.py `no_delay`).

With Nagle's algorithm on, a stage's result written while its previous one was still unacknowledged waited
for the engine's delayed ACK (up to 40 ms): a hole of 27-44 ms on both stages of the demo, once or twice a
run. What is checked here is the socket option itself, not a timing."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener

from ppserve.comm.tcp import no_delay


def _nodelay(conn: Connection) -> int:
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()


def _pair(address, family: str | None = None) -> tuple[Connection, Connection]:
    with Listener(address, family=family) as listener:
        accepted: list[Connection] = []
        th = threading.Thread(target=lambda: accepted.append(listener.accept()))
        th.start()
        client = Client(listener.address, family=family)
        th.join(10)
    return accepted[0], client


def test_both_ends_of_a_tcp_connection_send_at_once():
    server, client = _pair(("127.0.0.1", 0))
    try:
        assert _nodelay(server) == 0 and _nodelay(client) == 0  # what multiprocessing gives: Nagle on
        no_delay(server)
        no_delay(client)
        assert _nodelay(server) != 0 and _nodelay(client) != 0
        client.send_bytes(b"still usable")  # only a duplicate handle was closed
        assert server.recv_bytes() == b"still usable"
    finally:
        server.close()
        client.close()


def test_a_unix_socket_is_left_as_it_is():
    with tempfile.TemporaryDirectory() as tmp:
        server, client = _pair(os.path.join(tmp, "s"), "AF_UNIX")
        try:
            no_delay(server)  # no TCP option to set: nothing happens, nothing breaks
            client.send_bytes(b"x")
            assert server.recv_bytes() == b"x"
        finally:
            server.close()
            client.close()
