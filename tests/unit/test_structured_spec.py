"""StructuredOutputs and the compile cache, without a model: one kind per request, each kind checked
for type and size, the compiler's message for what does not compile, a time limit, and compiles done
once per constraint."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from ppserve.request import SamplingParams
from ppserve.structured.grammars import GrammarCache
from ppserve.structured.spec import GrammarError, StructuredOutputs


def test_one_kind_and_vllm_dict_form():
    so = StructuredOutputs.from_dict({"json": {"type": "object", "properties": {"b": {}, "a": {}}}})
    assert so.kind == "json" and so.json == '{"type":"object","properties":{"b":{},"a":{}}}'  # order kept
    assert StructuredOutputs.from_dict(so.to_dict()) == so
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs == StructuredOutputs(
        choice=("x", "y"))
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert pickle.loads(pickle.dumps(sp)) == sp and hash(sp) == hash(pickle.loads(pickle.dumps(sp)))
    assert StructuredOutputs(json='{"a": 1}').key == StructuredOutputs(json={"a": 1}).key


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a"}, "got json, regex"),
    ({"choice": []}, "choice is empty"),
    ({"choice": "yes"}, "list of strings"),
    ({"choice": ["a", ""]}, "non-empty strings"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1, 2]}, "a JSON schema is an object"),
    ({"regex": ""}, "non-empty string"),
    ({"grammar": 3}, "non-empty string"),
])
def test_malformed_specs_name_the_field(kwargs, message):
    with pytest.raises(GrammarError, match=message):
        StructuredOutputs(**kwargs)


def test_unknown_fields_and_conflicting_sampling_are_refused():
    with pytest.raises(GrammarError, match="unknown field"):
        StructuredOutputs.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})


class _SlowBackend:
    name = "fake"
    vocab_size = 8

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.compiled: list[tuple[str, str]] = []

    def compile(self, spec):
        if spec.regex == "bad":
            raise GrammarError("structured_outputs.regex does not compile: nope")
        time.sleep(self.delay)
        self.compiled.append(spec.key)
        return spec.key

    def matcher(self, compiled):  # pragma: no cover - not used here
        raise NotImplementedError


def test_cache_compiles_once_counts_hits_and_keeps_failures_out():
    backend = _SlowBackend(0.0)
    cache = GrammarCache(lambda: backend)
    a = StructuredOutputs(regex="a+")
    assert cache.get(a) == cache.get(a) == a.key
    assert backend.compiled == [a.key] and cache.stats.compiles == 1 and cache.stats.hits == 1
    for _ in range(2):
        with pytest.raises(GrammarError, match="nope"):
            cache.get(StructuredOutputs(regex="bad"))
    assert cache.stats.failures == 2  # a failure is not cached: each request gets the compiler's message
    assert len(cache.drain_compile_seconds()) == 1 and cache.drain_compile_seconds() == []


def test_compile_runs_off_the_callers_thread_with_a_time_limit():
    backend = _SlowBackend(0.5)
    cache = GrammarCache(lambda: backend, timeout_s=0.05)
    caller = threading.get_ident()
    t0 = time.perf_counter()
    fut = cache.submit(StructuredOutputs(regex="slow"))
    assert time.perf_counter() - t0 < 0.1  # submit returns at once
    with pytest.raises(GrammarError, match="took more than 0.05 s"):
        cache.get(StructuredOutputs(regex="slow"))
    assert fut.result(timeout=5) == ("regex", "slow")  # it finishes later, and is cached for the next one
    assert cache.get(StructuredOutputs(regex="slow")) == ("regex", "slow")
    del caller
