"""Replicas behind one endpoint on this machine: prefix-aware against round-robin routing on a multi-turn
chat workload, and a replica killed mid-run.

Each variant is a real `ppserve serve` (default model, pp 1) driven over HTTP with streamed chat
completions: C conversations run at once, each turn waiting for the previous answer, so every turn's
prompt is the previous one plus its answer plus a new question, after one system prompt all share.
Figures: the prefix-cache hit rate over the run (GetStats, summed over the replicas: hit tokens over
queried tokens), TTFT p50/p90 as the client sees it, and, with --kill, every request's outcome.

    python benchmarks/bench_replicas.py                 # 1 replica, 2 prefix-aware, 2 round-robin
    python benchmarks/bench_replicas.py --kill 2        # 2 replicas, one killed 2 s into the run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

SYSTEM = (
    "You are the help desk of a regional railway. You answer questions about timetables, tickets, "
    "delays, platforms, bicycles on trains, luggage, refunds and the stations of the network. "
    "Answer briefly and politely, in plain English, and say so when you do not know."
)
TOPICS = [
    "the first train to the coast",
    "a refund for a cancelled trip",
    "bicycles on night trains",
    "the platform for the airport line",
    "a season ticket for students",
    "luggage limits",
    "the last train from the capital",
    "dogs on regional trains",
    "group tickets for a school",
    "step-free access at the old station",
    "seat reservations at weekends",
    "lost property",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    def __init__(self, replicas: int, routing: str, log: Path) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "ppserve.cli",
            "serve",
            "--replicas",
            str(replicas),
            "--routing",
            routing,
            "--port",
            str(self.grpc_port),
            "--http-port",
            str(self.http_port),
            "--set",
            "parallel.pipeline_parallel_size=1",
            "--set",
            "server.grace_seconds=2",
        ]
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if re.search(r"ppserve serving on", line):
                self.ready.set()
        self.ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait(self, timeout: float = 300) -> None:
        self.ready.wait(timeout)
        if self.proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


async def chat_turn(
    http: httpx.AsyncClient, messages: list[dict[str, str]], max_tokens: int, timeout: float
) -> dict[str, Any]:
    """One streamed turn: its outcome (ok, unavailable, hung, error), TTFT and answer."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    t0 = time.perf_counter()
    ttft, parts = None, []
    try:
        async with asyncio.timeout(timeout), http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"outcome": "unavailable" if r.status_code == 503 else f"http {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"outcome": "unavailable", "message": event["error"]["message"]}
                delta = event["choices"][0]["delta"].get("content") or ""
                if delta and ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(delta)
    except TimeoutError:
        return {"outcome": "hung"}
    except httpx.HTTPError as e:
        return {"outcome": "error", "message": f"{type(e).__name__}: {e}"}
    if ttft is None:
        return {"outcome": "error", "message": "no content"}
    return {"outcome": "ok", "ttft_s": ttft, "text": "".join(parts)}


def timetable(i: int, lines: int) -> str:
    """A conversation's own document (a timetable the user pastes): history no other conversation shares."""
    stations = ["Northgate", "Harbour", "Old Mill", "Airport", "University", "Riverside", "Castle Hill"]
    rows = [
        f"Train {i}-{j} leaves {stations[(i + j) % len(stations)]} at {6 + j % 17}:{(7 * j + i) % 60:02d} "
        f"from platform {1 + (i * j) % 9} and calls at {stations[(i + 2 * j) % len(stations)]}."
        for j in range(lines)
    ]
    return "\n".join(rows)


async def conversation(
    http: httpx.AsyncClient, i: int, args: argparse.Namespace, results: list[dict[str, Any]]
) -> None:
    await asyncio.sleep(args.stagger * i)  # staggered starts
    first = (
        f"Here is my timetable:\n{timetable(i, args.document_lines)}\n"
        f"I have a question about {TOPICS[i % len(TOPICS)]}."
    )
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]
    for turn in range(args.turns):
        res = await chat_turn(http, messages, args.max_tokens, args.timeout)
        results.append({"conversation": i, "turn": turn, **res})
        messages += [
            {"role": "assistant", "content": res.get("text") or "Sorry, please ask again."},
            {"role": "user", "content": f"Thank you. Which train should I take for question {turn + 2}?"},
        ]


def cache_counts(url_grpc: str) -> tuple[int, int]:
    from ppserve.server.client import PPServeClient

    with PPServeClient(url_grpc) as c:
        s = c.stats()
    return int(s.prefix_cache_hits), int(s.prefix_cache_queries)


