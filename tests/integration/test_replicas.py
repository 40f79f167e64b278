"""`ppserve serve --replicas 2` (Ray Serve, default model, float32, pp 1): both front doors through one
endpoint, greedy output equal to transformers with the second replica on, prefix-aware routing keeping a
conversation on one replica, the whole service's /health, /metrics and GetStats, errors relayed
unchanged, a replica killed mid-stream failing its request with UNAVAILABLE (never a hang) while the
other serves, and SIGTERM draining everything.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest

from tests.server_helpers import ServerProcess, running_server, set_args

openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from ppserve.server.client import PPServeClient  # noqa: E402

TOKEN = "replicas-token"
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a careful assistant for a railway company. You answer questions about timetables, "
          "tickets, delays and the stations of the network, briefly and politely, in plain English.")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("replicas"), "--replicas", "2", *set_args(
            "parallel.pipeline_parallel_size=1", f"server.auth_token={TOKEN}",
            "server.grace_seconds=20")) as proc:
        assert proc.http_url is not None, "".join(proc.lines)
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    assert server.http_url is not None
    with httpx.Client(base_url=server.http_url.removesuffix("/v1"),
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server: ServerProcess) -> Iterator[PPServeClient]:
    with PPServeClient(server.address or "", token=TOKEN) as c:
        c.wait_ready(30)
        yield c


def _samples(http: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _routed(http: httpx.Client) -> dict[str, float]:
    return {dict(labels)["replica"]: v for (name, labels), v in _samples(http).items()
            if name == "ppserve:router_requests_total"}


def test_both_front_doors_match_transformers(client: Any, grpc_client: PPServeClient,
                                             default_model_dir: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = "The three largest cities of Italy are"
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = out[0, len(ids):].tolist()
    for _ in range(3):  # requests land on either replica: each must agree
        got = grpc_client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert got.token_ids == want
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert text == tok.decode(want)


def test_conversation_sticks_to_one_replica(client: Any, http: httpx.Client) -> None:
    before = _routed(http)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "When is the first train?"}]
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"And the one after that, number {turn}?"}]
    after = _routed(http)
    grew = {r: after[r] - before.get(r, 0) for r in after if after[r] > before.get(r, 0)}
    assert len(grew) == 1 and sum(grew.values()) == 3, (before, after)
    assert all(c > 0 for c in cached[1:]), cached  # every later turn found its history cached


def test_health_metrics_and_stats_cover_both_replicas(http: httpx.Client, grpc_client: PPServeClient) -> None:
    health = http.get("/health").json()
    assert health["serving"] and len(health["replicas"]) == 2
    assert all(r["serving"] for r in health["replicas"].values())
    replicas = {dict(labels).get("replica") for (name, labels), _ in _samples(http).items()
                if name == "ppserve:num_requests_running"}
    assert replicas == set(health["replicas"])
    stats = grpc_client.stats()
    assert len(stats.workers) == 2 and len({w.pid for w in stats.workers}) == 2
    assert stats.requests_finished >= 1


def test_errors_are_relayed(server: ServerProcess, client: Any, http: httpx.Client) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    r = httpx.post(f"{server.http_url}/completions", json={"model": MODEL, "prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with PPServeClient(server.address or "", token="wrong") as bad, pytest.raises(grpc.RpcError) as e:
        bad.generate("hi", max_tokens=2)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cancel_reaches_the_replica(grpc_client: PPServeClient) -> None:
    stream = grpc_client.stream("Count slowly:", request_id="cancel-me", max_tokens=4000, ignore_eos=True)
    chunks = iter(stream)
    next(chunks)
    assert grpc_client.cancel("cancel-me")
    reasons = [c.finish_reason for c in chunks]
    assert reasons and reasons[-1] == "cancelled"


def test_killed_replica_fails_its_request_and_the_other_serves(http: httpx.Client, grpc_client: PPServeClient,
                                                               client: Any) -> None:
    stream = grpc_client.stream("Tell a very long story:", max_tokens=4000, ignore_eos=True, timeout=120)
    chunks = iter(stream)
    first = next(chunks)
    health = http.get("/health").json()["replicas"]
    victim = _replica_of(http, first.request_id, health)
    os.kill(health[victim]["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        for _ in chunks:
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 60
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert r.choices[0].text


def _replica_of(http: httpx.Client, request_id: str, health: dict[str, Any]) -> str:
    """The replica whose running-requests gauge shows the stream (one request runs at a time here)."""
    for _ in range(50):
        running = {dict(labels)["replica"]: v for (name, labels), v in _samples(http).items()
                   if name == "ppserve:num_requests_running"}
        busy = [r for r, v in running.items() if v > 0]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.1)
    raise AssertionError(f"cannot tell which replica runs {request_id}: {running}")


def test_sigterm_drains_and_stops(server: ServerProcess, client: Any) -> None:
    stream = iter(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    server.proc.send_signal(signal.SIGTERM)
    reasons = [c.choices[0].finish_reason for c in stream if c.choices]
    assert reasons[-1] == "length"  # the running request finished before its replica went
    assert server.proc.wait(90) == 0
