"""One request's output as its client sees it: incremental text, stop strings, token times.

Text is decoded incrementally (engine/detokenizer.py). A stop string is never streamed, not even in
part: the longest tail of the text that could still grow into a stop string is held back until the
next token decides it, and the text is cut where a stop string begins (it is not part of the output).
Before `min_tokens` output tokens a stop string does not end the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppserve.engine.detokenizer import IncrementalDetokenizer
from ppserve.engine.messages import RequestTimes
from ppserve.request import Request


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


@dataclass
class OutputState:
    request: Request
    detok: IncrementalDetokenizer | None
    token_times: list[float] = field(default_factory=list)
    emitted: int = 0  # characters of the text already streamed
    searched: int = 0  # text before this (minus a stop string's length) holds no stop string

    def advance_each(self, token_ids: tuple[int, ...], finished: bool, now: float) -> tuple[str, bool, int]:
        """Several tokens of one step (speculative decoding) taken one at a time, so a stop string ends the
        output at the token that completed it, as it would without drafts; returns (text, hit, tokens
        used). The request's outputs already hold all of them."""
        first = len(self.request.output_token_ids) - len(token_ids)
        parts: list[str] = []
        for i, t in enumerate(token_ids):
            last = i == len(token_ids) - 1
            text, hit = self.advance((t,), finished and last, now, num_outputs=first + i + 1)
            parts.append(text)
            if hit:
                return "".join(parts), True, i + 1
        return "".join(parts), False, len(token_ids)

    def advance(self, token_ids: tuple[int, ...], finished: bool, now: float,
                num_outputs: int | None = None) -> tuple[str, bool]:
        """Take this step's tokens; returns (text to stream now, whether a stop string was hit).
        `num_outputs`: the request's output count after them (default: its outputs now)."""
        self.token_times.extend([now] * len(token_ids))
        if self.detok is None:
            return "", False
        for t in token_ids:
            self.detok.add(t)
        if finished:
            self.detok.flush()
        text = self.detok.text
        sp = self.request.sampling
        # Before min_tokens outputs a stop string does not end the request (nor is text held back for one).
        outputs = len(self.request.output_token_ids) if num_outputs is None else num_outputs
        stops = sp.stop if outputs >= sp.min_tokens else ()
        end = len(text)
        hit = False
        if not stops:
            self.searched = len(text)  # a stop string may still end in the next token's text
        else:
            start = max(0, self.searched - max(len(s) for s in stops) + 1)
            found = [i for s in stops if (i := text.find(s, start)) >= 0]
            self.searched = len(text)
            if found:
                end, hit = min(found), True
                self.detok.text = text[:end]  # the stop string and what follows are not output
            elif not finished:
                end -= held_back(text, stops)
        out = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out, hit

    def times(self) -> RequestTimes:
        return RequestTimes(self.request.arrival_time, self.request.first_scheduled_time,
                            list(self.token_times))