async def kill_one(url: str, after_s: float, killed: list[str]) -> None:
    await asyncio.sleep(after_s)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        replicas = (await http.get("/health")).json()["replicas"]
    victim = sorted(replicas)[0]
    os.kill(replicas[victim]["pid"], signal.SIGKILL)
    killed.append(victim)


async def wait_replaced(
    http: httpx.AsyncClient, count: int, killed: list[str], limit_s: float = 180
) -> float | None:
    """Seconds after the run until Serve again has `count` replicas serving, none of them a killed one."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        replicas = (await http.get("/health")).json()["replicas"]
        live = [r for r, st in replicas.items() if st.get("serving") and r not in killed]
        if len(live) >= count:
            return time.perf_counter() - t0
        await asyncio.sleep(1)
    return None


async def drive(server: Server, args: argparse.Namespace, kill_after: float | None) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    killed: list[str] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=None) as http:
        await chat_turn(http, [{"role": "user", "content": "warm up"}], 2, args.timeout)  # not counted
        hits0, queries0 = cache_counts(f"127.0.0.1:{server.grpc_port}")
        t0 = time.perf_counter()
        tasks = [conversation(http, i, args, results) for i in range(args.conversations)]
        if kill_after is not None:
            tasks.append(kill_one(server.url, kill_after, killed))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        replaced_s = await wait_replaced(http, 2, killed) if kill_after is not None else None
    hits1, queries1 = (
        cache_counts(f"127.0.0.1:{server.grpc_port}") if kill_after is None else (hits0, queries0)
    )
    ok = [r["ttft_s"] for r in results if r["outcome"] == "ok"]
    later = [r["ttft_s"] for r in results if r["outcome"] == "ok" and r["turn"] > 0]
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    q = statistics.quantiles(ok, n=10) if len(ok) >= 2 else [float("nan")] * 9
    return {
        "requests": len(results),
        "outcomes": outcomes,
        "wall_s": wall,
        "killed": killed,
        "replaced_after_run_s": replaced_s,
        "hit_rate": (hits1 - hits0) / max(1, queries1 - queries0) if kill_after is None else None,
        "ttft_p50_s": statistics.median(ok) if ok else None,
        "ttft_p90_s": q[8],
        "later_turns_ttft_p50_s": statistics.median(later) if later else None,
        "turns": [{k: v for k, v in r.items() if k != "text"} for r in results],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--stagger", type=float, default=0.05, help="seconds between conversations' starts")
    p.add_argument(
        "--document-lines", type=int, default=40, help="lines of each conversation's own timetable"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=180.0, help="a request still unanswered after this hung")
    p.add_argument(
        "--kill", type=float, metavar="S", help="2 prefix-aware replicas; kill one S s into the run"
    )
    p.add_argument("--out", default=None, help="JSON file (default: results/<time>-replicas.json)")
    args = p.parse_args()
    variants = (
        [("2 replicas, prefix-aware, one killed", 2, "prefix", args.kill)]
        if args.kill is not None
        else [
            ("1 replica", 1, "prefix", None),
            ("2 replicas, prefix-aware", 2, "prefix", None),
            ("2 replicas, round-robin", 2, "round-robin", None),
        ]
    )
    out = Path(args.out or f"results/{time.strftime('%Y%m%d-%H%M%S')}-replicas.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, n, routing, kill in variants:
        server = Server(n, routing, out.with_suffix(f".{n}-{routing}.log"))
        try:
            server.wait()
            row = {"variant": name, **asyncio.run(drive(server, args, kill))}
        finally:
            server.stop()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "turns"}), flush=True)
    print(
        "\n| variant | requests | outcomes | prefix hit rate | TTFT p50 | TTFT p90 | later turns p50 |\n"
        "|---|---|---|---|---|---|---|"
    )
    for r in rows:
        hit = f"{r['hit_rate']:.3f}" if r["hit_rate"] is not None else "-"
        p50 = f"{1000 * r['ttft_p50_s']:.0f} ms" if r["ttft_p50_s"] else "-"
        p90 = f"{1000 * r['ttft_p90_s']:.0f} ms" if r["ttft_p90_s"] == r["ttft_p90_s"] else "-"
        later = r["later_turns_ttft_p50_s"]
        p50_later = f"{1000 * later:.0f} ms" if later else "-"
        print(f"| {r['variant']} | {r['requests']} | {r['outcomes']} | {hit} | {p50} | {p90} | {p50_later} |")
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
