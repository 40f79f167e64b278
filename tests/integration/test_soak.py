"""Soak: 2,000 requests with random lengths through a real server (tiny model, pp=2), 20 % cancelled at
random moments (half by Cancel, half by client disconnect). Afterwards every KV block is free, nothing is
waiting or running, and the server's memory stays bounded. The code is benchmarks/soak.py's.
"""

from __future__ import annotations

import asyncio

from tests.bench_scripts import load_benchmark

REQUESTS = 2000


def test_soak_2000_requests_with_cancels(tiny_llama_dir, tmp_path) -> None:
    soak = load_benchmark("soak")
    # A small KV cache (400 blocks of 4 tokens for 64 concurrent requests) adds preemption to the mix.
    overrides = [*soak.SERVER_OVERRIDES, "cache.num_blocks=400"]
    proc, address = soak.launch_server(str(tiny_llama_dir), 2, overrides, tmp_path / "server.log")
    try:
        fig = asyncio.run(soak.run_soak(address, proc.pid, requests=REQUESTS, concurrency=64,
                                        cancel_fraction=0.2, seed=1, checkpoints=(500,), progress=False))
        stats_ok = proc.poll() is None
    finally:
        soak.stop_server(proc)
    print("\n" + soak.report(fig))
    assert stats_ok, "the server died during the soak"
    assert not fig.errors, fig.errors
    assert fig.completed + fig.cancelled_rpc + fig.cancelled_disconnect == REQUESTS
    assert fig.cancelled_rpc > 50 and fig.cancelled_disconnect > 50
    assert fig.leaked_blocks == 0 and fig.kv_blocks_total == 400
    assert fig.running_after == 0 and fig.waiting_after == 0 and fig.in_flight_after == 0
    # Bounded memory: the server grows by no more than a little between 500 and 2,000 requests.
    growth = fig.rss_mib[str(REQUESTS)] - fig.rss_mib["500"]
    assert growth < 64, fig.rss_mib
    # ... and so does the whole session, stage actors included (unbucketed oneDNN bf16 primitives once
    # grew each stage by ~600 MiB here).
    session_growth = fig.group_rss_mib[str(REQUESTS)] - fig.group_rss_mib["500"]
    assert session_growth < 160, fig.group_rss_mib
