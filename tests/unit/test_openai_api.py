"""The OpenAI-compatible front door over a fake engine (no model, no Ray, no sockets): request and
response shapes, server-sent events, and every error status in OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from ppserve.engine.async_engine import AsyncEngine
from ppserve.server.openai_api import build_app
from tests.fake_engine import FakeEngine

MODEL = "tiny"


def _run(fake: FakeEngine, body: Callable[[httpx.AsyncClient], Awaitable[Any]], *, token: str | None = None,
         start: bool = True) -> Any:
    async def main() -> Any:
        engine = AsyncEngine(fake)
        if start:
            engine.start(asyncio.get_running_loop())
        app = build_app(engine, model_name=MODEL, token=token)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test") as client:
                return await body(client)
        finally:
            if start:
                await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    return asyncio.run(main())


def _events(text: str) -> list[Any]:
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _assert_error(r: httpx.Response, status: int, kind: str, needle: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == kind and needle in err["message"], err


def test_completion_whole_and_n() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions",
                         json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "n": 2})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "text_completion" and out["model"] == MODEL
        assert [ch["index"] for ch in out["choices"]] == [0, 1]
        assert all(ch["text"] == "aaa" and ch["finish_reason"] == "length" for ch in out["choices"])
        assert out["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        # A batch of prompts: choices numbered prompt-major.
        r = await c.post("/v1/completions", json={"prompt": [[1], [2, 3]], "max_tokens": 1, "n": 2})
        assert [ch["index"] for ch in r.json()["choices"]] == [0, 1, 2, 3]
        assert r.json()["usage"]["prompt_tokens"] == 3

    _run(FakeEngine(max_waiting=8), body)


def test_completion_stream_events_and_usage() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        usage = events[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
        chunks = events[:-2]
        assert "".join(e["choices"][0]["text"] for e in chunks) == "aaa"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(e["object"] == "text_completion" and e["id"] == chunks[0]["id"] for e in chunks)

    _run(FakeEngine(), body)


def test_chat_stream_starts_with_the_role() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        # The fake engine has no tokenizer: it takes any prompt, so chat messages go through to it.
        r = await c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True})
        assert r.status_code == 200, r.text
        events = _events(r.text)
        assert events[0]["object"] == "chat.completion.chunk"
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1]) == "aa"
        assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"

    _run(FakeEngine(), body)


BAD_BODIES = [
    ({"prompt": [1], "max_tokens": -1}, "max_tokens must be a positive integer"),
    ({"prompt": [1], "temperature": -1}, "temperature must be"),
    ({"prompt": [1], "top_p": 0}, "top_p"),
    ({"prompt": [1], "n": 99}, "n must be an integer in [1, 16]"),
    ({"prompt": [1], "logprobs": 50}, "logprobs must be an integer in [0, 20]"),
    ({"prompt": [1], "presence_penalty": 5}, "presence_penalty must be in [-2, 2]"),
    ({"prompt": [1], "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": [1], "echo": True}, "echo is not supported"),
    ({"prompt": [1], "best_of": 3}, "best_of is not supported"),
    ({"prompt": [1], "stream_options": {"include_usage": True}}, "stream_options is only allowed"),
    ({"prompt": [1], "temperature": "hot"}, "temperature"),
    ({"max_tokens": 3}, "prompt: Field required"),
    ({"prompt": []}, "prompt is empty"),
]


@pytest.mark.parametrize(("payload", "needle"), BAD_BODIES, ids=[n for _, n in BAD_BODIES])
def test_bad_completion_requests_get_400_and_lose_nothing(payload: dict[str, Any], needle: str) -> None:
    async def body(c: httpx.AsyncClient) -> None:
        _assert_error(await c.post("/v1/completions", json=payload), 400, "invalid_request_error", needle)
        ok = await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert ok.status_code == 200

    _run(FakeEngine(), body)


def test_bad_chat_and_malformed_bodies() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": []})
        _assert_error(r, 400, "invalid_request_error", "messages is empty")
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]})
        _assert_error(r, 400, "invalid_request_error", "messages.0.role")
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
        _assert_error(r, 400, "invalid_request_error", "a tool message needs tool_call_id")
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2})
        _assert_error(r, 400, "invalid_request_error", "top_logprobs needs logprobs")
        r = await c.post("/v1/completions", content=b"{not json",
                         headers={"content-type": "application/json"})
        _assert_error(r, 400, "invalid_request_error", "JSON")
        r = await c.post("/v1/completions", json={"model": "other", "prompt": [1]})
        _assert_error(r, 404, "invalid_request_error", "does not exist")

    _run(FakeEngine(), body)


def test_queue_full_is_429() -> None:
    fake = FakeEngine(max_waiting=1)
    fake.paused = True  # nothing runs: the queue stays full
    fake.left["someone-else"] = 5

    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        _assert_error(r, 429, "rate_limit_error", "waiting queue is full")

    _run(fake, body)


def test_engine_not_running_is_503() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        _assert_error(r, 503, "service_unavailable_error", "not running")
        _assert_error(await c.get("/health"), 503, "service_unavailable_error", "not running")

    _run(FakeEngine(), body, start=False)


def test_bearer_token_guards_everything_but_health() -> None:
    async def body(c: httpx.AsyncClient) -> None:
        for path in ("/v1/models", "/metrics"):
            _assert_error(await c.get(path), 401, "authentication_error", "bearer token")
            _assert_error(await c.get(path, headers={"Authorization": "Bearer wrong"}), 401,
                          "authentication_error", "bearer token")
        r = await c.post("/v1/completions", json={"prompt": []})  # refused before the body is looked at
        assert r.status_code == 401
        assert (await c.get("/health")).status_code == 200
        ok = await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL

    _run(FakeEngine(), body, token="sekrit")
