"""Tool calling through gRPC on the real engine (the default model, float32, in-process stages at pp=1):
forced calls finish with FINISH_REASON_TOOL_CALLS and arguments that validate against their tool's
parameters, a conversation with an assistant tool-call turn and a tool turn renders and completes, and
every bad tool input is INVALID_ARGUMENT with the HTTP API's message, after which the server still serves.

One server serves the whole module; the tools are test_structured_http.py's (structured_helpers.py), so
both front doors are asked the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest

from ppserve.server.client import Completion, PPServeClient
from ppserve.server.gen import ppserve_pb2 as pb
from tests.structured_helpers import ASK, TOOL_TURNS, TOOLS, WEATHER_PARAMS, grpc_client


@pytest.fixture(scope="module")
def client(default_model_dir: Path) -> Iterator[PPServeClient]:
    with grpc_client([f"model.model={default_model_dir}", "model.dtype=float32",
                      "parallel.pipeline_parallel_size=1", "parallel.executor=inproc"]) as c:
        yield c


def _check_call(call: dict[str, Any], name: str | None = None) -> None:
    tool = {t["function"]["name"]: t["function"] for t in TOOLS}[call["function"]["name"]]
    assert name in (None, call["function"]["name"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), tool["parameters"])


def _forced(out: Completion, name: str | None) -> None:
    assert out.finish_reason == "tool_calls", out
    assert len(out.tool_calls) == 1 and out.content is None, out
    _check_call(out.tool_calls[0], name)
    assert "<tool_call>" in out.text  # the raw text streams as generated; the calls come parsed at the end


@pytest.mark.parametrize(("tool_choice", "name"), [
    ("required", None),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
], ids=["required", "named"])
def test_forced_tool_calls(client: PPServeClient, tool_choice: Any, name: str | None) -> None:
    out = client.generate(messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                          max_tokens=80, temperature=0, timeout=120)
    _forced(out, name)


def test_each_choice_is_read_for_its_calls(client: PPServeClient) -> None:
    outs = client.generate_choices(messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=80, temperature=1, seed=7, n=2,
                                   timeout=120)
    assert [o.index for o in outs] == [0, 1]
    for out in outs:
        _forced(out, None)


def test_multi_turn_with_a_tool_result(client: PPServeClient) -> None:
    messages = TOOL_TURNS
    first = client.generate(messages=ASK, tools=TOOLS, max_tokens=1, timeout=120)
    out = client.generate(messages=messages, tools=TOOLS, max_tokens=30, temperature=0, timeout=120)
    assert out.finish_reason in ("stop", "length", "tool_calls"), out
    assert out.num_prompt_tokens > first.num_prompt_tokens + 40  # the call and its result reached the prompt
    for call in out.tool_calls:
        _check_call(call)
    if not out.tool_calls:
        assert out.content == out.text  # read for calls, none found: the content is the whole text
    none = client.generate(messages=messages, tools=TOOLS, tool_choice="none", max_tokens=10, timeout=120)
    assert none.tool_calls == [] and none.content is None and none.finish_reason in ("stop", "length")


def _wire(**fields: Any) -> pb.GenerateRequest:
    """A request built by hand, as a client of another language would send it."""
    fields.setdefault("messages", [pb.ChatMessage(role="user", content="What is the weather in Paris?")])
    fields.setdefault("sampling", pb.SamplingParams(max_tokens=4))
    return pb.GenerateRequest(**fields)


def _tool(name: str, params: Any = None) -> pb.Tool:
    return pb.Tool(name=name, parameters_json="" if params is None else json.dumps(params))


@pytest.mark.parametrize(("req", "message"), [
    (_wire(tools=[_tool("get_weather", WEATHER_PARAMS)], tool_choice="function:nope"),
     "tool_choice names the function 'nope', which is not among the tools (get_weather)"),
    (_wire(tool_choice="required"), 'tool_choice "required" needs tools'),
    (_wire(tools=[_tool("f"), _tool("f")]), "tools[1].function.name 'f' is given twice"),
    (_wire(tools=[_tool("f", {"type": "nope"})]), "tools[0].function.parameters is not a valid JSON Schema"),
    (_wire(tools=[pb.Tool(name="f", parameters_json="{nope")]), "tools[0].parameters_json is not valid JSON"),
    (_wire(tools=[_tool("f")], tool_choice="sometimes"), "tool_choice 'sometimes' is unknown"),
    (_wire(messages=[], prompt="hi", tools=[_tool("f")]), "tools go with chat messages"),
    (_wire(tools=[_tool("f")], tool_choice="required", sampling=pb.SamplingParams(
        max_tokens=4, structured_outputs=pb.StructuredOutputs(json_object=True))),
     "two kinds at once"),
    (_wire(messages=[pb.ChatMessage(role="tool", content="sunny")]), "a tool message needs tool_call_id"),
], ids=["unknown-function", "required-without-tools", "duplicate-names", "parameters-not-a-schema",
        "parameters-not-json", "unknown-choice", "tools-with-a-text-prompt", "forced-and-structured",
        "tool-turn-without-id"])
def test_bad_tool_input_is_invalid_argument(client: PPServeClient, req: pb.GenerateRequest,
                                            message: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert message in (err.value.details() or ""), err.value.details()


def test_the_server_serves_after_the_bad_inputs(client: PPServeClient) -> None:
    out = client.generate(messages=ASK, tools=TOOLS, max_tokens=2, temperature=0, timeout=120)
    assert out.finish_reason == "length" and len(out.token_ids) == 2 and out.content == out.text
