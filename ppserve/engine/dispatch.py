"""The Ray control plane: how a microbatch's SchedulerOutput reaches the stage actors and its result
comes back. Hidden states never take this path (they go stage to stage over torch.distributed), and
only the last stage answers: it carries every stage's compute seconds, chained along the stages.

- `ConnectionDispatch`: one authenticated connection per actor (`multiprocessing.connection`, HMAC
  challenge on connect, then length-prefixed messages over TCP). The engine pickles a SchedulerOutput
  once and writes the bytes to every actor; a thread in each actor blocks on its connection (no polling),
  runs the microbatch, and the last stage's TP rank 0 writes the result back. A dead actor closes its
  socket, so the engine sees the failure at once. Both ends turn Nagle's algorithm off (`comm/tcp.py`):
  a result written while the previous one was unacknowledged would wait for the engine's delayed ACK.
- `CompiledGraphDispatch`: one Ray Compiled Graph over the actors (`ray.dag`, compiled once). Its
  shared-memory channels' readers *poll*: every idle actor keeps a core busy, free where actors own CPUs
  beside their GPUs, ruinous where the actors share the cores that compute.
- `ClassicDispatch`: a Ray actor call per actor per microbatch.

`parallel.dispatch: auto` chooses connections on CPU workers and the compiled graph on GPU workers
(docs/decisions.md#control-plane-dispatch). All three are a `ControlPlane`, which is all the Ray executor
knows of them.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from typing import Any, Protocol, cast

from ppserve.comm.tcp import no_delay
from ppserve.sched.output import SchedulerOutput, StepResult

logger = logging.getLogger(__name__)

RAY_GET_TIMEOUT_S = 600.0  # no ray.get waits forever: a dead stage must surface as an error
FAILURE_POLL_S = 0.5  # while waiting for a microbatch, look this often for a stage that already failed
CONNECT_TIMEOUT_S = 120.0  # every actor must have connected back within this

# A Ray actor handle of worker/stage_actor.StageActor. Ray types an actor's methods only where they are
# declared with @ray.method; the stage actor's are plain methods, so `handle.execute.remote(...)` is
# untyped whatever the handle is annotated as.
StageActorHandle = Any


class StageFailure(RuntimeError):
    """A stage actor died, failed or stopped answering: the pipeline must be rebuilt."""


class ControlPlane(Protocol):
    """How microbatches reach the stage actors and their results come back (one of the three below)."""

    def submit(self, out: SchedulerOutput) -> None:
        """Hand a microbatch to every stage actor; returns without waiting for it."""

    def collect(self, timeout_s: float) -> StepResult:
        """The oldest submitted microbatch's result; StageFailure when a stage died, failed or hung."""

    def clear(self) -> None:
        """Forget the microbatches in flight (their results will never be collected)."""

    def teardown(self) -> None:
        """Stop: in-flight results are lost, the actors stop listening on this control plane."""


def _check(result: Any, step_id: int) -> StepResult:
    if not isinstance(result, StepResult) or result.step_id != step_id:
        raise RuntimeError(f"stage pipeline returned {result!r} for step {step_id}")
    return result


class ConnectionDispatch:
    """`connect(address, authkey)` has every actor i call its `serve_connection(address, authkey, i)` and
    returns once they all have (Ray calls, or the multi-process executor's pipes)."""

    def __init__(self, num_actors: int, num_stages: int, tp: int, host: str,
                 connect: Callable[[Any, bytes], None]) -> None:
        self.last = (num_stages - 1) * tp  # the actor whose connection carries the results
        authkey = os.urandom(32)
        conns: dict[int, Connection] = {}
        # The listener lives only while the actors connect: no port stays open afterwards.
        with Listener((host, 0), authkey=authkey) as listener:
            def accept_all() -> None:
                for _ in range(num_actors):
                    conn = listener.accept()
                    no_delay(conn)
                    conns[pickle.loads(conn.recv_bytes())] = conn

            acceptor = threading.Thread(target=accept_all, name="ppserve-accept", daemon=True)
            acceptor.start()
            connect(listener.address, authkey)
            acceptor.join(CONNECT_TIMEOUT_S)
        if len(conns) != num_actors:
            raise StageFailure(f"{num_actors - len(conns)} stage actor(s) did not connect back")
        self.conns = [conns[i] for i in range(num_actors)]
        self.in_flight: deque[int] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise StageFailure(f"step {out.step_id}: a stage actor's connection is gone: {e}") from e
        self.in_flight.append(out.step_id)

    def collect(self, timeout_s: float) -> StepResult:
        step_id = self.in_flight.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            # wait() hands back some of the objects it was given: here, Connections.
            ready = cast("list[Connection]", wait(self.conns, timeout=max(0.0, left)))
            if not ready:
                raise StageFailure(f"step {step_id}: no answer from the stages in {timeout_s:g} s "
                                   "(parallel.stage_timeout_s): hung")
            for conn in ready:  # only the last stage answers; any other message is a failure
                try:
                    kind, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as e:
                    raise StageFailure(f"step {step_id}: stage actor {self.conns.index(conn)} died "
                                       f"(its connection closed): {type(e).__name__}") from e
                if kind == "error":
                    raise StageFailure(f"step {step_id}: {payload}")
                if conn is self.conns[self.last]:
                    return _check(payload, step_id)

    def clear(self) -> None:
        self.in_flight.clear()

    def teardown(self) -> None:
        self.in_flight.clear()
        for conn in self.conns:
            conn.close()  # the actors' threads see EOF and stop


