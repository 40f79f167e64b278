"""The rendezvous link (comm/rendezvous.py) enforces NCCL's strictest point-to-point contract, and the
stages' link warm-up is free of the send-before-receive cycle that contract turns into a hang."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ppserve.comm.rendezvous import RendezvousChannel, RendezvousDeadlock

TIMEOUT_S = 1.5


def _link(a: str, b: str) -> tuple[RendezvousChannel, RendezvousChannel]:
    """(the sending end at `a`, the receiving end at `b`)."""
    s1, s2 = socket.socketpair()
    return (RendezvousChannel(s1, True, a, b, timeout=TIMEOUT_S),
            RendezvousChannel(s2, False, b, a, timeout=TIMEOUT_S))


def _run_all(bodies: list[Callable[[], Any]]) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            bodies[i]()
        except BaseException as e:
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def _pipeline(p: int) -> tuple[list[tuple[RendezvousChannel, RendezvousChannel]],
                               tuple[RendezvousChannel, ...]]:
    links = [_link(f"stage {s}", f"stage {s + 1}") for s in range(p - 1)]
    ring = _link(f"stage {p - 1}", "stage 0")
    return links, ring


def _warm_up_bodies(p: int, send_first: bool) -> list[Callable[[], None]]:
    """Each stage's warm-up of its links: `send_first` is the order the stages used before (every stage's
    outbound and ring sends, then its receives); otherwise a stage receives before it sends."""
    links, (ring_out, ring_in) = _pipeline(p)
    one = torch.zeros(1, 4)
    token = torch.zeros(1, 1, dtype=torch.int64)

    def body(s: int) -> Callable[[], None]:
        def sends() -> None:
            if s < p - 1:
                links[s][0].send(one, (-1.0,), step=-1)
            if s == p - 1:
                ring_out.send(token, (-1.0,), step=-1)

        def receives() -> None:
            if s > 0:
                links[s - 1][1].recv(1, 4, torch.float32, 1, step=-1)
            if s == 0:
                ring_in.recv(1, 1, torch.int64, 1, step=-1)

        def run() -> None:
            if send_first or s == 0:
                sends()
                receives()
            else:
                receives()
                sends()
        return run

    return [body(s) for s in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_sending_before_receiving_on_every_stage_deadlocks_the_ring(p: int) -> None:
    errors = _run_all(_warm_up_bodies(p, send_first=True))
    deadlocks = [e for e in errors if isinstance(e, RendezvousDeadlock)]
    assert deadlocks, errors
    # Stage 0 waits on stage 1 while the last stage waits on stage 0: the cycle, at first contact.
    assert any(str(e).startswith("rendezvous link: stage 0 blocked") and "stage 1" in str(e)
               for e in deadlocks)
    assert any(str(e).startswith(f"rendezvous link: stage {p - 1} blocked") and "stage 0" in str(e)
               for e in deadlocks)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_receiving_first_after_stage_0_warms_every_link(p: int) -> None:
    assert _run_all(_warm_up_bodies(p, send_first=False)) == [None] * p


def test_a_message_waits_for_its_posted_receive_and_the_next_send_waits_for_it() -> None:
    """NCCL's send blocks the GPU, not the host: the first send returns, the second (one message in
    flight) waits until the receiver has posted the first's receive."""
    out, inp = _link("stage 0", "stage 1")
    events: list[str] = []

    def sender() -> None:
        out.send(torch.ones(2, 3), (7.0,), step=0)
        events.append("first sent")
        out.send(torch.ones(1, 3), (8.0,), step=1)
        events.append("second sent")

    def receiver() -> None:
        inp._meet("warm-up")
        threading.Event().wait(0.3)
        events.append("posting")
        hidden, values = inp.post_recv(2, 3, torch.float32, 1, step=0).wait()
        assert torch.equal(hidden, torch.ones(2, 3)) and values.get() == (7.0,)
        assert inp.recv(1, 3, torch.float32, 1, step=1)[1].get() == (8.0,)

    assert _run_all([sender, receiver]) == [None, None]
    assert events == ["first sent", "posting", "second sent"]


def test_a_receive_posted_for_another_step_is_an_error_on_both_sides() -> None:
    out, inp = _link("stage 1", "stage 2")

    def sender() -> None:
        out.send(torch.zeros(3, 4), (0.0, 0.0), step=6)
        out.send(torch.zeros(3, 4), (0.0, 0.0), step=7)  # where the first one's failure comes back

    def receiver() -> None:
        inp.recv(3, 4, torch.float32, 2, step=5)

    errors = _run_all([sender, receiver])
    for e in errors:
        assert isinstance(e, RuntimeError) and not isinstance(e, RendezvousDeadlock)
        assert "stage 2 posted its receive #0 of step 5" in str(e) and "stage 1 sends #0 of step 6" in str(e)


def test_a_receive_with_no_sender_is_reported_with_the_stage_that_waits() -> None:
    out, inp = _link("stage 0", "stage 1")
    errors = _run_all([lambda: out._meet("warm-up"), lambda: inp.recv(1, 4, torch.float32, 1, step=3)])
    assert errors[0] is None
    assert isinstance(errors[1], RendezvousDeadlock)
    assert ("stage 1 blocked" in str(errors[1]) and "step 3" in str(errors[1])
            and "from stage 0" in str(errors[1]))


def test_receives_posted_ahead_complete_in_order() -> None:
    out, inp = _link("stage 3", "stage 0")
    posted = []

    def sender() -> None:
        for k in range(4):
            out.send(torch.full((k + 1, 1), k, dtype=torch.int64), (float(k),), step=k)

    def receiver() -> None:
        # all four, then the waits
        posted.extend(inp.post_recv(k + 1, 1, torch.int64, 1, step=k) for k in range(4))
        for k, p in enumerate(posted):
            hidden, values = p.wait()
            assert hidden.view(-1).tolist() == [k] * (k + 1) and values.get() == (float(k),)

    assert _run_all([sender, receiver]) == [None, None]
