"""Tool calls read back from generated text in the Hermes format:
`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks are calls, the text outside
them is the answer's content.

`ToolCallParser` is incremental: fed the text deltas of a stream, it answers OpenAI's streamed deltas
(content, then per call a first delta with its id, type and name and later ones with pieces of the
arguments). Text that could still become the opening tag is held back, so tag text never streams as
content. A whole answer is parsed by the same class (`parse_tool_calls`), so the streamed and the whole
forms of one output agree to the character.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# The start of a call's body up to its arguments: the name is read from here.
_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_HEAD_MAX_CHARS = 512  # a body that has not shown `{"name": ..., "arguments": ` by now is not one


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` are a proper prefix of `tag` (they may become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _args_hold(text: str) -> int:
    """How many characters at the end of a call's arguments text to hold back: what may be the body's
    closing brace, whitespace and the start of the closing tag rather than the arguments."""
    n = _partial_suffix(text, CLOSE_TAG)
    rest = text[: len(text) - n]
    stripped = rest.rstrip()
    if stripped.endswith("}"):
        stripped = stripped[:-1].rstrip()
    return len(text) - len(stripped)


@dataclass
class ParsedCall:
    """One tool call read from the output: arguments are the model's JSON text, as written."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParserDelta:
    """What one fed piece of text adds: content text and OpenAI `delta.tool_calls` entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def extend(self, other: ParserDelta) -> None:
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


class ToolCallParser:
    """Hermes tool calls out of a stream of text deltas; `feed` each delta, `finish` at the end."""

    def __init__(self) -> None:
        self.calls: list[ParsedCall] = []
        self.content = ""  # all content answered so far
        self._buf = ""  # text not yet answered
        self._in_call = False
        self._call: ParsedCall | None = None  # the open call, once its name was read
        self._sent_args = 0  # characters of the open call's arguments answered
        self._pending_ws = ""  # whitespace after a call: content only if more content follows

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        out = ParserDelta()
        while True:
            step = self._call_step() if self._in_call else self._content_step()
            if step is None:
                return out
            out.extend(step)

    def _content_step(self) -> ParserDelta | None:
        """Answer content up to an opening tag (entering the call) or up to what may start one."""
        at = self._buf.find(OPEN_TAG)
        if at >= 0:
            text, self._buf = self._buf[:at], self._buf[at + len(OPEN_TAG):]
            self._in_call = True
            return self._content(text)
        keep = _partial_suffix(self._buf, OPEN_TAG)
        text = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        delta = self._content(text)
        return delta if delta else None

    def _content(self, text: str) -> ParserDelta:
        if self.calls or self._call:  # whitespace between or after calls is no content of its own
            text = self._pending_ws + text
            if not text.strip():
                self._pending_ws = text
                return ParserDelta()
            self._pending_ws = ""
        self.content += text
        return ParserDelta(content=text)

    def _call_step(self) -> ParserDelta | None:
        out = ParserDelta()
        if self._call is None:
            m = _HEAD_RE.match(self._buf)
            if m is None:
                end = self._buf.find(CLOSE_TAG)
                if end >= 0:  # a body in another shape (keys in the other order): read it whole
                    return self._whole_body(end)
                if len(self._buf) > _HEAD_MAX_CHARS:
                    return self._not_a_call()
                return None
            try:
                name = json.loads(m.group(1))
            except json.JSONDecodeError:
                return self._not_a_call()
            self._call = ParsedCall(new_call_id(), str(name))
            self.calls.append(self._call)
            self._buf = self._buf[m.end():]
            self._sent_args = 0
            out.tool_calls.append({"index": len(self.calls) - 1, "id": self._call.id, "type": "function",
                                   "function": {"name": self._call.name, "arguments": ""}})
        end = self._buf.find(CLOSE_TAG)
        args = (self._buf if end < 0 else self._buf[:end]).lstrip()
        final = args[: len(args) - _args_hold(args)] if end < 0 else _strip_body_end(args)
        piece = final[self._sent_args:]
        if piece:
            self._call.arguments += piece
            self._sent_args += len(piece)
            out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        if end >= 0:
            self._buf = self._buf[end + len(CLOSE_TAG):]
            self._in_call, self._call = False, None
            return out
        return out if out else None

    def _whole_body(self, end: int) -> ParserDelta:
        body, rest = self._buf[:end], self._buf[end + len(CLOSE_TAG):]
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            obj = None
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return self._not_a_call()
        args = obj.get("arguments", {})
        call = ParsedCall(new_call_id(), obj["name"],
                          args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        self.calls.append(call)
        self._buf, self._in_call = rest, False
        i = len(self.calls) - 1
        return ParserDelta(tool_calls=[
            {"index": i, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
            {"index": i, "function": {"arguments": call.arguments}}])

    def _not_a_call(self) -> ParserDelta:
        """The tag opened no call: its text is content after all."""
        text, self._buf, self._in_call = OPEN_TAG + self._buf, "", False
        return self._content(text)

    def finish(self) -> ParserDelta:
        """The end of the output: what was held back. An open call (the output was cut short) keeps
        the arguments written so far; an opening tag with no call after it is content."""
        out = ParserDelta()
        if self._in_call and self._call is not None:
            piece = self._buf.lstrip()[self._sent_args:]  # the held-back tail of the arguments
            if piece:
                self._call.arguments += piece
                out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        elif self._in_call:
            out.extend(self._not_a_call())
        elif self._buf:
            out.extend(self._content(self._buf))
        self._buf, self._in_call, self._call = "", False, None
        return out

    @property
    def content_or_none(self) -> str | None:
        """The answer's content as OpenAI gives it: beside tool calls, stripped, and None when empty."""
        if not self.calls:
            return self.content
        return self.content.strip() or None


def _strip_body_end(args: str) -> str:
    """A closed call's arguments: its body less the closing brace of `{"name": ..., "arguments": ...}`."""
    stripped = args.rstrip()
    if stripped.endswith("}"):
        stripped = stripped[:-1].rstrip()
    return stripped


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedCall]]:
    """A whole output's content (see content_or_none) and its tool calls."""
    p = ToolCallParser()
    p.feed(text)
    p.finish()
    return p.content_or_none, p.calls
