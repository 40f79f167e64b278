"""A request's streamed text (engine/output.py): stop strings are never streamed, not even in part."""

from __future__ import annotations

import pytest

from ppserve.engine.detokenizer import IncrementalDetokenizer
from ppserve.engine.output import OutputState, held_back
from ppserve.request import Request, SamplingParams

VOCAB = {1: "Hello", 2: " E", 3: "N", 4: "D", 5: " world", 6: ".", 9: "o", 10: "END", 11: " fabric",
         12: " of", 13: " the"}


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):  # noqa: ARG002
        return "".join(VOCAB[i] for i in ids)


def state(stop: tuple[str, ...]) -> OutputState:
    req = Request("r", [1], SamplingParams(max_tokens=20, stop=stop))
    return OutputState(req, IncrementalDetokenizer(FakeTokenizer(), [1]))


def stream(st: OutputState, tokens: list[int], last_finishes: bool = False) -> tuple[list[str], bool]:
    out, hit = [], False
    for k, t in enumerate(tokens):
        text, hit = st.advance((t,), last_finishes and k == len(tokens) - 1, float(k))
        out.append(text)
        if hit:
            break
    return out, hit


def test_stop_string_split_over_tokens_is_never_streamed():
    st = state(("END",))
    out, hit = stream(st, [5, 2, 3, 4, 5])
    assert hit
    assert "".join(out) == " world "  # " E", "N" held back, then cut with "D"
    assert all("E" not in piece for piece in out)
    assert st.detok.text == " world "


def test_held_back_text_is_released_when_it_cannot_become_a_stop():
    st = state(("END",))
    out, hit = stream(st, [2, 3, 9, 5])  # " EN" then "o": not "END" after all
    assert not hit
    assert out == [" ", "", "ENo", " world"]


def test_finish_flushes_what_was_held_back():
    st = state(("END",))
    out, hit = stream(st, [5, 2, 3], last_finishes=True)  # ends on " EN" (length, eos): all of it is output
    assert not hit and "".join(out) == " world EN"


def test_the_issue_example_cuts_inside_a_token():
    # "... fabric of the world." with stop "f t": the output ends "... fabric o".
    st = state(("f t",))
    out, hit = stream(st, [11, 12, 13, 5, 6])
    assert hit and "".join(out) == " fabric o"
    assert out[:2] == [" fabric", " o"]  # the "f" of " of" waits: it could start "f t"
    assert st.detok.text == " fabric o"


def test_stop_inside_one_token_and_earliest_of_several():
    st = state(("ND", "xyz"))
    out, hit = stream(st, [5, 10, 5])
    assert hit and "".join(out) == " worldE"


@pytest.mark.parametrize(("text", "stops", "n"), [
    ("abc", ("cd",), 1), ("abc", ("bcd", "c"), 2), ("abc", ("xyz",), 0), ("ab", ("abc",), 2), ("", ("a",), 0),
])
def test_held_back(text, stops, n):
    assert held_back(text, stops) == n


@pytest.mark.parametrize("tokens,used", [([5, 2, 3, 4, 5, 6], 4), ([5, 6, 5], 3), ([10, 5], 1)])
def test_several_tokens_of_one_step_end_at_the_stop_strings_token(tokens, used):
    """Speculative decoding hands a step's tokens at once: the stop string ends the output at the token
    that completed it, with the text token-by-token streaming gives."""
    one = state(("END",))
    want, hit_one = stream(one, tokens)
    many = state(("END",))
    many.request.output_token_ids.extend(tokens)
    text, hit, n = many.advance_each(tuple(tokens), False, 0.0)
    assert (text, hit, n) == ("".join(want), hit_one, used)
    assert many.detok.text == one.detok.text


def test_min_tokens_counts_each_token_of_a_step():
    """Before min_tokens outputs a stop string does not end the request, counted token by token."""
    req = Request("r", [1], SamplingParams(max_tokens=20, stop=("END",), min_tokens=2))
    st = OutputState(req, IncrementalDetokenizer(FakeTokenizer(), [1]))
    req.output_token_ids.extend([10, 5, 10])
    text, hit, n = st.advance_each((10, 5, 10), False, 0.0)
    assert hit and n == 3 and text == "END world"
