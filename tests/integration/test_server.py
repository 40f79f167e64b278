"""End-to-end gRPC tests against a real `ppserve serve` subprocess (default model, pp=2, loopback).

One server process serves the whole module (starting a pipeline costs ~20-40 s); the last test
stops it with SIGTERM and checks that it exits within the grace period.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from ppserve.request import SamplingParams
from ppserve.server.client import AsyncPPServeClient, PPServeClient
from tests.server_helpers import GRACE_S, ServerProcess, ready_client, running_server, wait_idle

CHAT_PROMPTS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Write a haiku about pipelines.",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[PPServeClient]:
    with ready_client(server) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> Iterator[Any]:
    """The offline API in this process at pp=1: greedy outputs must be identical to the server's."""
    from ppserve import LLM

    llm = LLM(pipeline_parallel_size=1, dtype="float32")
    yield llm
    llm.shutdown()


def test_health_and_reflection(client: PPServeClient) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    assert client.health() == "SERVING"
    assert client.health("ppserve.v1.PPServe") == "SERVING"
    services = ProtoReflectionDescriptorDatabase(client.channel).get_services()
    assert "ppserve.v1.PPServe" in services
    assert "grpc.health.v1.Health" in services


def test_streamed_greedy_equals_offline(client: PPServeClient, reference: Any) -> None:
    sp = SamplingParams(max_tokens=16)
    tok = reference.tokenizer
    chats = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in CHAT_PROMPTS
    ]
    id_prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    expected = reference.generate([*chats, id_prompt], sp)

    results: dict[int, Any] = {}

    def run(i: int) -> None:
        if i < len(CHAT_PROMPTS):
            results[i] = client.generate(messages=[{"role": "user", "content": CHAT_PROMPTS[i]}], sampling=sp)
        else:
            results[i] = client.generate(id_prompt, sampling=sp)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(expected))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, exp in enumerate(expected):
        got = results[i]
        assert got.token_ids == exp.token_ids, f"prompt {i}"
        assert got.text == exp.text, f"prompt {i}"
        assert got.finish_reason == exp.finish_reason
        assert got.num_prompt_tokens == len(exp.prompt_token_ids)
        assert len(got.token_times) == len(got.token_ids)
        assert got.metrics is not None and got.metrics["ttft_s"] > 0
    assert "Paris" in results[0].text


def test_choices_logprobs_and_penalties_over_grpc(client: PPServeClient, reference: Any) -> None:
    """n, logprobs and the penalties cross the proto: equal to the offline API (pp=1) on the same input."""
    prompt = reference.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    sp = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=2, logprobs=2, repetition_penalty=1.3,
                        frequency_penalty=0.4, ignore_eos=True)
    expected = reference.generate([prompt], sp)
    got = client.generate_choices(prompt, sampling=sp)
    assert [c.index for c in got] == [0, 1]
    for g, e in zip(got, expected, strict=True):
        assert g.token_ids == e.token_ids and g.text == e.text
        assert [lp["token_id"] for lp in g.logprobs] == e.token_ids
        assert e.logprobs is not None
        for lp, (want, top) in zip(g.logprobs, e.logprobs, strict=True):
            assert lp["logprob"] == pytest.approx(want, abs=1e-4)
            assert [t for t, _ in lp["top"]] == [t for t, _ in top]
    with pytest.raises(ValueError, match="generate_choices"):
        client.generate(prompt, sampling=sp)


def test_min_p_over_grpc_reaches_the_sampler(client: PPServeClient, reference: Any) -> None:
    """min_p crosses the proto into the sampler: min_p=1 keeps only the most likely token, so a hot
    temperature still gives the greedy tokens; a partial min_p, seeded, equals the offline API's draw."""
    prompt = reference.tokenizer.encode("The quick brown fox", add_special_tokens=False)
    greedy = reference.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    only_top = client.generate(prompt, max_tokens=5, temperature=5.0, min_p=1.0, seed=3, ignore_eos=True)
    assert only_top.token_ids == greedy.token_ids
    sp = SamplingParams(max_tokens=5, temperature=1.5, min_p=0.2, seed=11, ignore_eos=True)
    assert client.generate(prompt, sampling=sp).token_ids == reference.generate([prompt], sp)[0].token_ids


