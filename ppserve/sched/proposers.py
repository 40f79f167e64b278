"""Model-free draft proposers for speculative decoding: prompt lookup (`ngram`), suffix decoding (`suffix`).

A proposer reads a request's own tokens (prompt followed by outputs) and guesses up to k tokens that come
next; the model then verifies them in one step. Neither needs a draft model, so both run in the scheduler
and stay pure Python. Tokens only ever grow by appended outputs, so each proposer keeps per-request state
keyed by request id, remembers how many tokens it has indexed, and indexes only the new ones: a call costs
the new tokens plus the proposal, never a pass over the whole sequence.

`suffix` is written here rather than wrapping Snowflake's arctic-inference: that package's cache needs numpy
and a compiled extension, which this package must not import. It follows the same rules (SuffixDecoding):
bounded-depth suffix tries with counts, one per live request and one over the outputs of recently finished
requests, a greedy path whose probability is the product of child/parent count ratios, and the best-scoring
match length rather than simply the longest (the longest match in a depth-capped trie leaves no room to
extend).
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ppserve.request import Request

__all__ = ["PROPOSERS", "NgramProposer", "Proposer", "SuffixProposer", "make_proposer"]


def _tokens(req: Request, start: int, stop: int) -> list[int]:
    """Tokens [start, stop) of prompt + outputs, without building the whole concatenation."""
    prompt, out = req.prompt_token_ids, req.output_token_ids
    p = len(prompt)
    if stop <= p:
        return prompt[start:stop]
    if start >= p:
        return out[start - p:stop - p]
    return prompt[start:] + out[:stop - p]


def _length(req: Request) -> int:
    return len(req.prompt_token_ids) + len(req.output_token_ids)


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


class Proposer(ABC):
    """Proposes draft tokens for a request from its own tokens (prompt followed by outputs)."""

    @abstractmethod
    def propose(self, req: Request, k: int) -> list[int]:
        """At most k draft tokens to follow the request's tokens; [] when there are none."""

    def release(self, req: Request, finished: bool) -> None:  # noqa: B027 (a no-op default)
        """The request ended (finished: completed normally, its output may be cached) or was dropped."""


