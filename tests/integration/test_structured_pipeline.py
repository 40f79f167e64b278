"""Structured outputs on the pipeline: constrained greedy float32 output equals transformers' greedy
generate under xgrammar's logits processor (the oracle), token for token, at every pipeline depth, with
the token ring on and off, in process, on Ray (the matcher in another process, over the rendezvous
link's strict rules), with preemption by recompute, with a stage killed mid-run, and sampled output is
reproducible for a seed. Every constrained output that ends with "stop" matches its constraint."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import jsonschema
import pytest

from ppserve import LLM, SamplingParams
from tests.fault_helpers import stage_pid
from tests.oracle import random_prompts
from tests.structured_helpers import add_byte_tokenizer, constrained_reference

MAX_NEW = 40
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"},
                                           "c": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a", "b", "c"]}
SPECS = {"json": {"json": SCHEMA}, "regex": {"regex": r"[a-c]{2,6}-\d{1,3}"},
         "choice": {"choice": ("left", "right", "up")}}


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return add_byte_tokenizer(tiny_llama_dir, tmp_path_factory.mktemp("structured") / "tok")


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(0, (1, 5, 17, 33, 64, 90))


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    return {kind: constrained_reference(model_dir, prompts, spec, MAX_NEW) for kind, spec in SPECS.items()}


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(SPECS["regex"]["regex"], text), text
    else:
        assert text in SPECS["choice"]["choice"]


def _generate(llm: LLM, prompts, kind: str, **kw):
    return llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, structured_outputs=SPECS[kind], **kw))


@pytest.mark.parametrize("pp,ring", [(1, False), (2, True), (3, True), (2, False)])
def test_in_process_equals_constrained_transformers(model_dir, prompts, expected, pp, ring):
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp, token_budget=24,
             block_size=4, overrides=[f"scheduler.token_ring={str(ring).lower()}"]) as llm:
        for kind in SPECS:
            outs = _generate(llm, prompts, kind)
            assert [o.token_ids for o in outs] == expected[kind], kind
            for o in outs:
                assert o.finish_reason == "stop"
                _check(kind, o.text)


def test_unconstrained_rows_beside_constrained_ones_are_unchanged(model_dir, prompts, expected):
    """One microbatch holding constrained and free requests: the free ones are the plain greedy output."""
    from tests.oracle import reference_greedy

    free = reference_greedy(model_dir, prompts, 12)
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=64,
             block_size=4) as llm:
        eng = llm.engine
        params = [SamplingParams(max_tokens=MAX_NEW, structured_outputs=SPECS["json"]),
                  SamplingParams(max_tokens=12, ignore_eos=True)]
        ids = [[eng.add_request(p, sp) for sp in params] for p in prompts]
        tokens: dict[str, list[int]] = {}
        while eng.has_unfinished:
            for d in eng.step():
                tokens.setdefault(d.request_id, []).extend(d.token_ids)
    assert [tokens[c] for c, _ in ids] == expected["json"]
    assert [tokens[f] for _, f in ids] == free


def test_ray_pipeline_with_preemption_under_the_rendezvous_link(ray_session, model_dir, prompts, expected):
    """The matcher lives in the last stage's process; preemption sends a request again with its outputs
    and the matcher replays them."""
    with LLM(str(model_dir), dtype="float32", pipeline_parallel_size=3, token_budget=16, block_size=4,
             num_kv_blocks=40, overrides=["parallel.stage_link=rendezvous"]) as llm:
        for kind in SPECS:
            assert [o.token_ids for o in _generate(llm, prompts, kind)] == expected[kind], kind
        assert llm.engine.scheduler.num_preemptions > 0


def test_killed_last_stage_rebuilds_its_matchers_exactly(ray_session, model_dir, prompts, expected):
    with LLM(str(model_dir), dtype="float32", pipeline_parallel_size=2, token_budget=16, block_size=4) as llm:
        eng = llm.engine
        sp = SamplingParams(max_tokens=MAX_NEW, structured_outputs=SPECS["json"])
        ids = [eng.add_request(p, sp) for p in prompts]
        streamed: dict[str, list[int]] = {rid: [] for rid in ids}
        steps = 0
        while eng.has_unfinished:
            for d in eng.step():
                streamed[d.request_id].extend(d.token_ids)
            steps += 1
            if steps == 6:
                os.kill(stage_pid(llm, 1), signal.SIGKILL)
        assert eng.stats().num_restarts == 1
    assert [streamed[r] for r in ids] == expected["json"]


def test_sampled_constrained_output_is_reproducible_and_valid(model_dir, prompts):
    runs = []
    for pp in (1, 2):
        with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp,
                 token_budget=24, block_size=4) as llm:
            outs = _generate(llm, prompts, "json", temperature=1.0, top_p=0.9, seed=3, logprobs=2,
                             presence_penalty=0.5)
            runs.append([o.token_ids for o in outs])
            for o in outs:
                if o.finish_reason == "stop":
                    _check("json", o.text)
                assert o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                # The constrained distribution's log-probabilities: a token the grammar forces (the
                # schema's fixed text) has probability 1 there, its alternatives none.
                assert all(float("-inf") < lp <= 0.0 for lp, _ in o.logprobs)
                assert any(lp == 0.0 and alts[1][1] == float("-inf") for lp, alts in o.logprobs)
    assert runs[0] == runs[1]


def test_n_choices_and_max_tokens_truncation(model_dir, prompts):
    with LLM(str(model_dir), dtype="float32", executor="inproc", token_budget=24, block_size=4) as llm:
        outs = llm.generate(prompts[:2], SamplingParams(max_tokens=5, structured_outputs=SPECS["json"]))
        assert {o.finish_reason for o in outs} == {"length"} and all(len(o.token_ids) == 5 for o in outs)
        many = llm.generate(prompts[:1], SamplingParams(max_tokens=MAX_NEW, n=3, temperature=1.0, seed=5,
                                                        structured_outputs=SPECS["choice"]))
        assert len(many) == 3
        for o in many:
            assert o.finish_reason == "stop"
            _check("choice", o.text)


@pytest.mark.parametrize("spec,message", [
    ({"regex": "(unclosed"}, "regex does not compile"),
    ({"grammar": "root ::= missing_rule"}, "grammar does not compile"),
    ({"choice": []}, "choice is empty"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
])
def test_bad_constraints_are_refused_and_the_engine_keeps_serving(model_dir, prompts, spec, message):
    with LLM(str(model_dir), dtype="float32", executor="inproc", token_budget=24, block_size=4) as llm:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, structured_outputs=spec))
        assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=4))[0].token_ids) > 0


@pytest.mark.parametrize("policy", ["vllm", "orca", "vllm-v1-async", "sglang-pp"])
def test_baseline_policies_give_the_same_constrained_output(model_dir, prompts, expected, policy):
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=24,
             block_size=4, policy=policy) as llm:
        assert [o.token_ids for o in _generate(llm, prompts, "json")] == expected["json"]


def test_prefix_cache_hits_change_nothing(model_dir, prompts, expected):
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=24,
             block_size=4) as llm:
        first = [o.token_ids for o in _generate(llm, prompts, "regex")]
        again = _generate(llm, prompts, "regex")
    assert first == [o.token_ids for o in again] == expected["regex"]
    assert sum(o.num_cached_tokens for o in again) > 0


def test_masks_need_no_host_read_inside_a_stage_step(model_dir, prompts, expected, monkeypatch):
    """The bitmask is built on the host before the step and reaches the logits without a device read
    (on a GPU: an asynchronous copy from pinned memory)."""
    from ppserve.worker.host_sync import STRICT_ENV

    monkeypatch.setenv(STRICT_ENV, "1")
    with LLM(str(model_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2, token_budget=24,
             block_size=4) as llm:
        assert [o.token_ids for o in _generate(llm, prompts, "json")] == expected["json"]


def test_chat_template_file_replaces_the_models(model_dir, tmp_path):
    """model.chat_template (ppserve serve --chat-template FILE): the file renders every conversation; a
    path that cannot be read fails the engine's start with its name."""
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> ")
    with LLM(str(model_dir), dtype="float32", executor="inproc",
             overrides=[f"model.chat_template={template}"]) as llm:
        assert llm.engine.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n> "
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4, ignore_eos=True))
        assert out[0].prompt_token_ids == list(b"[user] hi\n> ")
    with pytest.raises(ValueError, match="missing.jinja"):
        LLM(str(model_dir), dtype="float32", executor="inproc",
            overrides=[f"model.chat_template={tmp_path / 'missing.jinja'}"])
