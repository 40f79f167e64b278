"""Tool lists and tool_choice checked, the structural tag that constrains calls, the chat turns that
carry them and ppserve's Hermes chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppserve.engine.messages import ChatTurn, PromptInput, ToolCall
from ppserve.structured.spec import GrammarError, StructuredOutputs
from ppserve.structured.tool_parser import parse_tool_calls
from ppserve.structured.tools import (
    ToolChoice,
    check_json_schema,
    hermes_template,
    normalize_tools,
    resolve_tool_choice,
    tool_call_tag,
    tools_json,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}


def test_tools_are_filled_in():
    tools = normalize_tools([WEATHER, NOW])
    assert tools[0] == WEATHER
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(("tools", "message"), [
    ([WEATHER, WEATHER], "given twice"),
    ([{"type": "retrieval", "function": {"name": "x"}}], "only \"function\""),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "foo"}}}],
     "not a valid JSON Schema"),
    ([{"type": "function", "function": {"name": "x", "parameters": [1]}}], "must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "function.name"),
    ([{"type": "function"}], "function must be an object"),
])
def test_bad_tools_are_refused(tools: list, message: str):
    with pytest.raises(GrammarError, match=message):
        normalize_tools(tools)


def test_tool_choice_resolves():
    tools = normalize_tools([WEATHER])
    assert resolve_tool_choice(None, tools) == ToolChoice("auto")
    assert resolve_tool_choice(None, []) == ToolChoice("none")
    assert resolve_tool_choice("none", tools) == ToolChoice("none")
    assert resolve_tool_choice("required", tools) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert resolve_tool_choice(named, tools) == ToolChoice("function", "get_weather")


@pytest.mark.parametrize(("choice", "tools", "message"), [
    ({"type": "function", "function": {"name": "nope"}}, [WEATHER], "not among the tools"),
    ({"type": "function", "function": {"name": "get_weather"}}, [], "gives no tools"),
    ("required", [], "needs tools"),
    ("sometimes", [WEATHER], "is unknown"),
    ({"type": "other"}, [WEATHER], "tool_choice must be"),
])
def test_bad_tool_choice_is_refused(choice: object, tools: list, message: str):
    with pytest.raises(GrammarError, match=message):
        resolve_tool_choice(choice, normalize_tools(tools))


def test_structural_tags_per_choice():
    tools = normalize_tools([WEATHER, NOW])
    assert tool_call_tag(tools, ToolChoice("none")) is None
    required = json.loads(tool_call_tag(tools, ToolChoice("required")) or "")["format"]
    # calls only, one per line: no free text before, between or after them
    assert required["type"] == "tags_with_separator" and required["at_least_one"] is True
    assert required["separator"] == "\n" and required["stop_after_first"] is False
    assert required["tags"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert required["tags"][0]["end"] == "}\n</tool_call>"
    assert required["tags"][0]["content"]["json_schema"] == WEATHER["function"]["parameters"]
    auto = json.loads(tool_call_tag(tools, ToolChoice("auto")) or "")["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"]
    assert auto["at_least_one"] is False
    named = json.loads(tool_call_tag(tools, ToolChoice("function", "now")) or "")["format"]
    assert named["type"] == "tag" and '"now"' in named["begin"]
    one = json.loads(tool_call_tag(tools, ToolChoice("required"), parallel_tool_calls=False) or "")["format"]
    assert one["stop_after_first"] is True
    StructuredOutputs(structural_tag=tool_call_tag(tools, ToolChoice("required")))  # a valid spec


def test_schema_check():
    check_json_schema({"type": "object"}, "s")
    check_json_schema(True, "s")
    with pytest.raises(GrammarError, match="at properties/a/type"):
        check_json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}, "s")


def test_prompt_input_carries_turns_and_tools():
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    turns = (("user", "weather?"), ChatTurn("assistant", None, (call,)),
             ChatTurn("tool", "sunny", tool_call_id="c1"))
    p = PromptInput(messages=turns, tools=tools_json(normalize_tools([WEATHER])))
    assert hash(p) == hash(PromptInput(messages=turns, tools=p.tools))
    assert turns[1].as_dict()["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert ChatTurn.from_dict({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]}) == turns[1]
    with pytest.raises(ValueError, match="tools go with chat messages"):
        PromptInput(text="x", tools="[]")
    with pytest.raises(ValueError, match="role 'wizard'"):
        PromptInput(messages=(ChatTurn("wizard", "x"),))


def test_hermes_template_round_trips_a_call(default_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    msgs = [ChatTurn("system", "Be brief.").as_dict(), {"role": "user", "content": "weather?"},
            ChatTurn("assistant", None, (call,)).as_dict(),
            ChatTurn("tool", "sunny", tool_call_id="c1").as_dict()]
    text = tok.apply_chat_template(msgs, tools=normalize_tools([WEATHER]), chat_template=hermes_template(),
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn)  # what the template writes is what the parser reads
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
