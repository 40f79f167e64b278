"""SamplingParams.structured_outputs to and from the wire (ppserve.server.convert): every kind round-trips,
a malformed constraint is the spec's GrammarError (INVALID_ARGUMENT), and a non-UTF-8 constraint string
is named by the malformed-message walker."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from ppserve.request import SamplingParams
from ppserve.server import convert
from ppserve.server.gen import ppserve_pb2 as pb
from ppserve.structured.spec import GrammarError, StructuredOutputs


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}},
        {"json": True},
        {"json_object": True},
        {"regex": r"[a-z]+\d"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a" | "b"'},
        {"structural_tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}},
    ],
    ids=lambda s: next(iter(s)),
)
def test_every_kind_round_trips(spec: dict[str, Any]) -> None:
    sp = SamplingParams(max_tokens=5, structured_outputs=spec)
    msg = convert.sampling_to_proto(sp)
    assert msg.HasField("structured_outputs")
    back = convert.sampling_from_proto(pb.SamplingParams.FromString(msg.SerializeToString()))
    assert back == sp
    assert back.structured_outputs is not None and back.structured_outputs.to_dict() == spec


def test_wire_names() -> None:
    """The oneof names: json_schema carries the schema as JSON text (key order kept), choice a list."""
    so = convert.structured_to_proto(StructuredOutputs(json={"type": "object", "z": 1, "a": 2}))
    assert so.WhichOneof("kind") == "json_schema" and so.json_schema == '{"type":"object","z":1,"a":2}'
    so = convert.structured_to_proto(StructuredOutputs(choice=("a", "b")))
    assert so.WhichOneof("kind") == "choice" and list(so.choice.choices) == ["a", "b"]
    got = convert.structured_from_proto(pb.StructuredOutputs(json_schema='{"type": "string"}'))
    assert got == StructuredOutputs(json={"type": "string"})


def test_unset_means_unconstrained() -> None:
    assert convert.sampling_from_proto(pb.SamplingParams()).structured_outputs is None
    assert not convert.sampling_to_proto(SamplingParams()).HasField("structured_outputs")


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (pb.StructuredOutputs(), "takes exactly one of"),
        (pb.StructuredOutputs(json_object=False), "takes exactly one of"),
        (pb.StructuredOutputs(choice=pb.ChoiceList()), "structured_outputs.choice is empty"),
        (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["a", ""])), "holds non-empty strings"),
        (pb.StructuredOutputs(json_schema="{not json"), "structured_outputs.json is not valid JSON"),
        (pb.StructuredOutputs(json_schema="[1]"), "a JSON schema is an object"),
        (pb.StructuredOutputs(json_schema=""), "structured_outputs.json is not valid JSON"),
        (pb.StructuredOutputs(regex=""), "structured_outputs.regex must be a non-empty string"),
        (pb.StructuredOutputs(structural_tag="nope"), "structured_outputs.structural_tag is not valid JSON"),
    ],
    ids=["none", "json-object-false", "empty-choice", "empty-choice-string", "schema-not-json",
         "schema-not-object", "schema-empty", "regex-empty", "tag-not-json"],
)
def test_bad_constraint_is_the_specs_error(so: pb.StructuredOutputs, message: str) -> None:
    with pytest.raises(GrammarError, match=message) as err:
        convert.sampling_from_proto(pb.SamplingParams(structured_outputs=so))
    assert convert.error_to_status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, str(err.value))
    # The same message as the dict form the HTTP API hands StructuredOutputs.from_dict.
    kind = so.WhichOneof("kind")
    if kind is not None:
        value: Any = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
        with pytest.raises(GrammarError) as http:
            StructuredOutputs.from_dict({"json" if kind == "json_schema" else kind: value})
        assert str(http.value) == str(err.value)


def test_constraint_conflicts_are_sampling_errors() -> None:
    so = pb.StructuredOutputs(regex="a+")
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):
        convert.sampling_from_proto(pb.SamplingParams(ignore_eos=True, structured_outputs=so))
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        convert.sampling_from_proto(pb.SamplingParams(min_tokens=2, structured_outputs=so))


def test_client_request_carries_the_constraint() -> None:
    req = convert.generate_request_to_proto("hi", SamplingParams(structured_outputs={"choice": ["x"]}))
    assert list(req.sampling.structured_outputs.choice.choices) == ["x"]


@pytest.mark.parametrize(
    ("so", "named"),
    [
        (pb.StructuredOutputs(regex="QQ"), "sampling.structured_outputs.regex"),
        (pb.StructuredOutputs(json_schema='"QQ"'), "sampling.structured_outputs.json_schema"),
        (pb.StructuredOutputs(grammar="QQ"), "sampling.structured_outputs.grammar"),
        (pb.StructuredOutputs(structural_tag='"QQ"'), "sampling.structured_outputs.structural_tag"),
        (pb.StructuredOutputs(choice=pb.ChoiceList(choices=["ok", "QQ"])),
         "sampling.structured_outputs.choice.choices"),
    ],
    ids=["regex", "json_schema", "grammar", "structural_tag", "choice"],
)
def test_non_utf8_constraint_is_named(so: pb.StructuredOutputs, named: str) -> None:
    req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(structured_outputs=so))
    data = req.SerializeToString().replace(b"QQ", b"\xff\xfe")  # same length: the framing stays valid
    got = convert.generate_request_deserializer(1 << 20)(data)
    assert got == convert.MalformedRequest(f"{named} is not valid UTF-8")


def test_python_client_takes_the_constraint_as_a_keyword() -> None:
    from ppserve.server.client import _request

    req = _request("hi", None, None, "", max_tokens=4, structured_outputs={"regex": "a+"})
    assert req.sampling.structured_outputs.regex == "a+" and req.sampling.max_tokens == 4
    # Over a given SamplingParams: its other fields kept, the keyword's added.
    req = _request("hi", None, SamplingParams(max_tokens=7), "",
                   structured_outputs=StructuredOutputs(choice=("x", "y")))
    assert list(req.sampling.structured_outputs.choice.choices) == ["x", "y"] and req.sampling.max_tokens == 7
    with pytest.raises(GrammarError, match="choice is empty"):
        _request("hi", None, None, "", structured_outputs={"choice": []})


# ---- tool calling ------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "weather?"}]
TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "sys"},
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "user", "content": "thanks", "name": "ann"},
]


def _http(**fields: Any) -> Any:
    from ppserve.server.openai_protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def _grpc(**kwargs: Any) -> pb.GenerateRequest:
    """A request built by the Python client's conversion (which checks nothing itself)."""
    kwargs.setdefault("messages", USER)
    return convert.generate_request_to_proto(**kwargs)


