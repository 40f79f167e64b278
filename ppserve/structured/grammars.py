"""The compile cache: a request's grammar compiled off the caller's thread, once per constraint and
tokenizer, with a time limit.

The engine compiles at admission, before a request reaches the scheduler (a grammar that fails or
times out is the request's 400, and nothing else waits on it); the last stage compiles the same key in
its own process when the request first arrives there, in the background, and needs it only at the
request's first sampled token. In one process (the in-process executor) both share one cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from ppserve.structured.backend import GrammarBackend, Matcher, build_backend
from ppserve.structured.spec import GrammarError, StructuredOutputs

DEFAULT_TIMEOUT_S = 30.0
MAX_ENTRIES = 512  # compiled grammars kept (least recently used dropped first)


@dataclass
class CompileStats:
    compiles: int = 0  # grammars compiled (cache misses that finished)
    hits: int = 0  # requests whose grammar was cached (or already compiling)
    failures: int = 0
    compile_s: float = 0.0  # seconds spent compiling, all compiles together


class GrammarCache:
    """Compiled grammars by constraint, for one tokenizer. `submit` starts (or finds) a compile and
    returns its future; `get` waits for it, at most `timeout_s`, and raises GrammarError when it
    failed or took too long. The backend itself is built lazily, on the compile thread."""

    def __init__(self, make_backend: Callable[[], GrammarBackend], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_entries: int = MAX_ENTRIES) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], Future[object]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ppserve-grammar")
        self.stats = CompileStats()
        # each finished compile's seconds, drained by /metrics (bounded: nothing may drain it)
        self.compile_seconds: deque[float] = deque(maxlen=4096)

    @property
    def backend(self) -> GrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def warm(self) -> Future[GrammarBackend]:
        """Build the backend (the tokenizer's vocabulary index) on the compile thread now, so the first
        constrained request does not wait for it."""
        return self._pool.submit(lambda: self.backend)

    def submit(self, spec: StructuredOutputs, count_hit: bool = True) -> Future[object]:
        """The compile's future, started now unless cached or under way (a hit, counted unless told not to:
        the last stage's lookup of a request the engine compiled in the same process is not a new hit)."""
        key = spec.key
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self._entries.move_to_end(key)
                self.stats.hits += count_hit
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._entries[key] = fut
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputs) -> object:
        backend = self.backend
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(spec)
        except GrammarError:
            with self._lock:
                self.stats.failures += 1
                self._entries.pop(spec.key, None)  # not cached: the next request gets its own message
            raise
        seconds = time.perf_counter() - t0
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_s += seconds
            self.compile_seconds.append(seconds)
        return compiled

    def get(self, spec: StructuredOutputs, timeout_s: float | None = None, count_hit: bool = True) -> object:
        """The compiled grammar, waiting for it; GrammarError when it fails or exceeds the limit."""
        fut = self.submit(spec, count_hit)
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            return fut.result(timeout=limit)
        except FutureTimeout:
            raise GrammarError(f"structured_outputs.{spec.kind} took more than {limit:g} s to compile "
                               "(structured.compile_timeout_s)") from None

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        return self.backend.matcher(self.get(spec))

    def drain_compile_seconds(self) -> list[float]:
        with self._lock:
            out = list(self.compile_seconds)
            self.compile_seconds.clear()
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_shared: dict[tuple[str, int, tuple[int, ...]], GrammarCache] = {}
_shared_lock = threading.Lock()


def shared_cache(model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 tokenizer: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> GrammarCache:
    """The process's cache for this model's tokenizer: the engine and an in-process last stage share
    it. `tokenizer` saves loading it again where the caller has it."""
    key = (str(model_dir), int(vocab_size), tuple(stop_token_ids))
    with _shared_lock:
        cache = _shared.get(key)
        if cache is None:
            def make() -> GrammarBackend:
                tok = tokenizer
                if tok is None:
                    from transformers import AutoTokenizer

                    tok = AutoTokenizer.from_pretrained(str(model_dir))
                return build_backend(tok, vocab_size, stop_token_ids)

            cache = _shared[key] = GrammarCache(make, timeout_s=timeout_s)
        elif tokenizer is not None and cache._backend is None:
            cache._make_backend = lambda: build_backend(tokenizer, vocab_size, stop_token_ids)
        cache.timeout_s = timeout_s
        return cache


def caches() -> list[GrammarCache]:
    """Every cache `shared_cache` has built in this process (for the metrics)."""
    with _shared_lock:
        return list(_shared.values())


def has_tokenizer(model_dir: str) -> bool:
    """Whether a model directory carries a tokenizer (structured outputs need one)."""
    from pathlib import Path

    return any((Path(model_dir) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model"))