class CompiledGraphDispatch:
    def __init__(self, actors: list[StageActorHandle], num_stages: int, tp: int,
                 max_in_flight: int | None = None) -> None:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as inp:
            upstream: list[Any] = [None] * tp
            for s in range(num_stages):
                upstream = [actors[s * tp + r].execute_chained.bind(inp, upstream[r]) for r in range(tp)]
            dag = MultiOutputNode(upstream)
        t0 = time.perf_counter()
        # At most num_stages microbatches are in flight (the scheduler's invariant; one more with the token
        # ring, scheduler.token_ring); one more than that would block execute().
        self.graph = dag.experimental_compile(_max_inflight_executions=max_in_flight or num_stages)
        logger.info("compiled the stage graph (%d actors) in %.2f s", len(actors), time.perf_counter() - t0)
        self.in_flight: deque[tuple[int, list[Any]]] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        self.in_flight.append((out.step_id, self.graph.execute(out)))

    def collect(self, timeout_s: float) -> StepResult:
        import ray

        step_id, refs = self.in_flight.popleft()
        deadline = time.monotonic() + timeout_s
        try:
            results = [ref.get(timeout=max(0.0, deadline - time.monotonic())) for ref in refs]
        except ray.exceptions.RayChannelTimeoutError as e:
            raise StageFailure(f"step {step_id}: no answer from the stage graph in {timeout_s:g} s "
                               "(parallel.stage_timeout_s): hung") from e
        except ray.exceptions.RayError as e:  # an actor died or raised; the graph is broken
            raise StageFailure(f"step {step_id}: {type(e).__name__}: {e}") from e
        return _check(results[0], step_id)

    def clear(self) -> None:
        self.in_flight.clear()

    def teardown(self) -> None:
        self.in_flight.clear()
        try:
            self.graph.teardown()
        except Exception as e:  # a graph whose actor died may not tear down cleanly; the actors go anyway
            logger.warning("stage graph teardown: %s", e)


class ClassicDispatch:
    def __init__(self, actors: list[StageActorHandle], num_stages: int, tp: int) -> None:
        self.actors = actors
        self.last = (num_stages - 1) * tp
        self.in_flight: deque[tuple[int, list[Any]]] = deque()

    def submit(self, out: SchedulerOutput) -> None:
        self.in_flight.append((out.step_id, [a.execute.remote(out) for a in self.actors]))

    def collect(self, timeout_s: float) -> StepResult:
        import ray

        step_id, refs = self.in_flight.popleft()
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        try:
            # Wait for every stage, but look at those already done as we go: when one stage died, the
            # others may block in a p2p call forever, so its error must not wait behind them.
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageFailure(f"step {step_id}: no answer from {len(pending)} stage actor(s) in "
                                       f"{timeout_s:g} s (parallel.stage_timeout_s): hung")
                ready, pending = ray.wait(pending, num_returns=len(pending),
                                          timeout=min(FAILURE_POLL_S, left))
                if ready:
                    ray.get(ready, timeout=RAY_GET_TIMEOUT_S)  # raises at once for a dead or failed stage
            result = ray.get(refs[self.last], timeout=RAY_GET_TIMEOUT_S)
        except ray.exceptions.RayError as e:  # RayActorError / ActorDiedError, RayTaskError, GetTimeoutError
            raise StageFailure(f"step {step_id}: {type(e).__name__}: {e}") from e
        return _check(result, step_id)

    def clear(self) -> None:
        self.in_flight.clear()

    def teardown(self) -> None:
        self.in_flight.clear()


def resolve_dispatch(kind: str, gpus_per_worker: float) -> str:
    """`auto`: the compiled graph where the workers own GPUs (their CPUs idle while the GPU computes, so
    polling readers cost nothing), connections on CPU (polling readers would take the stages' cores)."""
    if kind == "auto":
        return "compiled" if gpus_per_worker > 0 else "connections"
    return kind