@pytest.mark.parametrize(("wire", "openai"), [
    ("", None), ("none", "none"), ("auto", "auto"), ("required", "required"),
    ("function:get_time", {"type": "function", "function": {"name": "get_time"}}),
])
def test_tool_choice_encodings(wire: str, openai: Any) -> None:
    assert convert.tool_choice_to_proto(openai) == wire
    assert convert.tool_choice_from_proto(wire) == openai


@pytest.mark.parametrize("fields", [
    {"tools": [WEATHER, TIME]},
    {"tools": [WEATHER, TIME], "tool_choice": "required"},
    {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [WEATHER], "tool_choice": "none"},
    {"tool_choice": "auto"},
    {},
], ids=["auto", "required", "required-single", "named", "none", "auto-without-tools", "no-tools"])
def test_tool_plan_is_the_http_apis(fields: dict[str, Any]) -> None:
    """The same tools, choice and parallel_tool_calls give the same plan (prompt tools, choice and
    structural tag) over the wire as in an HTTP body; parallel_tool_calls unset is true on both."""
    req = pb.GenerateRequest.FromString(_grpc(**fields).SerializeToString())
    assert req.HasField("parallel_tool_calls") == ("parallel_tool_calls" in fields)
    assert convert.tool_plan_from_proto(req) == _http(**fields).tool_plan()


