"""Soak: thousands of requests with random lengths through a real `ppserve serve`, a fraction cancelled
at random moments (half by the Cancel RPC, half by the client going away). Afterwards every KV block must
be free and no request waiting or running; the server's memory must stay bounded.

    python benchmarks/soak.py --model /path/to/tiny-llama --requests 2000 --pp 2 --out soak.json
    python benchmarks/soak.py --address 127.0.0.1:50051 --server-pid 1234   # against a running server

Prints the figures and writes them as JSON. Prompts are random token ids, so any model works, including
a tiny random one without a tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ppserve.server.client import AsyncPPServeClient


@dataclass
class SoakFigures:
    requests: int = 0
    completed: int = 0  # ran to a stop or length finish
    cancelled_rpc: int = 0  # cancelled by the Cancel RPC (cancel() returned True)
    cancelled_disconnect: int = 0  # the client went away mid-stream
    cancel_too_late: int = 0  # a cancel that arrived after the request had already finished
    errors: dict[str, int] = field(default_factory=dict)  # status code name -> count (should stay empty)
    tokens_received: int = 0
    wall_s: float = 0.0
    kv_blocks_used_after: int = -1
    kv_blocks_total: int = 0
    running_after: int = -1
    waiting_after: int = -1
    in_flight_after: int = -1
    rss_mib: dict[str, float] = field(default_factory=dict)  # checkpoint -> server VmRSS
    peak_rss_mib: float = 0.0  # server VmHWM at the end
    group_rss_mib: dict[str, float] = field(
        default_factory=dict
    )  # checkpoint -> RSS of the whole process session

    @property
    def leaked_blocks(self) -> int:
        return self.kv_blocks_used_after


# ---- memory from /proc (no psutil) ---------------------------------------------------------------
def proc_status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def session_rss_kib(pid: int) -> int:
    """RSS of every process in `pid`'s session: the server plus its embedded Ray and stage actors."""
    sid = os.getsid(pid)
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) == sid:
                total += proc_status_kib(int(d.name), "VmRSS")
        except (OSError, ValueError):
            continue
    return total


# ---- the load ------------------------------------------------------------------------------------
async def _one(ac: AsyncPPServeClient, rng: random.Random, i: int, vocab: int, max_prompt: int, max_new: int,
               cancel_fraction: float, fig: SoakFigures) -> None:
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
    max_tokens = rng.randint(1, max_new)
    mode = "none"
    if rng.random() < cancel_fraction:
        mode = "rpc" if rng.random() < 0.5 else "disconnect"
    after_chunks = rng.randint(0, 3)  # the random moment: before the first chunk, or after a few
    rid = f"soak-{i}"
    agen = ac.stream(
        prompt, max_tokens=max_tokens, ignore_eos=rng.random() < 0.8, request_id=rid, timeout=300
    )
    chunks = 0

    async def cancel_rpc() -> None:
        if await ac.cancel(rid):
            fig.cancelled_rpc += 1
        else:
            fig.cancel_too_late += 1

    try:
        while True:
            nxt = asyncio.ensure_future(agen.__anext__())
            if chunks == after_chunks and mode != "none":
                # The random moment: now, or a little later (before the first token when after_chunks == 0).
                await asyncio.sleep(rng.random() * 0.02)
                if mode == "disconnect" and not nxt.done():
                    nxt.cancel()  # the client goes away: the stream's finally cancels the call
                    fig.cancelled_disconnect += 1
                    try:
                        await nxt
                    except (asyncio.CancelledError, StopAsyncIteration):
                        pass
                    return
                if mode == "rpc":
                    await cancel_rpc()
                mode = "done" if mode == "rpc" else mode
            try:
                c = await nxt
            except StopAsyncIteration:
                return
            chunks += 1
            fig.tokens_received += len(c.token_ids)
            if c.finish_reason is not None:
                if c.finish_reason in ("stop", "length"):
                    fig.completed += 1
                    if mode in ("rpc", "disconnect"):  # finished before its cancel moment came
                        fig.cancel_too_late += 1
                return
            if mode == "disconnect" and chunks > after_chunks:
                fig.cancelled_disconnect += 1
                return  # aclose() below cancels the call
    except grpc.aio.AioRpcError as e:
        fig.errors[e.code().name] = fig.errors.get(e.code().name, 0) + 1
    finally:
        await agen.aclose()  # type: ignore[attr-defined]