def test_metrics_over_http_show_every_stage(server: ServerProcess, client: PPServeClient) -> None:
    """The pp=2 server's /metrics (its HTTP door) carries both stages' gauges and compute histograms."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    client.generate("Hello there", max_tokens=4)
    assert server.http_url is not None
    text = httpx.get(server.http_url.removesuffix("/v1") + "/metrics", timeout=30).text
    stages: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if "stage" in sample.labels:
                stages.setdefault(sample.name, set()).add(sample.labels["stage"])
    for name in ("ppserve:stage_busy_fraction", "ppserve:stage_bubble_fraction",
                 "ppserve:stage_starvation_fraction", "ppserve:microbatch_compute_seconds_count"):
        assert stages.get(name) == {"0", "1"}, (name, stages.get(name))


def test_32_concurrent_streams(client: PPServeClient, server: ServerProcess) -> None:
    n, max_tokens = 32, 8

    async def main() -> list[Any]:
        async with AsyncPPServeClient(server.address or "") as ac:

            async def one(i: int) -> tuple[list[Any], Any]:
                chunks = [
                    c
                    async for c in ac.stream(
                        f"Count to ten, take {i}:", max_tokens=max_tokens, ignore_eos=True
                    )
                ]
                return chunks, chunks[-1]

            return await asyncio.gather(*(one(i) for i in range(n)))

    outs = asyncio.run(main())
    assert len(outs) == n
    for chunks, last in outs:
        assert last.finish_reason == "length"
        assert last.num_output_tokens == max_tokens
        assert sum(len(c.token_ids) for c in chunks) == max_tokens
        counts = [c.num_output_tokens for c in chunks]
        assert counts == sorted(counts)  # cumulative counts never go back
        times = [t for c in chunks for t in c.token_times]
        assert times == sorted(times)
        assert last.metrics is not None and last.metrics["mean_tbt_s"] > 0
    assert all(c.finish_reason is None for chunks, _ in outs for c in chunks[:-1])
    wait_idle(client)


def test_cancel_rpc_frees_blocks(client: PPServeClient) -> None:
    stream = client.stream("Tell me a long story.", max_tokens=500, ignore_eos=True, request_id="to-cancel")
    it = iter(stream)
    first = next(it)
    assert first.request_id == "to-cancel"
    s = client.stats()
    assert s.kv_blocks_used > 0 and s.running + s.waiting == 1
    assert client.cancel("to-cancel") is True
    rest = list(it)
    assert rest and rest[-1].finish_reason == "cancelled"
    assert client.cancel("to-cancel") is False  # already gone
    wait_idle(client)


def test_client_cancellation_and_deadline_free_blocks(client: PPServeClient) -> None:
    stream = client.stream("Tell me a long story.", max_tokens=500, ignore_eos=True)
    it = iter(stream)
    next(it)
    assert client.stats().kv_blocks_used > 0
    stream.cancel()  # the client goes away mid-stream
    with pytest.raises(grpc.RpcError) as e:
        list(it)
    assert e.value.code() is grpc.StatusCode.CANCELLED
    wait_idle(client)

    with pytest.raises(grpc.RpcError) as e:
        client.generate("Tell me a long story.", max_tokens=500, ignore_eos=True, timeout=1.5)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(client)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": "hi", "temperature": -1.0}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "min_p": 1.5}, "min_p"),
        ({"prompt": "hi", "max_tokens": -2}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt": [1] * 9000}, "prompt has 9000 tokens"),
    ],
)
def test_bad_input_is_invalid_argument(client: PPServeClient, kwargs: dict[str, Any], field: str) -> None:
    prompt = kwargs.pop("prompt")
    req_kwargs: dict[str, Any] = {}
    if kwargs:
        # Bypass client-side validation: send raw fields as a misbehaving client would.
        from ppserve.server.gen import ppserve_pb2 as pb

        req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(**kwargs))
        with pytest.raises(grpc.RpcError) as e:
            list(client.stub.Generate(req, timeout=30))
    else:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(prompt, timeout=30, **req_kwargs)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    assert client.stats().waiting == 0  # nothing was queued


def test_stats_report_stages_and_config(client: PPServeClient) -> None:
    client.generate("Hello", max_tokens=4, ignore_eos=True)
    s = client.stats()
    assert s.config.pipeline_parallel_size == 2 and s.config.policy == "sarathi"
    assert s.kv_blocks_total > 0 and s.tokens_generated > 0
    assert (s.num_restarts, s.last_recovery_s, s.total_recovery_s) == (0, 0.0, 0.0)  # healthy
    workers = sorted(s.workers, key=lambda w: w.stage)
    assert [w.stage for w in workers] == [0, 1]
    assert workers[0].layer_end == workers[1].layer_start
    assert all(w.node_ip and w.node_id and w.pid > 0 for w in workers)
    assert [st.stage for st in s.stages] == [0, 1]
    for st in s.stages:
        assert st.busy_fraction + st.bubble_fraction + st.starvation_fraction == pytest.approx(
            1.0, abs=1e-6
        )


def test_generate_and_stats_cli(server: ServerProcess, reference: Any) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppserve.cli",
            "generate",
            "What is the capital of France?",
            "--chat",
            "--max-tokens",
            "12",
            "--server",
            server.address or "",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    cut = subprocess.run(
        [sys.executable, "-m", "ppserve.cli", "generate", "What is the capital of France?", "--chat",
         "--max-tokens", "12", "--stop", "Paris", "--stop-token-ids", "9999", "--ignore-eos",
         "--server", server.address or ""],
        capture_output=True, text=True, timeout=60,
    )
    assert cut.returncode == 0, cut.stderr
    assert "Paris" not in cut.stdout and "France is" in cut.stdout and "stop" in cut.stderr
    st = subprocess.run(
        [sys.executable, "-m", "ppserve.cli", "stats", "--server", server.address or ""],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert st.returncode == 0, st.stderr
    assert "pp=2" in st.stdout and "bubble" in st.stdout and "0 pipeline restart(s)" in st.stdout


def test_sigterm_shuts_down_within_grace(server: ServerProcess, client: PPServeClient) -> None:
    """Last test of the module: a stream still running at SIGTERM ends, and the process exits."""
    stream = client.stream("Tell me a long story.", max_tokens=2000, ignore_eos=True)
    it = iter(stream)
    next(it)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    # The stream ends within the grace period: cancelled by the server (CANCELLED/UNAVAILABLE) or done.
    try:
        for _ in it:
            pass
    except grpc.RpcError as e:
        assert e.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), e
    assert time.monotonic() - t0 < GRACE_S + 5
    # Teardown of the pipeline and the embedded Ray takes a few seconds more.
    rc = server.proc.wait(GRACE_S + 60)
    assert rc == 0
