"""The stage actor body: one (stage, TP rank) of the pipeline, its StageWorker and its links.

A plain class. The Ray executor runs one per process (`ray.remote(StageActor)`), the multi-process
executor one per spawned process (with a `LocalPlacement`): it binds the TCPStore socket, joins
torch.distributed, builds its worker and its `TorchP2PChannel`s. The in-process
executor builds one per stage in its own process with `StageActor.local` over `InProcChannel`s. Either
way one microbatch is: apply its diff and build its input tensors (`prepare`, before waiting, so it
overlaps the previous stage's compute), receive the hidden states and the stage times so far from the
previous stage (`recv_wait`; TP rank 0 holds the one link of a stage pair and broadcasts the hidden
states to its TP group), compute (`compute`), add this stage's time to the oldest row of step times it
can complete (worker/stage_times.py: timers read CUDA events a step late) and hand both on (`send`, TP
rank 0 again); the last stage's TP rank 0 samples and returns the StepResult with that row. No other
stage reports anything to the engine.

Entry points, one per control plane (engine/dispatch.py): `execute(out)` (a Ray call or the
in-process executor), `execute_chained(out, upstream)` (a node of a Ray compiled graph, stage s+1
taking stage s's token so the graph has no leaves), and `serve_connection(...)` (a thread reading
SchedulerOutputs from the engine's authenticated connection and writing back the result).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import pickle
import socket
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from ppserve.comm.channel import LinkValues, PostedRecv, StageChannel
from ppserve.sched.output import SchedulerOutput, StepResult
from ppserve.structured.grammars import has_tokenizer
from ppserve.worker.info import NodeInfo
from ppserve.worker.openmp_pool import release_thread_pool
from ppserve.worker.stage_times import TimeRow, unwire, wire, wire_length

if TYPE_CHECKING:  # torch and the worker are imported where the actor builds them (init_distributed)
    from torch import Tensor

    from ppserve.worker.stage_worker import StageSpec, StageWorker


@dataclass(frozen=True)
class LocalPlacement:
    """Where a stage runs when no Ray placed it (engine/mp_executor.py): this machine, CUDA device `gpu`
    (None: the CPU)."""

    gpu: int | None


WARM_UP_STEP = -1  # the step label of the links' warm-up messages
STRICT_HOST_SYNC_ENV = "PPSERVE_STRICT_HOST_SYNC"  # worker/host_sync.py's switch (read here without torch)


class StageActor:
    def __init__(self, spec: StageSpec, rank: int = 0, world_size: int = 1, prev_rank: int | None = None,
                 next_rank: int | None = None, placement: LocalPlacement | None = None) -> None:
        self.spec = spec
        # None: a Ray actor (its GPU and node from Ray's runtime context); else a process the multi-process
        # executor started on this machine, which imports no Ray.
        self.placement = placement
        self.rank = rank
        self.world_size = world_size
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self._worker: StageWorker | None = None
        self.inbound: StageChannel | None = None
        self.outbound: StageChannel | None = None
        # The token ring (spec.token_ring): the last stage's TP rank 0 sends each sampling step's tokens to
        # stage 0's TP rank 0, which hands them to its TP group.
        self.ring_in: StageChannel | None = None
        self.ring_out: StageChannel | None = None
        # Stage 0: the steps whose ring messages are still to wait for, each with its posted receive.
        self._ring_due: deque[tuple[int, tuple[str, ...], PostedRecv | None]] = deque()
        self._ring_tokens: dict[str, Tensor] = {}  # stage 0: each request's latest ring token (on the device)
        self._upstream: deque[LinkValues] = deque()  # rows of step times received, not yet on the host
        self._store_sock: socket.socket | None = None  # rank 0: the TCPStore's listening socket
        self._conn: Connection | None = None  # the engine's connection (connection control plane)
        self._strict = os.environ.get(STRICT_HOST_SYNC_ENV, "") not in ("", "0")  # worker/host_sync.py
        self._own_process = True  # a Ray actor or a stage process; `local` says otherwise

    @classmethod
    def local(cls, worker: StageWorker, inbound: StageChannel | None, outbound: StageChannel | None,
              ring_in: StageChannel | None = None, ring_out: StageChannel | None = None) -> StageActor:
        """An actor body around a worker built in this process, linked by in-memory channels."""
        actor = cls(worker.spec)
        actor._worker, actor.inbound, actor.outbound = worker, inbound, outbound
        actor._own_process = False
        actor.ring_in, actor.ring_out = ring_in, ring_out
        return actor

    @property
    def worker(self) -> StageWorker:
        """This actor's StageWorker: built by init_distributed, or handed to `local`."""
        if self._worker is None:
            raise RuntimeError(f"stage {self.spec.stage} tp {self.spec.tp_rank}: the actor has no worker yet "
                               "(init_distributed builds it)")
        return self._worker

    # ---- start-up (Ray) ----------------------------------------------------------------------------
    def node_info(self) -> NodeInfo:
        if self.placement is not None:
            return NodeInfo(node_ip="127.0.0.1", node_id="", pid=os.getpid())
        import ray

        return NodeInfo(node_ip=ray.util.get_node_ip_address(),
                        node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid())

    def listen_for_store(self, host: str) -> int:
        """Rank 0: bind the TCPStore's socket now, on `host` only, and return its port.

        TCPStore itself listens on all interfaces; handed this socket (master_listen_fd) it listens
        where we bound. Holding it open until init_distributed also leaves no window for another
        process to take the port.
        """
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        self._store_sock = socket.create_server((host, 0), family=family)
        port: int = self._store_sock.getsockname()[1]
        return port

    def clock_ns(self) -> int:
        return time.perf_counter_ns()

    def init_distributed(self, master: str, port: int, tp_groups: list[list[int]]) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.constants import default_pg_timeout

        from ppserve.comm.p2p import TorchP2PChannel
        from ppserve.model.parallel import TPContext
        from ppserve.worker.stage_worker import StageWorker

        if self.spec.num_threads:
            torch.set_num_threads(self.spec.num_threads)
        from ppserve.worker.devices import bind_thread_device

        gpu = self._gpu_index()
        backend = "gloo" if gpu is None else "nccl"
        if gpu is not None:
            bind_thread_device(torch.device("cuda", gpu))
        if ipaddress.ip_address(master).is_loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
            # Every rank is on this machine. Gloo otherwise listens on whatever the host name resolves
            # to, often a routable address.
            lo = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
            if lo:
                os.environ["GLOO_SOCKET_IFNAME"] = lo
        # Same store as init_method="tcp://..." (multi-tenant, default timeout), on rank 0's bound socket.
        # (torch.distributed imports TCPStore from its C extension without re-exporting it in its stubs.)
        store = dist.TCPStore(master, port, self.world_size, is_master=self.rank == 0, multi_tenant=True,  # type: ignore[attr-defined]
                              timeout=default_pg_timeout,
                              master_listen_fd=self._store_sock.fileno() if self._store_sock else None)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)
        my_group = None
        for ranks in tp_groups:  # every rank must create every group, in the same order
            g = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                my_group = g
        tp = TPContext(rank=self.spec.tp_rank, size=self.spec.tp_size, group=my_group)
        self._worker = StageWorker(self.spec, tp)
        device = self._worker.device
        link = self.spec.stage_link
        if link == "rendezvous" or link == "socket" or (link == "auto" and backend == "gloo"):
            # CPU stages: a socket (comm/socket_channel.py), or one with NCCL's strict rules
            # (comm/rendezvous.py)
            if device.type != "cpu":
                raise ValueError(f"parallel.stage_link={link} carries CPU tensors; GPU stages use torch "
                                 "(NCCL)")
            host = "127.0.0.1" if ipaddress.ip_address(master).is_loopback else self._node_ip()
            self._connect_socket_links(store, host, rendezvous=link == "rendezvous")
        else:
            # The ring gets a communicator of its own: on NCCL a pair's messages share one stream in both
            # directions, and at pp = 2 the ring's tokens (last to stage 0) would queue behind the hidden
            # states (stage 0 to 1).
            ring_group = None
            if self.spec.token_ring and self.spec.num_stages > 1:
                # on every rank
                ring_group = dist.new_group([0, (self.spec.num_stages - 1) * self.spec.tp_size])
            self.inbound = None if self.prev_rank is None else TorchP2PChannel(self.prev_rank, device)
            self.outbound = None if self.next_rank is None else TorchP2PChannel(self.next_rank, device)
            ring_from, ring_to = self._ring_peers()
            self.ring_in = None if ring_from is None else TorchP2PChannel(ring_from, device, ring_group)
            self.ring_out = None if ring_to is None else TorchP2PChannel(ring_to, device, ring_group)
        self._store = store  # the socket links met through it; kept while the group lives
        self.warm_up_links()

    def _gpu_index(self) -> int | None:
        """This stage's CUDA device index, or None for CPU: the one its placement gave it, never "cuda:0
        of the node" (see worker/devices.py)."""
        import torch

        from ppserve.worker.devices import cuda_device_for_actor

        if self.placement is not None:
            return self.placement.gpu
        import ray

        return cuda_device_for_actor(
            ray.get_runtime_context().get_accelerator_ids().get("GPU", []),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            torch.cuda.device_count() if torch.cuda.is_available() else 0, self.spec.gpus)

    def _node_ip(self) -> str:
        """The address other nodes reach this one by (a Ray actor's node; a local process is on loopback)."""
        if self.placement is not None:
            return "127.0.0.1"
        import ray

        return str(ray.util.get_node_ip_address())

    def _connect_socket_links(self, store: Any, host: str, rendezvous: bool) -> None:
        from ppserve.comm.socket_channel import RING_STORE_KEY, connect_links

        stage, last = self.spec.stage, self.spec.num_stages - 1
        make = None
        if rendezvous:
            from ppserve.comm.rendezvous import RendezvousChannel

            def make(sock: socket.socket, outbound: bool) -> RendezvousChannel:
                return RendezvousChannel(sock, outbound, f"stage {stage}",
                                         f"stage {stage + 1 if outbound else stage - 1}")

            def make_ring(sock: socket.socket, outbound: bool) -> RendezvousChannel:
                return RendezvousChannel(sock, outbound, f"stage {stage} (token ring)",
                                         f"stage {0 if outbound else last} (token ring)")
        self.inbound, self.outbound = connect_links(store, self.rank, self.prev_rank, self.next_rank, host,
                                                    channel=make)
        ring_from, ring_to = self._ring_peers()
        if ring_from is not None or ring_to is not None:
            self.ring_in, self.ring_out = connect_links(store, self.rank, ring_from, ring_to, host,
                                                        RING_STORE_KEY,
                                                        channel=make_ring if rendezvous else None)

    def _ring_peers(self) -> tuple[int | None, int | None]:
        """(the rank this one reads ring tokens from, the rank it sends them to): stage 0's TP rank 0 reads
        from the last stage's TP rank 0 (ranks are stage * tp + tp rank), and that one sends to it."""
        spec = self.spec
        if not spec.token_ring or spec.tp_rank != 0 or spec.num_stages < 2:
            return None, None
        last = (spec.num_stages - 1) * spec.tp_size
        if spec.stage == 0:
            return last, None
        if spec.stage == spec.num_stages - 1:
            return None, 0
        return None, None

    def warm_up_links(self) -> None:
        """One collective over the TP group and one message over each stage link, now: NCCL creates its
        communicators and buffers on first use, so their memory is in use before the KV cache is sized
        (and the first microbatch does not pay for it).

        The order is the pipeline's own, so that no send waits on a stage that is itself waiting: a
        send may block until its receive is posted, and a pair's first contact blocks both sides (NCCL).
        Stage 0 sends first; every later stage receives before it sends; the last stage's ring message
        goes out after its receive, and stage 0 takes it after its own send. A stage that sent before
        it received would close a cycle through the ring (stage 0 waits on 1, ..., the last on 0).
        """
        import torch

        worker = self._on_device()
        if worker.tp.size > 1:
            worker.tp.all_reduce(torch.zeros(1, device=worker.device))
        if self.spec.stage > 0:
            self._receive(1, WARM_UP_STEP)  # and the TP broadcast that passes it on
        if self.outbound is not None:
            self.outbound.send(torch.zeros(1, worker.arch.hidden_size, dtype=worker.dtype,
                                           device=worker.device),
                               wire(None, self.spec.stage + 1), WARM_UP_STEP)
        if self.ring_out is not None:  # the token ring's link too (a step id of -1: no step's tokens)
            self.ring_out.send(torch.zeros(1, 1, dtype=torch.int64, device=worker.device), (-1.0,),
                               WARM_UP_STEP)
        if self.ring_in is not None:
            self.ring_in.recv(1, 1, torch.int64, 1, WARM_UP_STEP)
        worker.memory.note("communication warmed up")

    def block_size(self) -> int:
        return int(self.worker.block_size)

    def _on_device(self) -> StageWorker:
        """The worker, with its device made current on the calling thread: Ray calls, a compiled graph's
        loop and the connection reader run on threads other than the one that built the worker, where
        the current CUDA device would be cuda:0 (worker/devices.py)."""
        from ppserve.worker.devices import bind_thread_device

        worker = self.worker
        bind_thread_device(worker.device)
        return worker

    def num_blocks_for_memory(self, kv_cache_memory: float | None, gpu_memory_utilization: float) -> int:
        return self._on_device().memory.num_blocks(kv_cache_memory, gpu_memory_utilization)

    def init_cache(self, num_blocks: int) -> tuple[float, ...] | None:
        """Allocate the KV cache, warm up and time the stage's step cost; TP rank 0 returns that cost's
        coefficients (the stage's prior for the scheduler's cost model), other ranks None."""
        worker = self._on_device()
        worker.init_cache(num_blocks)
        if self._own_process and worker.grammar is not None and has_tokenizer(self.spec.model_dir):
            # The vocabulary index for structured outputs, built now (after the step-cost timing, which it
            # must not disturb) rather than at the first constrained request, which would stall the
            # pipeline, or in the background, which would take the stage's cores and GIL while it serves.
            # In process the engine's cache builds it when first used.
            worker.grammar.cache.warm().result()
        if self.spec.tp_rank != 0 or worker.startup_cost is None:
            return None
        return worker.startup_cost.coefficients

    # ---- one microbatch ------------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult | None:
        """Run this actor's part of a microbatch; the last stage's TP rank 0 returns the StepResult.
        Under `PPSERVE_STRICT_HOST_SYNC` the step runs under the host-sync guard (worker/host_sync.py)."""
        if not self._strict:
            return self._execute(out)
        from ppserve.worker.host_sync import step_guard

        with step_guard(self.worker.device,
                        f"stage {self.spec.stage} tp {self.spec.tp_rank} step {out.step_id}"):
            return self._execute(out)

    def _execute(self, out: SchedulerOutput) -> StepResult | None:
        worker = self._on_device()
        hidden_in = None
        ring_tokens = self._ring_receive(out) if self.spec.token_ring and self.spec.stage == 0 else None
        inp = worker.prepare(out, ring_tokens)  # before the wait: it needs nothing from the previous stage
        if self.spec.stage > 0:
            with worker.timer.waiting(out.step_id):
                hidden_in, values = self._receive(out.total_tokens, out.step_id)
            if values is not None:
                self._upstream.append(values)
        hidden, result = worker.execute(out, hidden_in, inp)
        # None on TP ranks other than 0: rank 0's time is the stage's
        row = worker.times.relay(self._upstream_rows())
        if not worker.model.is_last:
            if self.outbound is not None:
                assert hidden is not None
                with worker.recorder.span("send", out.step_id):
                    self.outbound.send(hidden, wire(row, self.spec.stage + 1), out.step_id)
            return None
        if self.spec.tp_rank != 0:
            return None
        assert result is not None
        if self.ring_out is not None and out.sample_request_ids:
            with worker.recorder.span("send", out.step_id):  # the last stage's send: its tokens to stage 0
                self._ring_send(out, result)
        if row is None:
            return result
        return dataclasses.replace(result, stage_seconds=row.seconds, timed_step_id=row.step_id)

    def _upstream_rows(self) -> list[TimeRow]:
        """The rows of step times from upstream whose values are on the host by now, oldest first; the
        rest wait for a later step (over NCCL they are copied off the device behind the data)."""
        rows = []
        pending = self._upstream
        while pending and pending[0].ready():
            row = unwire(pending.popleft().get())
            if row is not None:
                rows.append(row)
        return rows

    def _ring_send(self, out: SchedulerOutput, result: StepResult) -> None:
        """The last stage: this step's sampled tokens to stage 0, in `out.sample_request_ids` order (the
        order stage 0 posted their receive with), the step id beside them. The ids are on the host
        already (the step's one read); they go back up through pinned memory, which does not wait."""
        import torch

        assert self.ring_out is not None
        sampled = result.sampled_token_ids
        tokens = torch.tensor([[sampled[rid]] for rid in out.sample_request_ids], dtype=torch.int64)
        if self.worker.device.type == "cuda":
            tokens = tokens.pin_memory().to(self.worker.device, non_blocking=True)
        self.ring_out.send(tokens, (float(out.step_id),), out.step_id)

    def _ring_receive(self, out: SchedulerOutput) -> Tensor | None:
        """Stage 0, before microbatch `out`: post the receive of `out`'s own ring message at once (the
        last stage's send of it may block until it is posted), then wait for the messages up to the
        step its ring decodes take their tokens from, and at least up to p + 1 steps back (the engine
        had those results back before it formed `out`, so they are here or on their way: the backlog
        stays bounded). Returns the ring decodes' tokens, on the device, in `out.ring_request_ids`
        order. The wait is `out`'s recv_wait: stage 0's, as the other stages' is their hidden states'."""
        import torch

        worker = self.worker
        due = self._ring_due
        target = out.step_id - (self.spec.num_stages + 1)
        if out.ring_step_id is not None:
            target = max(target, out.ring_step_id)
        tokens = self._ring_tokens
        live = worker.batch.requests
        # finished requests' last tokens: dropped now and then, not per step
        if len(tokens) > 2 * len(live) + 64:
            for rid in [r for r in tokens if r not in live]:
                del tokens[rid]
        if due and due[0][0] <= target:
            with worker.timer.waiting(out.step_id):
                while due and due[0][0] <= target:
                    step, rids, posted = due.popleft()
                    if posted is not None:
                        got, values = posted.wait()
                        if values.ready() and int(values.get()[0]) != step:  # host links: checked at once
                            raise RuntimeError(f"token ring: stage 0 expected step {step}'s tokens, got step "
                                               f"{int(values.get()[0])}'s")
                    else:  # a TP rank of stage 0 other than 0: its rank 0 hands them on
                        got = torch.empty(len(rids), 1, dtype=torch.int64, device=worker.device)
                    if worker.tp.size > 1:
                        worker.tp.broadcast_from_first(got)
                    flat = got.view(-1)
                    tokens.update((rid, flat[i]) for i, rid in enumerate(rids))  # views: nothing is read
        if out.sample_request_ids:
            posted = None
            if self.ring_in is not None:
                posted = self.ring_in.post_recv(len(out.sample_request_ids), 1, torch.int64, 1, out.step_id)
            due.append((out.step_id, out.sample_request_ids, posted))
        if not out.ring_request_ids:
            return None
        return torch.stack([tokens[rid] for rid in out.ring_request_ids])

    def _receive(self, num_tokens: int, step: int) -> tuple[Tensor, LinkValues | None]:
        """The previous stage's hidden states and the values (a row of step times) it sent on. Only TP
        rank 0 of each stage holds a link (one copy per stage pair crosses the network, not one per TP
        rank); it hands the hidden states on to the other ranks of its stage with a broadcast over the
        TP group (NVLink within a node). The values stay on rank 0, the one that relays them."""
        import torch

        worker = self.worker
        hidden_size, dtype, device = worker.arch.hidden_size, worker.dtype, worker.device
        values = None
        if self.inbound is not None:
            hidden, values = self.inbound.recv(num_tokens, hidden_size, dtype, wire_length(self.spec.stage),
                                               step)
        else:
            hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        if worker.tp.size > 1:
            worker.tp.broadcast_from_first(hidden)
        return hidden, values

    def execute_chained(self, out: SchedulerOutput, upstream: int | None = None) -> int | StepResult | None:
        """`execute` as a compiled-graph node: a non-last stage returns the step id for the next stage."""
        result = self.execute(out)
        return out.step_id if not self.worker.model.is_last else result

    def serve_connection(self, address: str | tuple[str, int], authkey: bytes, index: int) -> None:
        """Connect to the engine (HMAC-authenticated) and run every SchedulerOutput it sends, in order,
        on a thread of this actor; Ray calls (spans, shutdown) stay served meanwhile."""
        from multiprocessing.connection import Client

        from ppserve.comm.tcp import no_delay

        conn = Client(address, authkey=authkey)
        no_delay(conn)  # results go back at once, not after the engine's delayed ACK
        conn.send_bytes(pickle.dumps(index))
        self._conn = conn
        # Ray ran the set-up calls (loading, warm-up, start-up costs) on this thread; the loop thread computes
        # from now on, and this thread's idle OpenMP pool would stop the loop's from spinning at barriers.
        release_thread_pool()
        self._loop = threading.Thread(target=self._serve, args=(conn,), name="ppserve-stage", daemon=True)
        self._loop.start()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # the engine closed the connection: shutting down
                return
            out = pickle.loads(data)
            try:
                reply: tuple[str, StepResult | str] | None = None
                result = self.execute(out)
                if result is not None:
                    reply = ("result", result)
            except BaseException as e:  # tell the engine at once instead of letting it time out
                reply = ("error", f"stage {self.spec.stage} tp {self.spec.tp_rank}: {type(e).__name__}: {e}\n"
                                  f"{traceback.format_exc()}")
            if reply is not None:
                try:
                    # The last stage's send, like the others' (busy time, ARCHITECTURE.md#measuring-bubbles):
                    # the result to the engine.
                    with self.worker.recorder.span("send", out.step_id):
                        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
                except OSError:
                    return
                if reply[0] == "error":
                    return

    # ---- observability and teardown ---------------------------------------------------------------------
    def drain_spans(self) -> list[dict[str, Any]]:
        return self.worker.drain_spans()

    def shutdown(self) -> None:
        if self._conn is not None:
            self._conn.close()
        for ch in (self.inbound, self.outbound, self.ring_in, self.ring_out):
            if ch is not None:
                ch.close()
        if self.rank is not None and self.world_size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
