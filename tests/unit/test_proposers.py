"""The model-free draft proposers: prompt lookup (ngram) and suffix decoding."""

from __future__ import annotations

import random

import pytest

from ppserve.request import Request, SamplingParams
from ppserve.sched.proposers import NgramProposer, SuffixProposer, _Node, make_proposer


def _req(prompt: list[int], rid: str = "a") -> Request:
    return Request(request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams())


def _brute_ngram(seq: list[int], k: int, nmax: int, nmin: int) -> list[int]:
    """The reference: the latest earlier occurrence of the last n tokens, longest n first."""
    length = len(seq)
    for n in range(nmax, nmin - 1, -1):
        if length < n + 1:
            continue
        suffix = seq[length - n:]
        for s in range(length - n - 1, -1, -1):
            if seq[s:s + n] == suffix:
                return seq[s + n:s + n + k]
    return []


# --- ngram ---


def test_ngram_most_recent_earlier_match() -> None:
    p = NgramProposer(prompt_lookup_max=2, prompt_lookup_min=2)
    # (1, 2) occurs at 0 (followed by 3, 4) and at 4 (followed by 5, 6); the latest wins.
    assert p.propose(_req([1, 2, 3, 4, 1, 2, 5, 6, 9, 1, 2]), 2) == [5, 6]


def test_ngram_prefers_longer_n() -> None:
    p = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=1)
    # 3-gram (7, 8, 9) matched at 0 -> 10; the 1-gram 9 alone would match later (-> 11).
    assert p.propose(_req([7, 8, 9, 10, 5, 9, 11, 7, 8, 9]), 1) == [10]


def test_ngram_no_match_and_k() -> None:
    p = NgramProposer()
    assert p.propose(_req([1, 2, 3, 4, 5]), 4) == []
    assert p.propose(_req([1], rid="b"), 4) == []
    r = _req([1, 2, 3, 4, 5, 6, 1, 2], rid="c")
    assert p.propose(r, 3) == [3, 4, 5]
    assert p.propose(r, 1) == [3]
    assert p.propose(r, 0) == []


def test_ngram_never_matches_suffix_with_itself() -> None:
    p = NgramProposer(prompt_lookup_max=3, prompt_lookup_min=3)
    assert p.propose(_req([4, 5, 6]), 3) == []
    # An overlapping earlier occurrence in a run is a real match.
    assert p.propose(_req([1, 1, 1, 1], rid="b"), 3) == [1]


def test_ngram_incremental_matches_brute_force() -> None:
    rng = random.Random(0)
    for trial in range(30):
        nmax = rng.randint(1, 5)
        nmin = rng.randint(1, nmax)
        p = NgramProposer(prompt_lookup_max=nmax, prompt_lookup_min=nmin)
        vocab = rng.randint(2, 6)
        r = _req([rng.randrange(vocab) for _ in range(rng.randint(0, 12))], rid=f"r{trial}")
        for _ in range(40):
            k = rng.randint(0, 6)
            seq = r.prompt_token_ids + r.output_token_ids
            assert p.propose(r, k) == _brute_ngram(seq, k, nmax, nmin)
            for _ in range(rng.choice([1, 1, 1, 2, 5])):
                r.output_token_ids.append(rng.randrange(vocab))
        p.release(r, finished=True)
        assert not p._states


# --- suffix ---


def test_suffix_repeated_continuation_from_own_tokens() -> None:
    p = SuffixProposer()
    r = _req([10, 11, 12, 13, 14, 20, 10, 11, 12])
    assert p.propose(r, 2) == [13, 14]
    r.output_token_ids += [13, 14, 20]
    assert p.propose(r, 3) == [10, 11, 12]  # incremental indexing follows the outputs


def test_suffix_global_cache_from_finished_request() -> None:
    p = SuffixProposer()
    done = _req([1, 2], rid="done")
    done.output_token_ids += [50, 51, 52, 53, 54]
    p.propose(done, 3)
    p.release(done, finished=True)
    r = _req([7, 50, 51], rid="new")
    assert p.propose(r, 3) == [52, 53]  # at most ceil(1.0 * match length 2) tokens
    # A dropped request's output is not cached.
    dropped = _req([3], rid="dropped")
    dropped.output_token_ids += [60, 61, 62]
    p.release(dropped, finished=False)
    assert p.propose(_req([9, 60, 61], rid="x"), 3) == []


def test_suffix_min_token_prob() -> None:
    # After (1, 2): 3 then 4 once each, so the first token's probability is 1/3 (the current end counts too).
    seq = [1, 2, 3, 1, 2, 4, 1, 2]
    assert SuffixProposer(min_token_prob=0.3).propose(_req(seq), 1) in ([3], [4])
    assert SuffixProposer(min_token_prob=0.4).propose(_req(seq), 1) == []
    # The path probability multiplies: 5 -> 6 is 4/5, then (5, 6) -> 7 is 3/4, so 6, 7 has probability 0.6.
    seq2 = [5, 6, 1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5]
    assert SuffixProposer(min_token_prob=0.7, max_spec_factor=10.0).propose(_req(seq2), 2) == [6]
    assert SuffixProposer(min_token_prob=0.6, max_spec_factor=10.0).propose(_req(seq2), 2) == [6, 7]


