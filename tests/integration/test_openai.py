"""The OpenAI-compatible HTTP API of a real `ppserve serve` (default model, float32), driven by the
official `openai` client and plain HTTP; /metrics parsed with prometheus_client's own parser.

One server serves the module, with a bearer token (the gRPC one: both front doors check it). It runs
the in-process executor at pp=1 to keep the suite short: the HTTP door sits above the engine and is
the same at any pipeline depth (test_server.py scrapes /metrics of its pp=2 server for two stages).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_helpers import ServerProcess, running_server, set_args

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

TOKEN = "test-token-123"
MODEL = "SmolLM2-135M-Instruct"
HAIKU = "Write a haiku about pipelines."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("openai"), *set_args(
            "parallel.pipeline_parallel_size=1", "parallel.executor=inproc",
            f"server.auth_token={TOKEN}")) as proc:
        assert proc.http_url is not None, "".join(proc.lines)
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.http_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    assert server.http_url is not None
    root = server.http_url.removesuffix("/v1")
    with httpx.Client(base_url=root, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> Any:
    """transformers on the same weights in float32: the oracle for tokens and log-probabilities."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return model, tok


def _chat_ids(tok: Any, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                   add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


def _greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], Any]:
    """transformers' greedy continuation (stopping at eos) and the log-softmax at every new position."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0)
        new = out[0, len(ids):].tolist()
        logits = model(out).logits[0, len(ids) - 1 : len(ids) - 1 + len(new)]
    return new, torch.log_softmax(logits.float(), dim=-1)


def _metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by `name{labels}` (label order as exposed), parsed by prometheus_client."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        if m["ppserve:num_requests_running{}"] == 0 and m["ppserve:kv_cache_usage_perc{}"] == 0:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle: {m}")
        time.sleep(0.2)


def test_models_and_health(client: Any, server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    root = server.http_url.removesuffix("/v1")  # type: ignore[union-attr]
    assert httpx.get(f"{root}/health").status_code == 200  # probes carry no token


def test_wrong_or_missing_token_is_401(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=server.http_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 401 and "bearer token" in e.value.message
    root = server.http_url.removesuffix("/v1")  # type: ignore[union-attr]
    r = httpx.get(f"{root}/metrics")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_chat_greedy_equals_transformers_whole_and_streamed(client: Any, reference: Any) -> None:
    model, tok = reference
    want, _ = _greedy(model, _chat_ids(tok, HAIKU), 40)
    want_text = tok.decode(want, skip_special_tokens=True)
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HAIKU}],
                                           max_tokens=40, temperature=0)
    assert whole.choices[0].message.content == want_text
    assert whole.usage.completion_tokens == len(want)
    assert whole.usage.prompt_tokens == len(_chat_ids(tok, HAIKU))
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HAIKU}],
                                            max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            pieces.append(ch.delta.content or "")
            reasons.append(ch.finish_reason)
    assert "".join(pieces) == want_text
    assert reasons[-1] == whole.choices[0].finish_reason and len([r for r in reasons if r]) == 1
    assert usage is not None and usage.completion_tokens == len(want)


def test_a_stop_string_straddling_tokens_never_reaches_the_client(client: Any, reference: Any) -> None:
    model, tok = reference
    want, _ = _greedy(model, _chat_ids(tok, HAIKU), 40)
    pieces = [tok.decode([t]) for t in want]
    # A stop string made of the last two characters of one token and the first of the next.
    i = next(i for i in range(5, len(pieces) - 1)
             if len(pieces[i].strip()) >= 2 and pieces[i + 1][:1].isalpha())
    stop = pieces[i][-2:] + pieces[i + 1][0]
    full = tok.decode(want, skip_special_tokens=True)
    expected = full[: full.index(stop)]
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HAIKU}],
                                            max_tokens=40, temperature=0, stop=[stop], stream=True)
    got, reason = "", None
    for chunk in stream:
        for ch in chunk.choices:
            got += ch.delta.content or ""
            reason = ch.finish_reason or reason
    assert got == expected and reason == "stop", (stop, got, expected)
    comp = client.completions.create(model=MODEL, prompt=_chat_ids(tok, HAIKU), max_tokens=40, temperature=0,
                                     stop=stop)
    assert comp.choices[0].text == expected and comp.choices[0].finish_reason == "stop"


def test_logprobs_equal_log_softmax_of_the_reference(client: Any, reference: Any) -> None:
    model, tok = reference
    ids = _chat_ids(tok, "What is the capital of France?")
    want, ref_lp = _greedy(model, ids, 8)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in want]
    for pos, t in enumerate(want):
        assert lp.token_logprobs[pos] == pytest.approx(ref_lp[pos, t].item(), abs=2e-3)
        top_ids = ref_lp[pos].topk(3).indices.tolist()
        assert list(lp.top_logprobs[pos].values()) == pytest.approx(ref_lp[pos, top_ids].tolist(), abs=2e-3)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy took the top
        assert bytes(entry.bytes) == entry.token.encode()


def test_n_choices_are_seeded_and_reproducible(client: Any) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=11, n=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # seeds 11 and 12
    assert 2 <= first.usage.completion_tokens <= 24
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens


def test_penalties_and_min_tokens_are_accepted(client: Any) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes."}], max_tokens=12, temperature=0,
        presence_penalty=0.5, frequency_penalty=0.5, extra_body={"repetition_penalty": 1.2, "min_tokens": 10},
    )
    assert out.usage.completion_tokens >= 10  # eos could not end it before ten tokens


BAD = [
    (dict(max_tokens=-1), "max_tokens must be a positive integer"),
    (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
    (dict(n=17), "n must be an integer in [1, 16]"),
    (dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
    (dict(max_tokens=100_000), "max_tokens 100000 is above the limit"),
    (dict(extra_body={"min_tokens": 50}, max_tokens=5), "min_tokens (50) must not exceed max_tokens (5)"),
    (dict(logit_bias={"1": 5}), "logit_bias is not supported"),
]


@pytest.mark.parametrize(("kwargs", "needle"), BAD, ids=[n for _, n in BAD])
def test_bad_requests_get_400_and_the_server_keeps_serving(client: Any, kwargs: dict[str, Any],
                                                           needle: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs)
    assert e.value.status_code == 400 and needle in e.value.message
    assert e.value.body["type"] == "invalid_request_error"  # OpenAI's error shape: {"error": {...}}
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_disconnect_cancels_the_request_and_frees_its_kv_blocks(server: ServerProcess,
                                                                  http: httpx.Client) -> None:
    before = _wait_idle(http)
    cancelled = 'ppserve:request_success_total{finished_reason=cancelled}'
    body = {"model": MODEL, "prompt": "Count to one thousand:", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0}
    # Streaming: read a few events, then hang up (leaving the loop closes the response).
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for n, _line in enumerate(r.iter_lines()):
            if n >= 6:
                during = _metrics(http)
                break
    assert during["ppserve:num_requests_running{}"] == 1 and during["ppserve:kv_cache_usage_perc{}"] > 0
    after = _wait_idle(http, timeout=10)
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1
    # Not streaming: the client gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=body, timeout=httpx.Timeout(120, read=1.5))
    after2 = _wait_idle(http, timeout=10)
    assert after2[cancelled] == after[cancelled] + 1


def test_metrics_carry_the_serving_series_and_the_stage_gauges(client: Any, http: httpx.Client) -> None:
    client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, temperature=0)
    m = _metrics(http)
    for name in ("ppserve:num_requests_waiting{}", "ppserve:num_preemptions_total{}",
                 "ppserve:prompt_tokens_total{}", "ppserve:generation_tokens_total{}",
                 "ppserve:stage_busy_fraction{stage=0}", "ppserve:stage_bubble_fraction{stage=0}",
                 "ppserve:stage_starvation_fraction{stage=0}", "ppserve:mean_bubble_fraction{}",
                 "ppserve:pipeline_restarts_total{}"):
        assert name in m, name
    assert m["ppserve:generation_tokens_total{}"] >= 4
    assert m["ppserve:time_to_first_token_seconds_count{}"] >= 1
    assert m["ppserve:e2e_request_latency_seconds_count{}"] >= 1
    assert m["ppserve:inter_token_latency_seconds_count{}"] >= 3
    assert m["ppserve:microbatch_tokens_count{}"] >= 4
    assert m["ppserve:microbatch_compute_seconds_count{stage=0}"] >= 4
    assert m["ppserve:request_success_total{finished_reason=length}"] >= 1
    busy = m["ppserve:stage_busy_fraction{stage=0}"]
    assert 0 < busy <= 1 and 0 <= m["ppserve:stage_bubble_fraction{stage=0}"] <= 1
