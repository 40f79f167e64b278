"""TCP options for the connections between the engine and the stages (the control plane)."""

from __future__ import annotations

import os
import socket
from multiprocessing.connection import Connection


def no_delay(conn: Connection) -> None:
    """Send every message of this TCP connection at once (TCP_NODELAY): a control-plane message is small
    and someone waits for it. With Nagle's algorithm on, a stage's result written while its previous one
    is still unacknowledged waits for the engine's delayed ACK, which comes with the next submit or after
    up to 40 ms (docs/decisions.md#control-plane-dispatch). A connection of another family is left as is."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # a second handle on the same socket
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()  # closes the duplicate only
