"""The Hermes tool-call parser: whole outputs, and streams cut at every place giving the same answer."""

from __future__ import annotations

import json
import random

import pytest

from ppserve.structured.tool_parser import ToolCallParser, parse_tool_calls

TWO_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": {"a": "Pa}ris"}}}\n'
             '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n')


def _stream(pieces: list[str]) -> tuple[str, dict[int, dict[str, str]]]:
    """Content and calls reassembled from the parser's deltas, as an OpenAI client does."""
    p = ToolCallParser()
    content, calls = "", {}
    for piece in [*pieces, None]:
        got = p.feed(piece) if piece is not None else p.finish()
        assert "<tool" not in got.content and "</tool" not in got.content
        content += got.content
        for c in got.tool_calls:
            if "id" in c:
                assert c["index"] not in calls and c["type"] == "function" and c["id"].startswith("call_")
                assert c["function"]["arguments"] == ""
                calls[c["index"]] = {"name": c["function"]["name"], "arguments": ""}
            calls[c["index"]]["arguments"] += c["function"]["arguments"]
    return content, calls


def test_whole_output_gives_calls_and_content():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": {"a": "Pa}ris"}}),
                                                                  ("now", {})]
    assert calls[0].id != calls[1].id
    assert calls[0].as_openai()["function"] == {"name": "get_weather", "arguments": calls[0].arguments}


def test_only_calls_means_null_content():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content is None and calls[0].arguments == '{"x": 1}'


def test_no_calls_leaves_text_alone():
    assert parse_tool_calls("hello <tool") == ("hello <tool", [])
    assert parse_tool_calls("") == ("", [])


def test_a_tag_without_a_call_is_content():
    content, calls = parse_tool_calls("a <tool_call> not json </tool_call> b")
    assert calls == [] and content == "a <tool_call> not json </tool_call> b"


def test_keys_in_the_other_order():
    content, calls = parse_tool_calls('<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>')
    assert content is None and calls[0].name == "g" and json.loads(calls[0].arguments) == {"x": 1}


def test_a_call_cut_short_keeps_its_arguments_so_far():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"x": 1')
    assert calls[0].name == "f" and calls[0].arguments == '{"x": 1'


@pytest.mark.parametrize("seed", range(40))
def test_streaming_matches_the_whole_answer(seed: int):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(TWO_CALLS)), rng.randint(1, 30)))
    pieces = [TWO_CALLS[a:b] for a, b in zip([0, *cuts], [*cuts, len(TWO_CALLS)], strict=True)]
    content, calls = _stream(pieces)
    whole_content, whole = parse_tool_calls(TWO_CALLS)
    assert content == whole_content
    assert calls == {i: {"name": c.name, "arguments": c.arguments} for i, c in enumerate(whole)}


def test_streaming_character_by_character_holds_back_the_tag():
    content, calls = _stream(list(TWO_CALLS))
    assert content == "Let me check." and len(calls) == 2
    p = ToolCallParser()
    assert p.feed("Hi <tool_").content == "Hi "  # may be the tag: held back
    assert p.feed("x").content == "<tool_x"  # was not
