"""A microbatch's step time predicted from its shape, calibrated online from measured stage times.

The model is linear in four features of a microbatch whose requests compute `n` new tokens on top
of `ctx` tokens already in their KV cache:

    seconds = a + b * sum(n) + c * sum over chunks (n > 1) of (n * ctx + n * (n + 1) / 2)
                             + d * sum over decodes (n == 1) of (ctx + 1)

`a` is the fixed cost of a step (kernel launches, weight reads of a memory-bound step), `b` the cost
of a token through the linear layers, `c` the cost of one query-key pair of a prefill chunk's causal
attention (compute-bound: a chunk late in a long prompt costs more than its token count says), `d`
the cost of one cached token a decode reads (memory-bound: a different price per key than `c`). The fit is exponentially weighted least squares with a weak ridge prior, solved on
demand, so it follows drift (warm-up, a changed workload) and never becomes singular when every
microbatch looks alike. Pure Python: no torch, numpy or clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ppserve.sched.output import SchedulerOutput

__all__ = ["BatchShape", "Chunks", "LinearStepCost", "StepCostModel", "attention_keys", "solve_linear"]

# Per request in a microbatch: (tokens computed this step, tokens already in its KV cache).
Chunks = Sequence[tuple[int, int]]


def attention_keys(num_tokens: int, context: int) -> float:
    """Query-key pairs of causal attention for `num_tokens` new tokens after `context` cached ones."""
    return num_tokens * context + num_tokens * (num_tokens + 1) / 2


@dataclass(frozen=True)
class BatchShape:
    """What every step-cost model prices (the scheduler's online fit, the simulator's roofline and profile
    models): per request (new tokens, tokens already in its KV cache), and how many requests get logits."""

    chunks: tuple[tuple[int, int], ...]
    num_sampled: int = 0  # requests that get logits at the end (decodes and last prefill chunks)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @classmethod
    def of(cls, out: SchedulerOutput) -> BatchShape:
        return cls(tuple(out.chunks()), len(out.sample_request_ids), out.num_prefill_tokens, out.num_decode_tokens)

    @classmethod
    def uniform(cls, num_prefill_tokens: int = 0, num_decode_tokens: int = 0, context: int = 0) -> BatchShape:
        """A shape with one prefill chunk and `num_decode_tokens` decodes of `context` each (tests, tools)."""
        chunks: tuple[tuple[int, int], ...] = ((num_prefill_tokens, 0),) if num_prefill_tokens else ()
        chunks += ((1, context),) * num_decode_tokens
        return cls(chunks, num_decode_tokens, num_prefill_tokens, num_decode_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.chunks)


class StepCostModel(Protocol):
    """Predicts a microbatch's time (seconds) from its chunks; learns from measured times."""

    @property
    def calibrated(self) -> bool: ...

    @property
    def base_s(self) -> float:
        """The fixed part of a step: what an empty microbatch would cost."""
        ...

    def marginal_s(self, num_tokens: int, context: int) -> float:
        """What adding one request's chunk of `num_tokens` after `context` cached tokens costs."""
        ...

    def max_tokens(self, seconds: float, context: int, limit: int) -> int:
        """The longest chunk (<= limit) after `context` cached tokens whose marginal cost fits `seconds`."""
        ...

    def predict(self, chunks: Chunks) -> float: ...

    def observe(self, chunks: Chunks, seconds: float) -> None: ...


def _features(chunks: Iterable[tuple[int, int]]) -> tuple[float, float, float, float]:
    tokens = keys = decode_keys = 0.0
    for n, ctx in chunks:
        tokens += n
        if n == 1:
            decode_keys += ctx + 1
        else:
            keys += attention_keys(n, ctx)
    return 1.0, tokens, keys, decode_keys


def solve_linear(a: Sequence[Sequence[float]], b: Sequence[float], rel_tol: float = 1e-12) -> list[float] | None:
    """x with a x = b for a small dense system, by Gaussian elimination with partial pivoting; None when
    singular (a pivot below `rel_tol` times the largest entry). The one solver of ppserve's fits."""
    n = len(b)
    m = [list(row) + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(x) for row in m for x in row[:n]), default=0.0) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= rel_tol * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


