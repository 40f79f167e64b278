"""Structured outputs and tool calls over the OpenAI-compatible HTTP API of a real `ppserve serve`
(default model, float32, in-process at pp=1 as in test_openai.py), driven by the official `openai`
client: every answer is checked against its constraint, every bad request is a 400 that leaves the
server serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_helpers import ServerProcess, running_server, set_args
from tests.structured_helpers import ASK, TOOL_TURNS, TOOLS

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("structured"), *set_args(
            "parallel.pipeline_parallel_size=1", "parallel.executor=inproc")) as proc:
        assert proc.http_url is not None, "".join(proc.lines)
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.http_url, api_key="none", max_retries=0, timeout=120)


def _chat(client: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", **kwargs)


def test_json_schema_response_format(client: Any):
    r = _chat(client, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=40,
              response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                      "strict": True}})
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_and_completions(client: Any):
    r = _chat(client, max_tokens=24, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # a whole object (one cut short by max_tokens is a prefix)
        assert isinstance(json.loads(text), dict)
    c = client.completions.create(model="SmolLM2-135M-Instruct", prompt="A person:", max_tokens=40,
                                  temperature=0, extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(c.choices[0].text), PERSON)


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"choice": ["sunny", "rainy"]}}, lambda t: t in ("sunny", "rainy")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, lambda t: len(t) == 8 and t[3] == "-"),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
])
def test_vllm_structured_outputs(client: Any, extra: dict[str, Any], check: Any):
    r = _chat(client, max_tokens=20, extra_body=extra)
    assert check(r.choices[0].message.content), r.choices[0].message.content


@pytest.mark.parametrize(("extra", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "unknown"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "not a valid JSON Schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "two kinds at once"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "does not compile"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "not a valid JSON Schema"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "two kinds"),
])
def test_bad_requests_are_400(client: Any, extra: dict[str, Any], message: str):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, max_tokens=5, extra_body=extra)
    assert e.value.status_code == 400 and message in str(e.value)


def test_the_server_serves_after_the_bad_requests(client: Any):
    r = _chat(client, max_tokens=2, extra_body={"guided_choice": ["Paris", "Rome"]})
    assert r.choices[0].message.content in ("Paris", "Rome")


def _check_call(call: Any, name: str | None = None) -> dict[str, Any]:
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
    assert name in (None, call.function.name)
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["parameters"])
    return dict(args)


@pytest.mark.parametrize(("tool_choice", "sampling"), [
    ("required", {"temperature": 0}),
    ({"type": "function", "function": {"name": "get_time"}}, {"temperature": 0}),
    ("required", {"temperature": 1, "seed": 7}),
    ({"type": "function", "function": {"name": "get_weather"}}, {"temperature": 1, "seed": 11}),
])
def test_forced_tool_calls(client: Any, tool_choice: Any, sampling: dict[str, Any]):
    r = _chat(client, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=80,
              **sampling)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    assert len(calls) == 1
    _check_call(calls[0], name)


def test_required_with_parallel_calls_is_only_calls(client: Any):
    """parallel_tool_calls (the default): one or more calls and nothing else, so the answer ends with its
    calls (a model that repeats itself may still run into max_tokens: then the calls so far are cut)."""
    r = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    choice = r.choices[0]
    assert choice.message.content is None
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call, None)
    else:
        assert choice.finish_reason == "length"


def test_streamed_tool_call_reassembles_to_the_same_call(client: Any):
    kwargs = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 80}
    whole = _chat(client, **kwargs).choices[0].message.tool_calls
    calls: dict[int, dict[str, str]] = {}
    content, reasons = "", []
    for chunk in _chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            delta = c.delta
            content += delta.content or ""
            for tc in delta.tool_calls or ():
                if tc.id is not None:
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == ["tool_calls"] and "<tool_call>" not in content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (w.function.name, w.function.arguments) for w in whole]


def test_multi_turn_with_a_tool_result(client: Any):
    messages = TOOL_TURNS
    r = _chat(client, messages=messages, tools=TOOLS, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools and the turns reached the prompt
    for call in r.choices[0].message.tool_calls or ():
        _check_call(call)
    none = _chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=10)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