BAD_TOOLS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "gives no tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "not a valid JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "function.name must be"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_TOOLS,
                         ids=["unknown-function", "named-without-tools", "required-without-tools",
                              "duplicate-names", "parameters-not-a-schema", "bad-name"])
def test_bad_tools_have_the_http_apis_messages(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(GrammarError, match=message) as err:
        convert.tool_plan_from_proto(_grpc(**fields))
    assert convert.error_to_status(err.value) == (grpc.StatusCode.INVALID_ARGUMENT, str(err.value))
    with pytest.raises(GrammarError) as http:
        _http(**fields).tool_plan()
    assert str(http.value) == str(err.value)


def test_wire_only_tool_errors() -> None:
    """What only the wire can get wrong: a choice string of neither form, parameters that are not JSON."""
    with pytest.raises(GrammarError, match=r"tool_choice 'sometimes' is unknown; .* or function:NAME"):
        convert.tool_plan_from_proto(pb.GenerateRequest(tool_choice="sometimes"))
    req = pb.GenerateRequest(tools=[pb.Tool(name="f", parameters_json="{nope")])
    with pytest.raises(GrammarError, match=r"tools\[0\].parameters_json is not valid JSON"):
        convert.tool_plan_from_proto(req)


def test_tool_constraint_joins_the_structured_output_by_the_http_rule() -> None:
    so = pb.StructuredOutputs(json_object=True)
    forced = _grpc(tools=[WEATHER], tool_choice="required")
    with pytest.raises(GrammarError, match="two kinds at once") as err:
        convert.sampling_from_proto(pb.SamplingParams(structured_outputs=so), None,
                                    convert.tool_plan_from_proto(forced))
    with pytest.raises(GrammarError) as http:
        body = _http(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
        body.constraint(body.tool_plan())
    assert str(http.value) == str(err.value)
    auto = convert.tool_plan_from_proto(_grpc(tools=[WEATHER]))
    sp = convert.sampling_from_proto(pb.SamplingParams(structured_outputs=so), None, auto)
    assert sp.structured_outputs == StructuredOutputs(json_object=True)  # an explicit one wins under auto
    sp = convert.sampling_from_proto(pb.SamplingParams(), None, auto)
    assert sp.structured_outputs == auto.constraint and auto.constraint is not None
    with pytest.raises(ValueError, match="ignore_eos cannot be combined"):  # still validated
        convert.sampling_from_proto(pb.SamplingParams(ignore_eos=True), None, auto)


def test_tool_turns_are_the_http_apis() -> None:
    """Messages with tool fields become the same ChatTurns as an HTTP body's; plain ones stay pairs."""
    req = pb.GenerateRequest.FromString(_grpc(messages=TURNS, tools=[WEATHER]).SerializeToString())
    assert req.messages[2].content == "" and req.messages[2].tool_calls[0].arguments == '{"city": "P"}'
    plan = convert.tool_plan_from_proto(req)
    prompt = convert.prompt_from_proto(req, None, plan.tools)
    assert prompt.tools == plan.tools and prompt.messages is not None
    body = _http(messages=TURNS, tools=[WEATHER])
    assert prompt.messages[0] == ("system", "sys") and prompt.messages[1] == ("user", "weather?")
    assert prompt.messages[2:] == body.conversation()[2:]
    assert prompt.messages[2].content is None  # type: ignore[union-attr]  # calls and empty content: null


def test_client_takes_openai_call_dicts() -> None:
    """Arguments given as an object go as JSON text; a missing id is filled as ChatTurn.from_dict does."""
    msg = {"role": "assistant", "content": "",
           "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    req = _grpc(messages=[*USER, msg])
    assert [(c.id, c.name, c.arguments) for c in req.messages[1].tool_calls] == [("call_0", "f", '{"a": 1}')]


@pytest.mark.parametrize(("messages", "message"), [
    ([{"role": "tool", "content": "sunny"}], "a tool message needs tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
     "tool_calls belong to assistant messages, not 'user' ones"),
], ids=["tool-without-id", "calls-on-a-user-turn"])
def test_bad_tool_turns_have_the_http_apis_messages(messages: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        convert.prompt_from_proto(_grpc(messages=messages))
    with pytest.raises(ValueError) as http:
        _http(messages=messages).conversation()
    assert str(http.value) == str(err.value)


def test_tools_need_messages() -> None:
    plan = convert.tool_plan_from_proto(_grpc(tools=[WEATHER]))
    for req in (pb.GenerateRequest(prompt="hi"), pb.GenerateRequest(prompt_token_ids=[1, 2])):
        with pytest.raises(ValueError, match="tools go with chat messages"):
            convert.prompt_from_proto(req, None, plan.tools)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "reason", "expected", "content", "calls"), [
    (CALL, pb.FINISH_REASON_STOP, "tool_calls", None, 1),
    (f"Let me look.\n{CALL}\n{CALL}", pb.FINISH_REASON_STOP, "tool_calls", "Let me look.", 2),
    (CALL[:-3], pb.FINISH_REASON_LENGTH, "length", None, 1),  # cut short: the call so far, still length
    ("no calls", pb.FINISH_REASON_STOP, "stop", "no calls", 0),
    ("", pb.FINISH_REASON_CANCELLED, "cancelled", "", 0),
], ids=["one-call", "content-and-two-calls", "cut-by-length", "no-calls", "cancelled"])
def test_response_tool_calls(text: str, reason: pb.FinishReason, expected: str, content: str | None,
                             calls: int) -> None:
    from ppserve.server.client import Chunk

    msg = pb.GenerateResponse(text=text, finish_reason=reason)
    convert.add_tool_calls(msg, text)
    chunk = Chunk.from_proto(pb.GenerateResponse.FromString(msg.SerializeToString()))
    assert chunk.finish_reason == expected and chunk.content == content and len(chunk.tool_calls) == calls
    for call in chunk.tool_calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] == "get_weather"
    if reason == pb.FINISH_REASON_STOP and calls:
        assert [c["function"]["arguments"] for c in chunk.tool_calls] == ['{"city": "P"}'] * calls


def test_untouched_response_has_no_tool_fields() -> None:
    out = convert.chunk_from_proto(pb.GenerateResponse(text="x", finish_reason=pb.FINISH_REASON_STOP))
    assert out["tool_calls"] == [] and out["content"] is None and out["finish_reason"] == "stop"
    assert convert.finish_reason_to_proto("tool_calls") == pb.FINISH_REASON_TOOL_CALLS


@pytest.mark.parametrize(("req", "named"), [
    (pb.GenerateRequest(tools=[pb.Tool(name="f", parameters_json='"QQ"')]), "tools[0].parameters_json"),
    (pb.GenerateRequest(tools=[pb.Tool(name="f"), pb.Tool(name="QQ")]), "tools[1].name"),
    (pb.GenerateRequest(tool_choice="function:QQ"), "tool_choice"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="user"), pb.ChatMessage(
        role="assistant", tool_calls=[pb.ToolCall(name="f"), pb.ToolCall(name="f", arguments='"QQ"')])]),
     "messages[1].tool_calls[1].arguments"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="tool", tool_call_id="QQ")]),
     "messages[0].tool_call_id"),
], ids=["parameters", "tool-name", "tool-choice", "call-arguments", "tool-call-id"])
def test_non_utf8_tool_field_is_named(req: pb.GenerateRequest, named: str) -> None:
    data = req.SerializeToString().replace(b"QQ", b"\xff\xfe")
    assert convert.generate_request_deserializer(1 << 20)(data) == convert.MalformedRequest(
        f"{named} is not valid UTF-8")
