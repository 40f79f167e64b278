"""Speculative decoding on real pipelines: greedy float32 output equals transformers' `generate` token for
token with drafts on, at every pipeline depth, with the token ring, under Ray with TP and preemption, with
stop strings and logprobs; sampled output keeps its distribution."""

from __future__ import annotations

import pytest

from ppserve import LLM, SamplingParams
from ppserve.request import Request
from ppserve.sched import speculation
from ppserve.sched.proposers import Proposer
from tests.oracle import ppserve_greedy, random_prompts, reference_greedy

MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (what prompt lookup feeds on), beside plain random ones."""
    base = random_prompts(3, (6, 11, 17, 30))
    return [p * 3 for p in base[:3]] + random_prompts(4, (1, 40, 65))


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, prompts):
    return reference_greedy(tiny_llama_dir, prompts, MAX_NEW)


class OracleProposer(Proposer):
    """Drafts from transformers' own continuation, every third proposal with a wrong token in it: drafts
    accepted in full, in part and not at all, at every step (a random tiny model repeats itself too
    rarely for prompt lookup to reach every path)."""

    def __init__(self, prompts: list[list[int]], expected: list[list[int]]) -> None:
        self.continuation = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
        self.calls = 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        cont = self.continuation[tuple(req.prompt_token_ids)]
        n = len(req.output_token_ids)
        drafts = list(cont[n:n + k])  # guesses for the outputs from the one this decode computes on
        if drafts and self.calls % 3 == 0:
            drafts[self.calls % len(drafts)] = (drafts[self.calls % len(drafts)] + 1) % 256
        return drafts


@pytest.fixture
def oracle(monkeypatch, prompts, expected):
    proposer = OracleProposer(prompts, expected)
    monkeypatch.setattr(speculation, "proposer_for", lambda config: proposer)
    return proposer


def spec(method: str = "ngram", k: int = 4, adaptive: bool = False) -> dict:
    """Not adaptive unless asked: a test needs drafts whatever the step cost timed at start-up says."""
    return {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1, "adaptive": adaptive}


def generate(model_dir, prompts, **kwargs):
    with LLM(str(model_dir), dtype="float32", **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        sched = llm.engine.scheduler
        assert sched.spec is not None
        return [o.token_ids for o in outs], sched.spec.counters, sched.num_preemptions


def drafted_every_way(counters) -> bool:
    """Drafts accepted in full, in part and rejected at once all happened."""
    return (counters.num_accepted_tokens > 0 and counters.num_accepted_tokens < counters.num_draft_tokens
            and counters.accepted_per_pos[0] < counters.num_drafts)


SEEN: list = []  # every shape's counters: together they must have drafted every way


@pytest.mark.parametrize("pp,budget,ring", [(1, 24, None), (2, 24, True), (3, 16, True), (2, 64, False)])
def test_greedy_with_drafts_equals_transformers(tiny_llama_dir, prompts, expected, oracle, pp, budget, ring):
    ring_set = [] if ring is None else [f"scheduler.token_ring={ring}"]
    got, counters, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=pp,
                                token_budget=budget, block_size=4, speculative_config=spec(),
                                overrides=ring_set)
    assert got == expected
    # Which decodes carry drafts follows the ring's timing, so one shape may see no draft rejected at
    # once; each must verify some drafts in part, and the shapes together every way.
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    SEEN.append(counters)


def test_the_shapes_drafted_every_way():
    if len(SEEN) < 4:
        pytest.skip("runs after the four shapes above (run the whole module)")
    assert any(c.accepted_per_pos[0] < c.num_drafts for c in SEEN)
    assert any(c.num_accepted_tokens > 0 for c in SEEN)


def test_prompt_lookup_equals_transformers(tiny_llama_dir, prompts, expected):
    got, counters, _ = generate(tiny_llama_dir, prompts, executor="inproc", token_budget=32, block_size=4,
                                speculative_config=spec("ngram"))
    assert got == expected
    assert counters.num_draft_tokens > 0


@pytest.mark.parametrize("pp", [1, 2])
def test_suffix_decoding_drafts_from_earlier_responses(tiny_llama_dir, prompts, expected, pp):
    """The same prompts twice: the second time the suffix cache holds the first answers, so their drafts
    are accepted; output equals transformers' both times."""
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=pp,
             token_budget=32, block_size=4,
             speculative_config=spec("suffix")) as llm:
        sp = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == expected
        before = llm.engine.scheduler.spec.counters.num_accepted_tokens
        assert [o.token_ids for o in llm.generate(prompts, sp)] == expected
        assert llm.engine.scheduler.spec.counters.num_accepted_tokens > before


