"""Bad input and overload never hurt anyone else, through one real server (tiny model, pp=2):

- every malformed request gets INVALID_ARGUMENT naming the field and the limit, while a long greedy
  generation runs alongside and still returns exactly the transformers output;
- a burst at 4x the server's capacity: the excess fails with RESOURCE_EXHAUSTED, the rest completes, KV
  memory is never over-committed, and health and GetStats keep answering throughout (how fast they answer
  is a figure of benchmarks/bench_overload.py, whose load this test runs).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppserve.request import MAX_STOP_STRINGS, SamplingParams
from ppserve.server.client import PPServeClient
from ppserve.server.gen import ppserve_pb2 as pb
from tests.bench_scripts import load_benchmark
from tests.oracle import reference_greedy
from tests.server_helpers import ServerProcess, ready_client, running_server, set_args, wait_idle

CONTEXT = 256  # the tiny model's max_position_embeddings
VOCAB = 256
MAX_TOKENS_LIMIT = 200
MAX_MESSAGE_BYTES = 64 * 1024
LONG_PROMPT = [(7 * i + 3) % 250 + 3 for i in range(20)]
LONG_NEW = 200
overload = load_benchmark("bench_overload")
MAX_RUNNING, MAX_WAITING = overload.MAX_RUNNING, overload.MAX_WAITING
BURST = 4 * (MAX_RUNNING + MAX_WAITING)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir) -> Iterator[ServerProcess]:
    # The overload benchmark's settings (block size 4, budget 32, 4 running and 4 waiting at most) and
    # the limits the bad-input cases probe; one start-up serves both halves of the module.
    extra = [f"model.model={tiny_llama_dir}", *overload.SERVER_OVERRIDES,
             f"scheduler.max_tokens_limit={MAX_TOKENS_LIMIT}",
             f"server.max_message_bytes={MAX_MESSAGE_BYTES}"]
    with running_server(tmp_path_factory.mktemp("bad_input"), *set_args(*extra)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[PPServeClient]:
    with ready_client(server) as c:
        yield c


def _sp(**kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


BAD_REQUESTS: list[tuple[str, pb.GenerateRequest, list[str]]] = [
    ("empty prompt", pb.GenerateRequest(), ["prompt is empty"]),
    ("prompt and ids", pb.GenerateRequest(prompt="hi", prompt_token_ids=[5]), ["prompt, prompt_token_ids"]),
    ("id above vocab", pb.GenerateRequest(prompt_token_ids=[5, VOCAB]),
     ["prompt_token_ids[1]", f"[0, {VOCAB})"]),
    ("negative id", pb.GenerateRequest(prompt_token_ids=[-3]), ["prompt_token_ids[0]", f"[0, {VOCAB})"]),
    ("prompt over context", pb.GenerateRequest(prompt_token_ids=[5] * 300),
     ["prompt has 300 tokens", str(CONTEXT)]),
    ("max_tokens 0", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(max_tokens=0)),
     ["max_tokens", "positive"]),
    ("max_tokens < 0", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(max_tokens=-4)), ["max_tokens"]),
    ("max_tokens over limit",
     pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(max_tokens=MAX_TOKENS_LIMIT + 1)),
     ["max_tokens", f"limit of {MAX_TOKENS_LIMIT}"]),
    ("prompt + max_tokens over context",
     pb.GenerateRequest(prompt_token_ids=[5] * 100, sampling=_sp(max_tokens=MAX_TOKENS_LIMIT)),
     ["max_tokens", f"context of {CONTEXT}"]),
    ("temperature < 0", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(temperature=-0.1)),
     ["temperature", ">= 0"]),
    ("temperature nan", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(temperature=math.nan)),
     ["temperature"]),
    ("temperature inf", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(temperature=math.inf)),
     ["temperature"]),
    ("top_p 0", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(top_p=0.0)), ["top_p", "(0, 1]"]),
    ("top_p > 1", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(top_p=1.01)), ["top_p", "(0, 1]"]),
    ("top_k < -1", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(top_k=-2)), ["top_k", "-1"]),
    ("too many stops",
     pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(stop=["x"] * (MAX_STOP_STRINGS + 1))),
     ["stop", f"limit is {MAX_STOP_STRINGS}"]),
    ("empty stop", pb.GenerateRequest(prompt_token_ids=[5], sampling=_sp(stop=[""])), ["stop", "non-empty"]),
    ("unknown role", pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]),
     ["messages[0].role", "system, user, assistant"]),
    ("oversized", pb.GenerateRequest(prompt="x" * (MAX_MESSAGE_BYTES + 100)),
     [f"limit is {MAX_MESSAGE_BYTES}", "server.max_message_bytes"]),
]


def _raw_generate(client: PPServeClient, data: bytes) -> list[bytes]:
    """Send raw bytes as a GenerateRequest (a misbehaving client: invalid UTF-8 cannot be built otherwise)."""
    call = client.channel.unary_stream(
        "/ppserve.v1.PPServe/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    return list(call(data, timeout=30))


def _expect_invalid(fn: Any, needles: list[str], case: str = "") -> None:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT, (case, e.value.code(), e.value.details())
    for n in needles:
        assert n in e.value.details(), (case, n, e.value.details())


def test_bad_inputs_refused_while_long_generation_is_unharmed(client: PPServeClient, tiny_llama_dir) -> None:
    expected = reference_greedy(tiny_llama_dir, [LONG_PROMPT], LONG_NEW)[0]
    stream = client.stream(LONG_PROMPT, max_tokens=LONG_NEW, ignore_eos=True, request_id="long-run")
    it = iter(stream)
    first = next(it)  # the long generation is running now
    got = list(first.token_ids)
    rest: list[Any] = []
    reader = threading.Thread(target=lambda: rest.extend(it))
    reader.start()

    for name, req, needles in BAD_REQUESTS:
        _expect_invalid(lambda req=req: list(client.stub.Generate(req, timeout=30)), needles, name)
    bad_utf8 = pb.GenerateRequest(prompt="ab").SerializeToString().replace(b"ab", b"\xc3\x28")
    _expect_invalid(lambda: _raw_generate(client, bad_utf8), ["prompt is not valid UTF-8"])
    bad_stop = (pb.GenerateRequest(prompt="x", sampling=_sp(stop=["ab"])).SerializeToString()
                .replace(b"ab", b"\xff\xfe"))
    _expect_invalid(lambda: _raw_generate(client, bad_stop), ["sampling.stop is not valid UTF-8"])
    # A duplicate request_id of a running request.
    dup = pb.GenerateRequest(prompt_token_ids=[5], request_id="long-run")
    _expect_invalid(lambda: list(client.stub.Generate(dup, timeout=30)),
                    ["request_id 'long-run'", "already in use"])
    s = client.stats()
    assert s.running + s.waiting == 1  # only the long generation: nothing bad was queued

    reader.join(120)
    for c in rest:
        got.extend(c.token_ids)
    assert rest and rest[-1].finish_reason == "length"
    assert got == expected  # the long greedy generation is identical to transformers


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, -1.0]))


@st.composite
def requests(draw: Any) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["ids", "prompt", "both", "none", "messages"]))
    if kind in ("ids", "both"):
        req.prompt_token_ids.extend(draw(st.lists(st.integers(-5, VOCAB + 5), min_size=1, max_size=300)))
    if kind in ("prompt", "both"):
        req.prompt = draw(st.text(max_size=20))
    if kind == "messages":
        req.messages.add(role=draw(st.sampled_from(["user", "wizard", ""])), content="hi")
    sp = req.sampling
    sp.max_tokens = draw(st.one_of(st.integers(-(2**31), 0), st.integers(1, 4),
                                   st.integers(MAX_TOKENS_LIMIT - 2, 2**31 - 1)))
    if draw(st.booleans()):
        sp.temperature = draw(_floats)
    if draw(st.booleans()):
        sp.top_p = draw(_floats)
    if draw(st.booleans()):
        sp.top_k = draw(st.integers(-5, 5))
    sp.stop.extend(draw(st.lists(st.text(max_size=3), max_size=MAX_STOP_STRINGS + 2)))
    sp.ignore_eos = True
    return req


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests())
def test_property_any_request_is_served_or_invalid_argument(client: PPServeClient,
                                                            req: pb.GenerateRequest) -> None:
    """Random request messages: either served to completion or INVALID_ARGUMENT; never another error."""
    try:
        msgs = list(client.stub.Generate(req, timeout=60))
    except grpc.RpcError as e:
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), req)
        assert e.details()
        return
    assert msgs and msgs[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert sum(len(m.token_ids) for m in msgs) <= max(req.sampling.max_tokens, 0)


def test_server_idle_after_bad_inputs(client: PPServeClient) -> None:
    wait_idle(client)
    out = client.generate([5, 6, 7], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_burst_above_queue_bound(server: ServerProcess, client: PPServeClient) -> None:
    wait_idle(client)
    fig = asyncio.run(overload.run_overload(server.address or "", BURST, overload.MAX_TOKENS))
    print("\n" + overload.report(fig))
    codes = [c.code for c in fig.calls]
    ok = [c for c in fig.calls if c.code == "OK"]
    refused = [c for c in fig.calls if c.code == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == BURST, codes
    # Requests that arrive together are queued between two engine steps: at least the waiting bound fits.
    assert refused and len(ok) >= MAX_WAITING
    assert all(c.tokens == overload.MAX_TOKENS for c in ok)  # the admitted ones complete in full
    # Sustained 4x load: every client is refused only with RESOURCE_EXHAUSTED until it is served in full.
    for calls in fig.sustained:
        assert {c.code for c in calls[:-1]} <= {"RESOURCE_EXHAUSTED"}, calls
        assert calls[-1].code == "OK" and calls[-1].tokens == overload.MAX_TOKENS, calls[-1]
    assert len(fig.probes) >= 3, "health and GetStats were not answered during the load"
    for p in fig.probes:
        assert p.health == "SERVING"
        assert p.stats["kv_blocks_used"] <= p.stats["kv_blocks_total"]  # never over-committed
        assert p.stats["running"] <= MAX_RUNNING and p.stats["waiting"] <= MAX_WAITING
    assert fig.final["kv_blocks_used"] == 0 and fig.final["running"] == fig.final["waiting"] == 0