async def _wait_idle(ac: AsyncPPServeClient, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await ac.stats()
        if (s.kv_blocks_used == 0 and s.running + s.waiting + s.in_flight_microbatches == 0) or (
            time.monotonic() > deadline
        ):
            return s
        await asyncio.sleep(0.2)


async def run_soak(
    address: str,
    server_pid: int | None,
    requests: int = 2000,
    concurrency: int = 64,
    cancel_fraction: float = 0.2,
    seed: int = 0,
    vocab: int = 256,
    max_prompt: int = 48,
    max_new: int = 24,
    checkpoints: tuple[int, ...] = (500,),
    progress: bool = True,
) -> SoakFigures:
    fig = SoakFigures(requests=requests)
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    done = 0

    def memory(label: str) -> None:
        if server_pid is not None:
            fig.rss_mib[label] = proc_status_kib(server_pid, "VmRSS") / 1024
            fig.group_rss_mib[label] = session_rss_kib(server_pid) / 1024

    async with AsyncPPServeClient(address) as ac:
        await ac.wait_ready(60)
        memory("start")
        t0 = time.monotonic()

        async def task(i: int) -> None:
            nonlocal done
            async with sem:
                await _one(
                    ac, random.Random(rng.random()), i, vocab, max_prompt, max_new, cancel_fraction, fig
                )
            done += 1
            if done in checkpoints:
                memory(str(done))
            if progress and done % 250 == 0:
                print(
                    f"  {done}/{requests} requests, {time.monotonic() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )

        await asyncio.gather(*(task(i) for i in range(requests)))
        fig.wall_s = time.monotonic() - t0
        s = await _wait_idle(ac)
        memory(str(requests))
        fig.kv_blocks_used_after, fig.kv_blocks_total = s.kv_blocks_used, s.kv_blocks_total
        fig.running_after, fig.waiting_after = s.running, s.waiting
        fig.in_flight_after = s.in_flight_microbatches
    if server_pid is not None:
        fig.peak_rss_mib = proc_status_kib(server_pid, "VmHWM") / 1024
    return fig


# ---- a server to soak ------------------------------------------------------------------------------
def launch_server(model: str, pp: int, overrides: list[str], log_path: Path,
                  timeout_s: float = 300.0) -> tuple[subprocess.Popen[str], str]:
    """Start `ppserve serve --port 0` in its own session; returns the process and its address."""
    cmd = [
        sys.executable,
        "-m",
        "ppserve.cli",
        "serve",
        "--port",
        "0",
        "--http-port",
        "-1",
        "--set",
        f"model.model={model}",
        "--set",
        f"parallel.pipeline_parallel_size={pp}",
    ]
    for o in overrides:
        cmd += ["--set", o]
    log = open(log_path, "w")  # noqa: SIM115 - handed to the child; closed by the OS with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = re.search(r"ppserve serving on (\S+:\d+)", line)
            if m:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(timeout_s)
    if not found:
        stop_server(proc)
        raise RuntimeError(f"server did not come up; see {log_path}")
    return proc, found[0]


def stop_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


SERVER_OVERRIDES = ["cache.block_size=4", "scheduler.token_budget=256", "scheduler.max_num_seqs=64",
                    "trace.enabled=false"]


def report(fig: SoakFigures) -> str:
    return (
        f"soak: {fig.requests} requests in {fig.wall_s:.1f} s; completed {fig.completed}, "
        f"cancelled {fig.cancelled_rpc} by Cancel + {fig.cancelled_disconnect} by disconnect "
        f"({fig.cancel_too_late} cancels came after the finish), errors {fig.errors or 'none'}, "
        f"{fig.tokens_received} tokens\n"
        f"after: leaked KV blocks {fig.leaked_blocks} of {fig.kv_blocks_total}, running {fig.running_after}, "
        f"waiting {fig.waiting_after}, in flight {fig.in_flight_after}\n"
        f"server RSS MiB {', '.join(f'{k}: {v:.0f}' for k, v in fig.rss_mib.items())}; peak "
        f"{fig.peak_rss_mib:.0f}; "
        "whole session (server + Ray + stages) "
        f"{', '.join(f'{k}: {v:.0f}' for k, v in fig.group_rss_mib.items())}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="model directory for a server started here")
    p.add_argument("--address", help="soak a running server instead (host:port)")
    p.add_argument("--server-pid", type=int, help="with --address: the server's pid, for memory figures")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn from [3, vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra server config override (repeatable), e.g. cache.num_blocks=400")
    p.add_argument("--out", default="soak.json")
    args = p.parse_args(argv)
    proc = None
    address, pid = args.address, args.server_pid
    if address is None:
        if not args.model:
            p.error("give --model (start a server) or --address")
        proc, address = launch_server(
            args.model, args.pp, SERVER_OVERRIDES + args.overrides, Path(args.out).with_suffix(".log")
        )
        pid = proc.pid
    try:
        fig = asyncio.run(
            run_soak(
                address,
                pid,
                args.requests,
                args.concurrency,
                args.cancel_fraction,
                args.seed,
                args.vocab,
                checkpoints=(min(500, args.requests),),
            )
        )
    finally:
        if proc is not None:
            stop_server(proc)
    print(report(fig))
    Path(args.out).write_text(json.dumps({**asdict(fig), "leaked_blocks": fig.leaked_blocks,
                                          "args": vars(args)}, indent=2))
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
