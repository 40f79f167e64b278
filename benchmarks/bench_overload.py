"""Overload: a burst at 4x a server's request capacity (max_num_seqs + max_waiting), then 4x sustained
(every client retries on RESOURCE_EXHAUSTED until served), with health and GetStats probed throughout.

    python benchmarks/bench_overload.py --model /path/to/tiny-llama --out overload.json
    python benchmarks/bench_overload.py --address 127.0.0.1:50051 --capacity 8   # against a running server

Prints the figures (how long a refusal takes, how long the probes take under load, how many requests
were served and refused) and writes them as JSON. Nothing is asserted: tests/integration/test_bad_input.py
runs `run_overload` against its own server and checks what does not depend on the clock (every request
served or refused, the admitted ones complete, KV memory never over-committed, the probes always answered).
Prompts are token ids, so any model works, including a tiny random one without a tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ppserve.server.client import AsyncPPServeClient

MAX_RUNNING = 4
MAX_WAITING = 4
MAX_TOKENS = 24
SERVER_OVERRIDES = [
    "cache.block_size=4",
    "scheduler.token_budget=32",
    f"scheduler.max_num_seqs={MAX_RUNNING}",
    f"scheduler.max_waiting={MAX_WAITING}",
]


@dataclass
class Call:
    code: str  # "OK" or the gRPC status code's name
    seconds: float
    tokens: int = 0


@dataclass
class Probe:
    health: str
    health_s: float
    stats_s: float
    stats: dict[str, Any]


@dataclass
class OverloadFigures:
    burst: int
    max_tokens: int
    calls: list[Call] = field(default_factory=list)  # the burst, one per request
    sustained: list[list[Call]] = field(
        default_factory=list
    )  # per client: its refusals, then the last answer
    probes: list[Probe] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)  # GetStats once the load is over
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def slowest(xs: list[float]) -> float:
            return max(xs, default=0.0)

        refusals = [c.seconds for c in self.calls if c.code == "RESOURCE_EXHAUSTED"]
        return {
            "burst": self.burst,
            "served": sum(c.code == "OK" for c in self.calls),
            "refused": len(refusals),
            "slowest_refusal_s": slowest(refusals),
            "median_refusal_s": sorted(refusals)[len(refusals) // 2] if refusals else 0.0,
            "slowest_served_s": slowest([c.seconds for c in self.calls if c.code == "OK"]),
            "sustained_refusals": sum(len(s) - 1 for s in self.sustained),
            "probes": len(self.probes),
            "slowest_health_s": slowest([p.health_s for p in self.probes]),
            "slowest_stats_s": slowest([p.stats_s for p in self.probes]),
            "wall_s": self.wall_s,
        }


async def run_overload(
    address: str,
    burst: int,
    max_tokens: int = MAX_TOKENS,
    timeout_s: float = 120.0,
    retry_sleep_s: float = 0.05,
    probe_sleep_s: float = 0.05,
    **client_kwargs: Any,
) -> OverloadFigures:
    """One burst of `burst` requests at once, then `burst` clients that retry until served."""
    fig = OverloadFigures(burst=burst, max_tokens=max_tokens)
    async with AsyncPPServeClient(address, **client_kwargs) as ac:
        await ac.wait_ready(30)

        async def one(i: int) -> Call:
            t0 = time.monotonic()
            try:
                out = await ac.generate([3 + i % 200, 4, 5, 6, 7, 8], max_tokens=max_tokens, ignore_eos=True,
                                        timeout=timeout_s)
            except grpc.aio.AioRpcError as e:
                return Call(e.code().name, time.monotonic() - t0)
            return Call("OK", time.monotonic() - t0, len(out.token_ids))

        async def persistent(i: int) -> list[Call]:
            calls = []
            while True:
                calls.append(await one(i))
                if calls[-1].code != "RESOURCE_EXHAUSTED":
                    return calls
                await asyncio.sleep(retry_sleep_s)

        async def observe(done: asyncio.Event) -> None:
            while not done.is_set():
                t0 = time.monotonic()
                health = await ac.health(timeout=10)
                t1 = time.monotonic()
                s = (await ac.stats(timeout=10)).to_dict()  # the figures are JSON
                fig.probes.append(Probe(health, t1 - t0, time.monotonic() - t1, s))
                await asyncio.sleep(probe_sleep_s)

        done = asyncio.Event()
        watcher = asyncio.ensure_future(observe(done))
        t0 = time.monotonic()
        fig.calls = list(await asyncio.gather(*(one(i) for i in range(burst))))
        fig.sustained = list(await asyncio.gather(*(persistent(i) for i in range(burst))))
        fig.wall_s = time.monotonic() - t0
        done.set()
        await watcher
        fig.final = (await ac.stats()).to_dict()
    return fig


def report(fig: OverloadFigures) -> str:
    s = fig.summary()
    return (f"burst of {s['burst']}: {s['served']} served, {s['refused']} RESOURCE_EXHAUSTED; refusal median "
            f"{s['median_refusal_s']:.3f} s, slowest {s['slowest_refusal_s']:.3f} s (slowest served request "
            f"{s['slowest_served_s']:.2f} s)\n"
            f"sustained 4x load: {s['burst']} clients all answered after {s['sustained_refusals']} refusals; "
            f"{s['probes']} health+stats probes, slowest health {s['slowest_health_s']:.3f} s, slowest stats "
            f"{s['slowest_stats_s']:.3f} s; {s['wall_s']:.1f} s in all")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory for a server started here (with SERVER_OVERRIDES)")
    p.add_argument("--address", help="load a running server instead (host:port)")
    p.add_argument("--capacity", type=int, default=MAX_RUNNING + MAX_WAITING,
                   help="the server's max_num_seqs + max_waiting; the burst is 4x this")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra server config override (repeatable)")
    p.add_argument("--out", default="overload.json")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from soak import launch_server, stop_server  # the soak's server launcher

    proc, address = None, args.address
    if address is None:
        if not args.model:
            p.error("give --model (start a server) or --address")
        proc, address = launch_server(args.model, args.pp, SERVER_OVERRIDES + args.overrides,
                                      Path(args.out).with_suffix(".log"))
    try:
        fig = asyncio.run(run_overload(address, 4 * args.capacity, args.max_tokens))
    finally:
        if proc is not None:
            stop_server(proc)
    print(report(fig))
    Path(args.out).write_text(
        json.dumps({"summary": fig.summary(), **asdict(fig), "args": vars(args)}, indent=2)
    )
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