def test_suffix_max_spec_factor() -> None:
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert SuffixProposer(max_spec_factor=1.0).propose(_req(seq), 8) == [3, 4]
    assert SuffixProposer(max_spec_factor=0.5).propose(_req(seq), 8) == [3]
    assert SuffixProposer(max_spec_factor=3.0).propose(_req(seq), 8) == [3, 4, 5, 6, 7, 8]
    assert SuffixProposer(max_spec_factor=3.0).propose(_req(seq), 2) == [3, 4]


def test_suffix_depth_cap() -> None:
    p = SuffixProposer(max_tree_depth=4, max_spec_factor=10.0)
    r = _req(list(range(10)) + [0])
    assert p.propose(r, 10) == [1, 2, 3]  # a match of 1 leaves three levels
    assert _max_depth(p._states["a"].root) == 4


def _max_depth(node: _Node) -> int:
    return max([node.depth] + [_max_depth(c) for c in node.children.values()])


def test_suffix_evicts_beyond_cache_cap() -> None:
    p = SuffixProposer(max_cached_requests=2)
    for i, out in enumerate([[100, 101, 102], [200, 201, 202], [300, 301, 302]]):
        r = _req([1], rid=f"f{i}")
        r.output_token_ids += out
        p.release(r, finished=True)
    assert p.propose(_req([100, 101], rid="q1"), 2) == []  # the oldest was evicted
    assert p.propose(_req([200, 201], rid="q2"), 2) == [202]
    assert p.propose(_req([300, 301], rid="q3"), 2) == [302]
    assert 100 not in p._global.children
    assert list(p._cached) == ["f1", "f2"]
    # Evicting everything leaves an empty trie with no counts.
    small = SuffixProposer(max_cached_requests=1)
    for i in range(3):
        r = _req([1], rid=f"g{i}")
        r.output_token_ids += [i, i + 1, i]
        small.release(r, finished=True)
    assert set(small._global.children) == {2, 3}
    assert small._global.count == 3


def test_suffix_global_matches_update_after_cache_change() -> None:
    p = SuffixProposer()
    r = _req([40, 41], rid="live")
    assert p.propose(r, 2) == []
    done = _req([0], rid="done")
    done.output_token_ids += [40, 41, 42, 43]
    p.release(done, finished=True)
    assert p.propose(r, 2) == [42, 43]


def test_suffix_forgets_state_on_release() -> None:
    p = SuffixProposer(max_cached_requests=0)
    r = _req([1, 2, 3, 1, 2])
    assert p.propose(r, 1) == [3]
    p.release(r, finished=True)
    assert not p._states and not p._global.children
    # The same id with a different sequence starts from scratch.
    assert p.propose(_req([7, 8, 9]), 1) == []


# --- make_proposer ---


def test_make_proposer() -> None:
    assert isinstance(make_proposer("ngram", prompt_lookup_max=3), NgramProposer)
    assert isinstance(make_proposer("suffix", max_tree_depth=8), SuffixProposer)
    with pytest.raises(ValueError, match="valid methods: ngram, suffix"):
        make_proposer("eagle")
    with pytest.raises(ValueError, match="must not exceed"):
        make_proposer("ngram", prompt_lookup_max=2, prompt_lookup_min=3)
    with pytest.raises(ValueError, match="prompt_lookup_min must be an integer >= 1"):
        make_proposer("ngram", prompt_lookup_min=0)
    with pytest.raises(ValueError, match="max_tree_depth"):
        make_proposer("suffix", max_tree_depth=0)
    with pytest.raises(ValueError, match="max_cached_requests"):
        make_proposer("suffix", max_cached_requests=-1)
    with pytest.raises(ValueError, match="max_spec_factor"):
        make_proposer("suffix", max_spec_factor=0.0)
    with pytest.raises(ValueError, match="min_token_prob"):
        make_proposer("suffix", min_token_prob=1.5)
    with pytest.raises(ValueError, match="'ngram': depth; valid options: prompt_lookup_max"):
        make_proposer("ngram", depth=3)


def _snapshot(node: _Node) -> dict[int, tuple[int, int, object]]:
    """Token -> (count, the best child's count, subtree) for comparing tries."""
    return {t: (c.count, c.best.count if c.best else 0, _snapshot(c)) for t, c in node.children.items()}


def test_suffix_global_trie_after_evictions_equals_a_fresh_build() -> None:
    rng = random.Random(1)
    p = SuffixProposer(max_tree_depth=5, max_cached_requests=3)
    for i in range(25):
        r = _req([0], rid=f"r{rng.randrange(8)}")  # ids repeat: a reused id replaces its cached output
        r.output_token_ids += [rng.randrange(4) for _ in range(rng.randint(0, 9))]
        p.release(r, finished=True)
        fresh = SuffixProposer(max_tree_depth=5, max_cached_requests=3)
        for rid, out in p._cached.items():
            q = _req([0], rid=rid)
            q.output_token_ids += list(out)
            fresh.release(q, finished=True)
        assert _snapshot(p._global) == _snapshot(fresh._global), i
        assert p._global.count == sum(len(o) for o in p._cached.values())