class LinearStepCost:
    """seconds = a + b * tokens + c * prefill attention keys + d * decode keys, fitted online.

    `forgetting` < 1 weighs old samples down geometrically (0.995: a memory of ~200 microbatches).
    `prior` holds (a, b, c, d) used before `min_samples` observations and as the ridge target; the
    ridge is weak (`ridge` times a typical feature scale) so data overrules it quickly. Fitted
    coefficients are clamped at >= 0: a step never gets cheaper by adding work.
    """

    # Feature scales: a typical microbatch (hundreds of tokens, ~1e5 attention keys). The ridge
    # penalty and the solve work in these units so all four columns are of order one.
    _SCALE = (1.0, 256.0, 256.0 * 512.0, 64.0 * 1024.0)
    _N = 4

    def __init__(
        self,
        prior: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
        forgetting: float = 0.995,
        ridge: float = 1e-6,
        min_samples: int = 8,
    ) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if ridge < 0 or min_samples < 1:
            raise ValueError(f"need ridge >= 0 and min_samples >= 1, got {ridge!r}, {min_samples!r}")
        self.prior = prior
        self.forgetting = forgetting
        self.ridge = ridge
        self.min_samples = min_samples
        self.num_samples = 0
        self._xtx = [[0.0] * self._N for _ in range(self._N)]  # weighted sums in scaled units
        self._xty = [0.0] * self._N
        self._yy = 0.0
        self._coef = prior
        self._dirty = False

    # ---- fitting -------------------------------------------------------------------------------
    def observe(self, chunks: Chunks, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return  # a broken measurement teaches nothing
        x = [f / s for f, s in zip(_features(chunks), self._SCALE, strict=True)]
        lam = self.forgetting
        for i in range(self._N):
            self._xty[i] = lam * self._xty[i] + x[i] * seconds
            row = self._xtx[i]
            for j in range(self._N):
                row[j] = lam * row[j] + x[i] * x[j]
        self._yy = lam * self._yy + seconds * seconds
        self.num_samples += 1
        self._dirty = True

    @property
    def calibrated(self) -> bool:
        return self.num_samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(a s, b s per token, c s per prefill attention key, d s per decode key) as used for predictions."""
        if self._dirty:
            self._dirty = False
            if self.calibrated:
                self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float, float]:
        # Ridge toward the prior, scaled by the data's own magnitude so it stays weak.
        mag = max(self._xtx[0][0], 1e-12)
        lam = self.ridge * mag
        prior_scaled = [p * s for p, s in zip(self.prior, self._SCALE, strict=True)]
        n = self._N
        m = [[self._xtx[i][j] + (lam if i == j else 0.0) for j in range(n)] for i in range(n)]
        v = [self._xty[i] + lam * prior_scaled[i] for i in range(n)]
        sol = solve_linear(m, v)
        if sol is None:
            return self._coef
        coef = [max(0.0, w / s) for w, s in zip(sol, self._SCALE, strict=True)]
        return coef[0], coef[1], coef[2], coef[3]

    # ---- predictions ---------------------------------------------------------------------------
    @property
    def base_s(self) -> float:
        return self.coefficients[0]

    def marginal_s(self, num_tokens: int, context: int) -> float:
        _, b, c, d = self.coefficients
        if num_tokens == 1:
            return b + d * (context + 1)
        return b * num_tokens + c * attention_keys(num_tokens, context)

    def predict(self, chunks: Chunks) -> float:
        a, b, c, d = self.coefficients
        _, tokens, keys, decode_keys = _features(chunks)
        return a + b * tokens + c * keys + d * decode_keys

    def max_tokens(self, seconds: float, context: int, limit: int) -> int:
        """Solve b*n + c*(n*ctx + n(n+1)/2) <= seconds for the largest integer n in [0, limit]
        (a one-token chunk is priced as a decode)."""
        if limit <= 0 or seconds <= 0:
            return 0
        if limit == 1 or self.marginal_s(2, context) > seconds:
            return 1 if self.marginal_s(1, context) <= seconds else 0
        _, b, c, _ = self.coefficients
        lin = b + c * (context + 0.5)  # coefficient of n; c/2 is the coefficient of n^2
        if c > 0:
            n = (-lin + math.sqrt(lin * lin + 2.0 * c * seconds)) / c
        elif lin > 0:
            n = seconds / lin
        else:
            return limit  # the model charges nothing per token yet
        k = min(limit, max(0, int(n)))
        # Guard against rounding on either side of the root.
        k = max(k, 2)  # two tokens fit (checked above)
        while k > 2 and self.marginal_s(k, context) > seconds:
            k -= 1
        while k < limit and self.marginal_s(k + 1, context) <= seconds:
            k += 1
        return k

    def rms_residual(self) -> float:
        """Weighted RMS of the fit's residuals over the (forgotten-down) samples; 0 before any."""
        w = self._xtx[0][0]
        if w <= 0:
            return 0.0
        coef = [c * s for c, s in zip(self.coefficients, self._SCALE, strict=True)]
        # sum (y - x.c)^2 = yy - 2 c.xty + c.XtX.c
        sse = self._yy - 2 * sum(c * v for c, v in zip(coef, self._xty, strict=True))
        sse += sum(coef[i] * self._xtx[i][j] * coef[j] for i in range(self._N) for j in range(self._N))
        return math.sqrt(max(0.0, sse) / w)
