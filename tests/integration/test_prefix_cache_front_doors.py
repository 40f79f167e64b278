"""Prefix caching through the front doors, on the real engine (tiny model, in-process stages): gRPC's
cache_salt and cached-tokens field, OpenAI's cache_salt and usage.prompt_tokens_details.cached_tokens,
the /metrics counters and GetStats' hit rate, exact on a hand-built sequence of requests."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from ppserve.config import load_config
from ppserve.engine.async_engine import AsyncEngine
from ppserve.engine.llm_engine import LLMEngine
from ppserve.server.client import AsyncPPServeClient
from ppserve.server.metrics import ServerMetrics
from ppserve.server.openai_api import build_app
from ppserve.server.server import start_server
from tests.oracle import random_prompts

PROMPT = random_prompts(5, (30,))[0]  # 7 full blocks of 4; a hit is at most 28 tokens (one must be computed)
HIT = 28


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_cache_salt_cached_tokens_and_counters(tiny_llama_dir):
    cfg = load_config(None, [f"model.model={tiny_llama_dir}", "model.dtype=float32",
                             "parallel.executor=inproc", "cache.block_size=4", "scheduler.token_budget=64"])

    async def main():  # type: ignore[no-untyped-def]
        engine = AsyncEngine(LLMEngine(cfg))
        running = await start_server(engine, "127.0.0.1", 0)  # starts the engine too
        metrics = ServerMetrics("tiny")
        app = build_app(engine, model_name="tiny", metrics=metrics)
        got = {}
        try:
            async with AsyncPPServeClient(running.address) as grpc_client, httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
                got["grpc_first"] = (await grpc_client.generate(PROMPT, max_tokens=2)).num_cached_tokens
                got["grpc_again"] = (await grpc_client.generate(PROMPT, max_tokens=2)).num_cached_tokens
                got["grpc_salted"] = (await grpc_client.generate(PROMPT, max_tokens=2,
                                                                 cache_salt="tenant-b")).num_cached_tokens

                async def completion(**extra):  # type: ignore[no-untyped-def]
                    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
                    assert r.status_code == 200, r.text
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

                # the gRPC request's salt: shared
                got["http_salted"] = await completion(cache_salt="tenant-b")
                got["http_new_salt"] = await completion(cache_salt="tenant-c")
                r = await http.post("/v1/completions",
                                    json={"prompt": PROMPT, "max_tokens": 2, "stream": True,
                                          "stream_options": {"include_usage": True}})
                usage = next(e for e in r.text.split("\n\n") if '"usage"' in e)
                got["http_stream"] = f'"cached_tokens":{HIT}' in usage.replace(" ", "")
                got["metrics"] = (await http.get("/metrics")).text
                got["stats"] = await grpc_client.stats()
        finally:
            await running.stop(1.0)
        return got

    got = asyncio.run(main())
    assert (got["grpc_first"], got["grpc_again"], got["grpc_salted"]) == (0, HIT, 0)
    assert (got["http_salted"], got["http_new_salt"], got["http_stream"]) == (HIT, 0, True)
    # Six admissions of 30 tokens; hits: the second, the fourth and the sixth (unsalted again).
    queries, hits = 6 * 30, 3 * HIT
    s = got["stats"]
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (queries, hits)
    assert abs(s.prefix_cache_hit_rate - hits / queries) < 1e-9 and s.kv_blocks_cached >= 3 * 7
    assert _metric(got["metrics"], "ppserve:prefix_cache_queries_total") == queries
    assert _metric(got["metrics"], "ppserve:prefix_cache_hits_total") == hits


def test_reset_prefix_cache_makes_the_next_request_compute_its_prompt_whole(tiny_llama_dir):
    from ppserve import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", block_size=4, token_budget=64) as llm:
        def hits_of_one_run() -> int:
            before = llm.engine.stats().prefix_cache_hits
            llm.generate([PROMPT], greedy)
            return llm.engine.stats().prefix_cache_hits - before

        assert hits_of_one_run() == 0
        assert hits_of_one_run() == HIT
        llm.reset_prefix_cache()
        assert hits_of_one_run() == 0  # computed whole, and cached again
        assert hits_of_one_run() == HIT
        # Not while a request holds KV: that is not a cache, and the engine refuses, losing nothing.
        rid = llm.engine.add_request(PROMPT, greedy)
        with pytest.raises(RuntimeError, match="idle engine"):
            llm.reset_prefix_cache()
        while llm.engine.has_unfinished:
            llm.engine.step()
        assert rid not in llm.engine.unfinished_ids()
