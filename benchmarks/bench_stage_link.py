"""How long a stage waits for hidden states that were sent long before it asked: gloo p2p against the
socket link (ppserve/comm/), with the real channel classes, two processes, one torch thread each.

The sender sends a decode microbatch's hidden states (4 x 576 bf16 and a row of step times, as the
default model's stage 0 does) and computes for 18 ms; the receiver computes for 24 ms, so the data has
always been sent ~6 ms or more before it receives, and times the receive. A third process computing in
bursts (`--contenders`, default 1: the engine and Ray beside the stages on a 2-core machine) competes
for the cores, which is where gloo's rendezvous costs: its data is written by the sending process's
background thread once the receiver asks, and that thread must find a core.

    python benchmarks/bench_stage_link.py [--steps 60] [--rounds 2] [--contenders 1]
        [--out results/bench_stage_link.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from pathlib import Path
from typing import Any

from ppserve.bench.report import write_json

TOKENS, HIDDEN = 4, 576
SEND_EVERY_MS, RECEIVE_EVERY_MS = 18.0, 24.0
WARM = 5  # first receives left out (connection set-up, first-call costs)


def busy(ms: float) -> None:
    import torch

    a = torch.randn(256, 256)
    t = time.perf_counter()
    while (time.perf_counter() - t) * 1e3 < ms:
        a = (a @ a).clamp_(-1, 1)


def contender() -> None:
    while True:  # bursts of compute, as the engine thread, the event loop and Ray's daemons do
        busy(3.0)
        time.sleep(0.002)


def stage(rank: int, link: str, port: int, steps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from ppserve.comm.p2p import TorchP2PChannel
    from ppserve.comm.socket_channel import connect_links

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    device = torch.device("cpu")
    if link == "socket":
        inbound, outbound = connect_links(
            store, rank, 0 if rank == 1 else None, 1 if rank == 0 else None, "127.0.0.1"
        )
    else:
        inbound = TorchP2PChannel(0, device) if rank == 1 else None
        outbound = TorchP2PChannel(1, device) if rank == 0 else None
    waits = []
    for i in range(steps):
        if outbound is not None:
            outbound.send(torch.full((TOKENS, HIDDEN), float(i), dtype=torch.bfloat16), (0.001 * i,))
            busy(SEND_EVERY_MS)
        else:
            assert inbound is not None
            busy(RECEIVE_EVERY_MS)
            t0 = time.perf_counter()
            hidden, times = inbound.recv(TOKENS, HIDDEN, torch.bfloat16, 1)
            waits.append((time.perf_counter() - t0) * 1e3)
            assert hidden[0, 0].item() == float(i) and times.get() == (0.001 * i,)
    for ch in (inbound, outbound):
        if ch is not None:
            ch.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 1:
        out.put(waits[WARM:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(link: str, steps: int, contenders: int) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=stage, args=(r, link, port, steps, q)) for r in (0, 1)]
    hogs = [ctx.Process(target=contender, daemon=True) for _ in range(contenders)]
    for p in procs + hogs:
        p.start()
    waits: list[float] = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    for p in hogs:
        p.terminate()
    return waits


def summary(waits: list[float]) -> dict[str, float]:
    w = sorted(waits)
    return {"median_ms": statistics.median(w), "p90_ms": w[int(0.9 * (len(w) - 1))], "max_ms": w[-1],
            "receives": len(w)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2, help="each link this many times, interleaved")
    ap.add_argument("--contenders", type=int, default=1, help="processes computing beside the two stages")
    ap.add_argument("--out", default="results/bench_stage_link.json")
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for link in ("torch", "socket"):
            s = summary(measure(link, args.steps, args.contenders))
            rows.append({"round": r, "link": link, **s})
            print(
                f"round {r}  {link:6s} (gloo p2p)  "
                if link == "torch"
                else f"round {r}  {link:6s} (TCP)       ",
                f"receive of data sent >= 6 ms before: median {s['median_ms']:.3f} ms, p90 "
                f"{s['p90_ms']:.3f}, "
                f"max {s['max_ms']:.3f}",
                flush=True,
            )
    write_json(Path(args.out), {"benchmark": "stage_link", "contenders": args.contenders, "steps": args.steps,
                                "message": {"tokens": TOKENS, "hidden": HIDDEN, "dtype": "bfloat16"},
                                "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