@dataclass
class _NgramState:
    indexed: int = 0  # the sequence length the index reflects
    # One dict per n (min..max): n-gram -> its latest start among those followed by at least one token.
    index: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramProposer(Proposer):
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    n runs from prompt_lookup_max down to prompt_lookup_min and the first n with a match wins (a longer
    context is a better predictor). The index maps each n-gram to its latest start among those followed by
    a token, i.e. ending before the last token, so the current suffix never matches itself; an earlier
    occurrence overlapping the suffix is allowed (it is what a repeating run looks like).
    """

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 2) -> None:
        _check_int("prompt_lookup_min", prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min
        self._states: dict[str, _NgramState] = {}

    def _state(self, req: Request) -> _NgramState:
        st = self._states.get(req.request_id)
        length = _length(req)
        if st is None or st.indexed > length:  # new request, or a reused id: start over
            st = _NgramState(index=[{} for _ in range(self.prompt_lookup_min, self.prompt_lookup_max + 1)])
            self._states[req.request_id] = st
        if length > st.indexed:
            # New n-grams end (exclusive) at e in [indexed, length - 1]; read back max - 1 older tokens.
            base = max(0, st.indexed - self.prompt_lookup_max)
            window = _tokens(req, base, length)
            lo = self.prompt_lookup_min
            for e in range(max(st.indexed, lo), length):
                for n in range(lo, min(self.prompt_lookup_max, e) + 1):
                    st.index[n - lo][tuple(window[e - n - base:e - base])] = e - n
            st.indexed = length
        return st

    def propose(self, req: Request, k: int) -> list[int]:
        st = self._state(req)
        if k <= 0:
            return []
        length = st.indexed
        lo = self.prompt_lookup_min
        top = min(self.prompt_lookup_max, length - 1)
        if top < lo:
            return []
        tail = _tokens(req, length - top, length)
        for n in range(top, lo - 1, -1):
            start = st.index[n - lo].get(tuple(tail[top - n:]))
            if start is not None:
                return _tokens(req, start + n, min(start + n + k, length))
        return []

    def release(self, req: Request, finished: bool) -> None:
        self._states.pop(req.request_id, None)


class _Node:
    """A trie node: the token on the edge into it, how many times its path occurs, children by token."""

    __slots__ = ("best", "children", "count", "depth", "token")

    def __init__(self, token: int, depth: int) -> None:
        self.token = token
        self.depth = depth
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.best: _Node | None = None  # the most frequent child (earliest on ties)

    def recompute_best(self) -> None:
        self.best = max(self.children.values(), key=lambda c: c.count, default=None)


def _feed(active: list[_Node], root: _Node, token: int, depth: int, grow: bool) -> list[_Node]:
    """Advance the nodes of the sequence's suffixes (root first, by depth) by one token.

    grow: insert (create nodes, count the new occurrences); otherwise only follow paths that exist.
    """
    nxt = [root]
    if grow:
        root.count += 1
    for node in active:
        if node.depth >= depth:
            continue
        child = node.children.get(token)
        if child is None:
            if not grow:
                continue
            child = node.children[token] = _Node(token, node.depth + 1)
        if grow:
            child.count += 1
            if node.best is None or child.count > node.best.count:
                node.best = child
        nxt.append(child)
    return nxt


@dataclass
class _SuffixState:
    root: _Node  # the request's own trie over prompt + outputs
    active: list[_Node]  # its nodes for the sequence's suffixes (lengths 0..depth)
    indexed: int = 0
    g_active: list[_Node] = field(default_factory=list)  # the same suffixes matched in the global trie
    g_version: int = -1  # the global trie's version g_active was computed against
    g_fed: int = 0  # the sequence length g_active reflects


class SuffixProposer(Proposer):
    """Suffix decoding: continue the sequence along the most frequent path after a matching suffix.

    Each live request has a suffix trie (depth max_tree_depth) over its prompt and outputs; one global trie
    holds the outputs of the last max_cached_requests requests that finished normally (the oldest evicted,
    its counts removed). For every suffix length m that matches a trie path, the draft follows the most
    frequent child while the path probability (the product of child/parent counts) stays >= min_token_prob,
    for at most min(k, ceil(max_spec_factor * m)) tokens; the draft with the highest score (the sum of its
    path probabilities; ties go to the longer match, then to the request's own trie) wins. Memory is bounded
    by the depth cap and the cache cap.
    """

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        _check_int("max_tree_depth", max_tree_depth, 1)
        _check_int("max_cached_requests", max_cached_requests, 0)  # 0: no global cache
        if (not isinstance(max_spec_factor, (int, float)) or not math.isfinite(max_spec_factor)
                or max_spec_factor <= 0):
            raise ValueError(f"max_spec_factor must be a finite number > 0, got {max_spec_factor!r}")
        if not isinstance(min_token_prob, (int, float)) or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob!r}")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self._states: dict[str, _SuffixState] = {}
        self._global = _Node(-1, 0)
        self._version = 0  # bumped whenever the global trie changes
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # finished outputs, oldest first

    # --- the global cache ---

    def _insert_global(self, tokens: tuple[int, ...]) -> None:
        active = [self._global]
        for t in tokens:
            active = _feed(active, self._global, t, self.max_tree_depth, grow=True)

    def _evict_global(self, tokens: tuple[int, ...]) -> None:
        root = self._global
        root.count -= len(tokens)
        for i in range(len(tokens)):
            node = root
            for t in tokens[i:i + self.max_tree_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:  # its subtree counted only this path: drop it whole
                    del node.children[t]
                    if node.best is child:
                        node.recompute_best()
                    break
                if node.best is child:
                    node.recompute_best()
                node = child

    # --- proposing ---

    def _state(self, req: Request) -> _SuffixState:
        st = self._states.get(req.request_id)
        length = _length(req)
        if st is None or st.indexed > length:
            root = _Node(-1, 0)
            st = _SuffixState(root=root, active=[root])
            self._states[req.request_id] = st
        if length > st.indexed:
            for t in _tokens(req, st.indexed, length):
                st.active = _feed(st.active, st.root, t, self.max_tree_depth, grow=True)
            st.indexed = length
        if st.g_version != self._version or length - st.g_fed > self.max_tree_depth:
            st.g_active, st.g_fed, st.g_version = [self._global], max(0, length - self.max_tree_depth), \
                self._version
        if length > st.g_fed:
            for t in _tokens(req, st.g_fed, length):
                st.g_active = _feed(st.g_active, self._global, t, self.max_tree_depth, grow=False)
            st.g_fed = length
        return st

    def _best_draft(self, nodes: list[_Node], k: int) -> tuple[float, list[int]]:
        best_score, best = 0.0, []
        for node in nodes:  # by depth, shortest match first
            m = node.depth
            if m == 0 or node.best is None:
                continue
            limit = min(k, math.ceil(self.max_spec_factor * m))
            draft: list[int] = []
            prob, score = 1.0, 0.0
            while len(draft) < limit:
                child = node.best
                if child is None:
                    break
                prob *= child.count / node.count
                if prob < self.min_token_prob:
                    break
                draft.append(child.token)
                score += prob
                node = child
            if draft and score >= best_score:
                best_score, best = score, draft
        return best_score, best

    def propose(self, req: Request, k: int) -> list[int]:
        st = self._state(req)
        if k <= 0:
            return []
        own_score, own = self._best_draft(st.active, k)
        glob_score, glob = self._best_draft(st.g_active, k)
        return glob if glob_score > own_score else own

    def release(self, req: Request, finished: bool) -> None:
        self._states.pop(req.request_id, None)
        if not finished or self.max_cached_requests == 0:
            return
        rid = req.request_id
        old = self._cached.pop(rid, None)
        if old is not None:  # a reused id: its earlier output goes first
            self._evict_global(old)
        out = tuple(req.output_token_ids)
        self._cached[rid] = out
        self._insert_global(out)
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self._evict_global(evicted)
        self._version += 1


PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}


def make_proposer(method: str, **options: Any) -> Proposer:
    """The proposer for `method` ("ngram" or "suffix"); ValueError for another method or a bad option."""
    cls = PROPOSERS.get(method)
    if cls is None:
        raise ValueError(f"unknown speculative method {method!r}; valid methods: "
                         f"{', '.join(sorted(PROPOSERS))}")
    valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown options for {method!r}: {', '.join(unknown)}; valid options: "
                         f"{', '.join(valid)}")
    return cls(**options)
