"""The HTTP request bodies' structured outputs and tools: each way of asking becomes one
StructuredOutputs, and every malformed or conflicting one is a ValueError (the API's 400)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ppserve.engine.messages import ChatTurn
from ppserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from ppserve.structured.spec import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputs(choice=("yes", "no"))),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"guided_regex": "a+"}, StructuredOutputs(regex="a+")),
    ({"guided_choice": ["x"]}, StructuredOutputs(choice=("x",))),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputs(grammar='root ::= "x"')),
])
def test_each_way_gives_one_constraint(fields: dict[str, Any], expected: StructuredOutputs | None):
    assert chat(**fields).structured() == expected
    assert CompletionRequest.model_validate({"prompt": "x", **fields}).structured() == expected


@pytest.mark.parametrize(("fields", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type 'yaml' is unknown"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     "not a valid JSON Schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": 3}}}},
     "guided_json schema is not a valid"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "two kinds at once"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"colour": "red"}}, "unknown field"),
    ({"guided_choice": []}, "choice is empty"),
])
def test_bad_structured_outputs_are_value_errors(fields: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        chat(**fields).structured()


def test_tool_plans():
    plan = chat(tools=[WEATHER]).tool_plan()
    assert plan.choice.mode == "auto" and plan.constraint is not None
    assert json.loads(plan.tools or "")[0]["function"]["name"] == "get_weather"
    required = chat(tools=[WEATHER], tool_choice="required").tool_plan()
    assert required.constraint is not None and required.constraint.structural_tag is not None
    none = chat(tools=[WEATHER], tool_choice="none").tool_plan()
    assert none.constraint is None and none.tools is not None and not none.choice.parses
    assert chat().tool_plan().tools is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not among"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "gives no tools"),
    ({"tools": [WEATHER, WEATHER]}, "given twice"),
    ({"tools": [{"type": "code_interpreter"}]}, "only \"function\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "not a valid JSON Schema"),
])
def test_bad_tools_are_value_errors(fields: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        chat(**fields).tool_plan()


def test_forced_calls_and_another_constraint_conflict():
    body = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(ValueError, match="two kinds at once"):
        body.constraint(body.tool_plan())
    auto = chat(tools=[WEATHER], response_format={"type": "json_object"})
    assert auto.constraint(auto.tool_plan()) == StructuredOutputs(json_object=True)


def test_tool_turns_become_chat_turns():
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    turns = body.conversation()
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool"]
    assert turns[1].content == "weather?" and turns[2].content is None
    assert turns[2].tool_calls[0].arguments == '{"city": "P"}'
    assert turns[3] == ChatTurn("tool", "sunny", tool_call_id="c1")
    with pytest.raises(ValueError, match="needs tool_call_id"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "x"}]}).conversation()


def test_completions_refuse_tools():
    with pytest.raises(ValueError, match="chat/completions only"):
        CompletionRequest.model_validate({"prompt": "x", "tools": [WEATHER]}).refuse_unsupported()