def test_adaptive_drafts_equal_transformers(tiny_llama_dir, prompts, expected, oracle):
    """The adaptive rule (the default) on a pipeline: what it drafts changes no token."""
    got, counters, _ = generate(tiny_llama_dir, prompts, executor="inproc", pipeline_parallel_size=2,
                                token_budget=24, block_size=4, speculative_config=spec(adaptive=True))
    assert got == expected
    assert counters.num_drafts > 0


def test_process_stages_with_drafts(tiny_llama_dir, prompts, expected, oracle):
    """Stages in processes (the multi-process executor, the token ring over sockets), pp 3."""
    got, counters, _ = generate(tiny_llama_dir, prompts, executor="mp", pipeline_parallel_size=3,
                                token_budget=24, block_size=4, speculative_config=spec())
    assert got == expected
    assert drafted_every_way(counters)


def test_ray_tp_and_preemption_with_drafts(ray_session, tiny_llama_dir, prompts, expected, oracle):
    """Ray actors, pp 2 x tp 2, a KV cache small enough that requests are preempted and recomputed while
    they speculate."""
    got, counters, preemptions = generate(tiny_llama_dir, prompts, pipeline_parallel_size=2,
                                          tensor_parallel_size=2, token_budget=24, block_size=4,
                                          num_kv_blocks=40, speculative_config=spec())
    assert got == expected
    assert preemptions > 0 and drafted_every_way(counters)


def test_logprobs_match_without_drafts(tiny_llama_dir, prompts, oracle):
    """Per-token logprobs are those decoding without drafts gives."""
    def run(speculative):
        kw = {"speculative_config": speculative} if speculative else {}
        with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
                 token_budget=32, block_size=4, **kw) as llm:
            tok_outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=2))
            return [(o.token_ids, o.logprobs) for o in tok_outs]

    plain, drafted = run(None), run(spec())
    for (ids_a, lp_a), (ids_b, lp_b) in zip(plain, drafted, strict=True):
        assert ids_a == ids_b
        assert lp_a is not None and lp_b is not None and len(lp_a) == len(lp_b) == len(ids_a)
        for (x, top_x), (y, top_y) in zip(lp_a, lp_b, strict=True):
            assert x == pytest.approx(y, abs=1e-4)
            assert [t for t, _ in top_x] == [t for t, _ in top_y]


def test_seeded_sampled_output_equals_decoding_without_drafts(tiny_llama_dir, prompts, oracle):
    """A seeded sampled request gets the tokens it gets without drafts (each row is sampled with the
    uniform of its output position; worker/rejection.py), with top-k, top-p and penalties."""
    def run(speculative):
        kw = {"speculative_config": speculative} if speculative else {}
        with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc", pipeline_parallel_size=2,
                 token_budget=32, block_size=4, **kw) as llm:
            sps = [SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, top_k=20, seed=11 + i,
                                  top_p=0.9 if i % 2 else 1.0, presence_penalty=0.5 if i % 3 == 0 else 0.0)
                   for i in range(len(prompts))]
            return [o.token_ids for o in llm.generate(prompts, sps)]

    assert run(spec()) == run(None)


def test_default_is_off(tiny_llama_dir, prompts, expected):
    got, _ = ppserve_greedy(tiny_llama_dir, prompts[:2], MAX_NEW, executor="inproc")
    assert got == expected[:2]
    with LLM(str(tiny_llama_dir), dtype="float32", executor="inproc") as llm:
        assert llm.engine.scheduler.spec is None


def test_stop_strings_cut_where_they_do_without_drafts(tiny_llama_dir, prompts, oracle, tmp_path):
    """A stop string completed by an accepted draft ends the output at that token: text and tokens are
    those decoding without drafts gives."""
    from tests.structured_helpers import add_byte_tokenizer

    model = add_byte_tokenizer(tiny_llama_dir, tmp_path / "bytes")

    def run(speculative, stop=()):
        kw = {"speculative_config": speculative} if speculative else {}
        with LLM(str(model), dtype="float32", executor="inproc", token_budget=32, block_size=4, **kw) as llm:
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, stop=stop))
            return [(o.token_ids, o.text) for o in outs]

    plain = run(None)
    # A stop string out of each output's middle: it ends the output early, in a step with drafts.
    stops = tuple(text[8:10] for _, text in plain if len(text) > 12)
    assert stops
    want = run(None, stops)
    assert want != plain
    assert run(spec(), stops) == want
