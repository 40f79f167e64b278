"""The one step-cost vocabulary: what a microbatch costs on each pipeline stage.

A microbatch whose requests compute `n` new tokens on top of `ctx` cached ones costs, on stage s,

    seconds_s = floor_s + token_s * sum(n)
                        + prefill_key_s * sum over chunks (n > 1) of (n * ctx + n * (n + 1) / 2)
                        + decode_key_s * sum over decodes (n == 1) of (ctx + 1)
                        + sample_s * (requests that get logits: decodes and last prompt chunks)

and the pipeline runs at the pace of its slowest stage. `floor` is what a step pays whatever it holds
(the weights' read, launches); a prefill key is compute-bound and a decode key memory-bound, so the two
are priced apart; `sample` (LM head and sampling) is the last stage's. `StepCost` holds one stage's (or
one layer's: `LayerCosts`) coefficients, `PipelineCost` one per stage (what the scheduler, partitioner and
simulator share); `StepCostFit` / `OnlinePipelineCost` fit them online from every `StepResult`'s stage
times by weighted least squares with a weak ridge toward a prior, in two pieces (microbatches with a
chunk; decode-only ones); `LayerCosts` prices any layer split and is fitted back from a measured one
(`fit_layer_costs`). Pure Python: no torch, numpy or clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import astuple, dataclass, fields, replace

from ppserve.sched.output import SchedulerOutput

__all__ = [
    "DECODE_ONLY_WEIGHT",
    "BatchShape",
    "Chunks",
    "Features",
    "LayerCosts",
    "OnlinePipelineCost",
    "PipelineCost",
    "StepCost",
    "StepCostFit",
    "WorkFeatures",
    "attention_keys",
    "features",
    "fit_layer_costs",
    "solve_linear",
    "solve_nonnegative",
]

# Per request in a microbatch: (tokens computed this step, tokens already in its KV cache).
Chunks = Sequence[tuple[int, int]]
# (1, tokens, prefill attention keys, decode keys, sampled tokens): what every coefficient multiplies.
Features = tuple[float, float, float, float, float]
NUM_FEATURES = 5

# What a decode-only microbatch weighs in the scheduler's online fit of the chunked step cost, against 1
# for a microbatch with a prefill chunk; the decode-only ones get a fit of their own besides
# (`OnlinePipelineCost`, `PipelineCost.decode_stages`). A real step is not linear in its tokens: up to
# about the ridge point it costs its floor (the weights' read on a GPU), beyond it each token its compute.
# Decode-only microbatches are most of a run and sit below that knee, so one fit weighing all alike is
# true for them and wrong for the chunks, whose size is what the balanced share decides: it underprices a
# chunk's tokens, cuts prompts into chunks of falling cost, and each fall stalls the decode groups behind
# the longer microbatch. Weighed down, decodes still price what only they show when no chunk runs
# (docs/decisions.md#the-step-costs-two-pieces).
DECODE_ONLY_WEIGHT = 1e-3


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
        # a draft's position gets logits too (the last stage verifies it)
        return cls(tuple(out.chunks()), len(out.sample_request_ids) + out.num_draft_tokens,
                   out.num_prefill_tokens, out.num_decode_tokens)

    @classmethod
    def uniform(cls, num_prefill_tokens: int = 0, num_decode_tokens: int = 0, context: int = 0) -> BatchShape:
        """A shape with one prefill chunk and `num_decode_tokens` decodes of `context` each (tests, tools)."""
        chunks: tuple[tuple[int, int], ...] = ((num_prefill_tokens, 0),) if num_prefill_tokens else ()
        chunks += ((1, context),) * num_decode_tokens
        return cls(chunks, num_decode_tokens, num_prefill_tokens, num_decode_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.chunks)


def features(chunks: Iterable[tuple[int, int]], num_sampled: int) -> Features:
    """The five features of a microbatch (see the module doc); a one-token chunk is priced as a decode."""
    tokens = keys = decode_keys = 0.0
    for n, ctx in chunks:
        tokens += n
        if n == 1:
            decode_keys += ctx + 1
        else:
            keys += attention_keys(n, ctx)
    return 1.0, tokens, keys, decode_keys, float(num_sampled)


class WorkFeatures:
    """A running sum of chunks' features without the floor: what those chunks add to a step on any stage
    (`seconds`), summed once for every stage to price (the step cost is linear in its features)."""

    __slots__ = ("tokens", "prefill_keys", "decode_keys", "sampled")

    def __init__(self) -> None:
        self.tokens = 0
        self.prefill_keys = 0.0
        self.decode_keys = 0
        self.sampled = 0

    def add(self, num_tokens: int, context: int, sampled: bool) -> None:
        """One request's chunk of `num_tokens` after `context` cached tokens (one token: a decode)."""
        self.tokens += num_tokens
        if num_tokens == 1:
            self.decode_keys += context + 1
        else:
            self.prefill_keys += attention_keys(num_tokens, context)
        if sampled:
            self.sampled += 1

    def plus(self, num_tokens: int, context: int, sampled: bool) -> WorkFeatures:
        """A copy with one more chunk added (`add`), this sum unchanged."""
        out = WorkFeatures()
        out.merge(self)
        out.add(num_tokens, context, sampled)
        return out

    def merge(self, other: WorkFeatures) -> None:
        """Add another sum's chunks. The same result as adding them one by one: every feature is a
        whole number (attention keys too: n * ctx + n (n + 1) / 2), so the float sums are exact."""
        self.tokens += other.tokens
        self.prefill_keys += other.prefill_keys
        self.decode_keys += other.decode_keys
        self.sampled += other.sampled

    def seconds(self, cost: StepCost) -> float:
        """What the chunks added so far cost on a stage priced by `cost` (its floor left out), as the
        sum of their `StepCost.chunk_s`."""
        return (cost.token_s * self.tokens + cost.prefill_key_s * self.prefill_keys
                + cost.decode_key_s * self.decode_keys + cost.sample_s * self.sampled)


@dataclass(frozen=True)
class StepCost:
    """Seconds = floor_s + token_s * tokens + prefill_key_s * prefill keys + decode_key_s * decode keys
    + sample_s * sampled tokens: one stage's step (or one layer's, or the LM head's)."""

    floor_s: float = 0.0
    token_s: float = 0.0
    prefill_key_s: float = 0.0
    decode_key_s: float = 0.0
    sample_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"step cost {f.name} must be a finite number >= 0, got {v!r}")

    @classmethod
    def of(cls, coefficients: Sequence[float]) -> StepCost:
        """From (floor, token, prefill key, decode key, sample), negatives clamped to 0: a step never
        gets cheaper by adding work."""
        if len(coefficients) != NUM_FEATURES:
            raise ValueError(f"a step cost has {NUM_FEATURES} coefficients, got {len(coefficients)}")
        return cls(*(max(0.0, float(c)) for c in coefficients))

    @property
    def coefficients(self) -> Features:
        return self.floor_s, self.token_s, self.prefill_key_s, self.decode_key_s, self.sample_s

    def of_features(self, x: Sequence[float]) -> float:
        return math.fsum(c * f for c, f in zip(self.coefficients, x, strict=True))

    def predict(self, shape: BatchShape) -> float:
        return self.of_features(features(shape.chunks, shape.num_sampled))

    def chunk_s(self, num_tokens: int, context: int, sampled: bool) -> float:
        """What one request's chunk of `num_tokens` after `context` cached tokens adds to a step."""
        t = self.token_s * num_tokens + (self.sample_s if sampled else 0.0)
        if num_tokens == 1:
            return t + self.decode_key_s * (context + 1)
        return t + self.prefill_key_s * attention_keys(num_tokens, context)

    def max_tokens(self, seconds: float, context: int, limit: int) -> int:
        """The longest chunk (<= limit, 0 when none) after `context` cached tokens that adds at most
        `seconds` without sampling (a one-token chunk is priced as a decode). Solves
        token_s * n + prefill_key_s * (n * ctx + n (n + 1) / 2) <= seconds."""
        if limit <= 0 or seconds < 0:
            return 0
        if limit == 1 or self.chunk_s(2, context, False) > seconds:
            return 1 if self.chunk_s(1, context, False) <= seconds else 0
        b, c = self.token_s, self.prefill_key_s
        lin = b + c * (context + 0.5)  # the coefficient of n; c / 2 is that of n^2
        if lin <= 0 and c <= 0:
            return limit  # it charges nothing per token
        # The root of (c / 2) n^2 + lin n - seconds, in the form that does not cancel when c is tiny.
        n = 2.0 * seconds / (lin + math.sqrt(lin * lin + 2.0 * c * seconds))
        k = max(2, min(limit, int(n)))  # two tokens fit (checked above)
        # Guard against rounding on either side of the root.
        while k > 2 and self.chunk_s(k, context, False) > seconds:
            k -= 1
        while k < limit and self.chunk_s(k + 1, context, False) <= seconds:
            k += 1
        return k

    def plus(self, other: StepCost) -> StepCost:
        return StepCost(*(a + b for a, b in zip(self.coefficients, other.coefficients, strict=True)))

    def times(self, k: float) -> StepCost:
        return StepCost(*(k * a for a in self.coefficients))

    def to_json(self) -> dict[str, float]:
        return dict(zip((f.name for f in fields(self)), astuple(self), strict=True))

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> StepCost:
        names = [f.name for f in fields(cls)]
        unknown = set(data) - set(names)
        if unknown:
            raise ValueError(f"unknown step-cost keys {sorted(unknown)}; known: {names}")
        try:
            return cls(**{k: float(v) for k, v in data.items()})  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise ValueError(f"not a step cost ({', '.join(names)}): {e}") from None


@dataclass(frozen=True)
class PipelineCost:
    """A `StepCost` per pipeline stage; the pipeline's pace is its slowest stage.

    `decode_stages`, where given, price a microbatch without a prefill chunk (the online fit's second
    piece, `OnlinePipelineCost`: below the knee a step is its floor); `stages` price every other one and
    are what a budget adds chunks with."""

    stages: tuple[StepCost, ...]
    decode_stages: tuple[StepCost, ...] | None = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a pipeline cost needs at least one stage")
        if self.decode_stages is not None and len(self.decode_stages) != len(self.stages):
            raise ValueError(f"{len(self.decode_stages)} decode-only stage costs for {len(self.stages)} "
                             "stages")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_times(self, shape: BatchShape) -> list[float]:
        x = features(shape.chunks, shape.num_sampled)
        stages = self.decode_stages if self.decode_stages is not None and x[2] == 0 else self.stages
        return [s.of_features(x) for s in stages]

    def pace(self, shape: BatchShape) -> float:
        """The predicted time of the slowest stage: how long the pipeline takes per microbatch like this."""
        return max(self.stage_times(shape))

    @property
    def floor_s(self) -> float:
        """The slowest stage's floor: what the smallest microbatch costs the pipeline."""
        return max(s.floor_s for s in self.stages)

    def to_json(self) -> list[dict[str, float]]:
        return [s.to_json() for s in self.stages]

    @classmethod
    def from_json(cls, data: object) -> PipelineCost:
        if not isinstance(data, list):
            raise ValueError(f"a pipeline cost is a list of stage costs, got {type(data).__name__}")
        return cls(tuple(StepCost.from_json(s) for s in data))


def solve_linear(a: Sequence[Sequence[float]], b: Sequence[float],
                 rel_tol: float = 1e-12) -> list[float] | None:
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


def solve_nonnegative(a: Sequence[Sequence[float]], b: Sequence[float],
                      free_hint: Sequence[bool] | None = None) -> list[float] | None:
    """x >= 0 minimizing x.a.x / 2 - b.x for a symmetric positive definite `a`: the least-squares fit
    with non-negative coefficients, given its normal equations (a = XtX, b = Xty). Lawson and Hanson's
    active-set method: add the variable whose gradient most wants to grow, solve on the free set, step
    back to the boundary where a free variable would turn negative. None when a sub-system is singular.

    `free_hint`: the variables free (> 0) at a previous solution of a nearby system, such as the last
    refit of an online fit. When the solve on that set is the optimum (every free value > 0, no fixed
    variable's gradient wants to grow: the optimality conditions) it is returned after one solve instead
    of the several an active-set run from zero takes; otherwise the run starts from zero as without it.

    Why not solve and clamp: with every coefficient free, noise on two nearly collinear columns (a
    token's cost and attention's, over chunks of similar contexts) can send one below zero while the
    other absorbs its share and more; clamping the first to zero keeps the second's excess, and the
    fit then prices a long chunk several times too high. Here the others are refitted without it."""
    n = len(b)
    tol = 1e-12 * max((abs(v) for v in b), default=0.0)
    if free_hint is not None and any(free_hint):
        idx = [i for i in range(n) if free_hint[i]]
        sub = solve_linear([[a[i][j] for j in idx] for i in idx], [b[i] for i in idx])
        if sub is not None and all(v > 0 for v in sub):
            z = [0.0] * n
            for i, v in zip(idx, sub, strict=True):
                z[i] = v
            if all(b[i] - math.fsum(a[i][j] * z[j] for j in idx) <= tol for i in range(n)
                   if not free_hint[i]):
                return z
    x = [0.0] * n
    free = [False] * n
    for _ in range(4 * n):
        grad = [b[i] - math.fsum(a[i][j] * x[j] for j in range(n)) for i in range(n)]
        wants = [i for i in range(n) if not free[i] and grad[i] > tol]
        if not wants:
            return x
        free[max(wants, key=lambda i: grad[i])] = True
        for _ in range(n + 1):  # each pass frees a variable or ends: at most n
            idx = [i for i in range(n) if free[i]]
            sub = solve_linear([[a[i][j] for j in idx] for i in idx], [b[i] for i in idx])
            if sub is None:
                return None
            z = [0.0] * n
            for i, v in zip(idx, sub, strict=True):
                z[i] = v
            if all(z[i] > 0 for i in idx):
                x = z
                break
            # Step from x toward z until the first free variable reaches zero; it leaves the free set.
            step, first = min((x[i] / (x[i] - z[i]), i) for i in idx if z[i] <= 0)
            x = [xi + step * (zi - xi) for xi, zi in zip(x, z, strict=True)]
            for i in idx:
                if i == first or x[i] <= 0.0:
                    free[i], x[i] = False, 0.0
    return x


class StepCostFit:
    """One stage's `StepCost`, fitted online from (microbatch features, measured seconds).

    `forgetting` < 1 weighs old samples down geometrically (0.995: a memory of ~200 microbatches); a
    sample of weight w forgets by `forgetting` ** w, so a piece's memory counts the evidence it was
    given, not the microbatches that passed (the chunk piece's decode-only samples, at
    `DECODE_ONLY_WEIGHT`, barely age it).
    `prior` is used before `min_samples` observations and is the ridge target; the ridge is weak
    (`ridge` times the data's own weight) so data overrules it quickly. Coefficients are >= 0: where
    the free solution has a negative one, the fit is solved again with that constraint
    (`solve_nonnegative`), not clamped.
    Past its first `WARM_UP` samples the solve runs every `refit_every` observations (the sums are
    kept on every one): with the memory of hundreds of microbatches the fit barely moves in between,
    and a solve per stage per step would cost the engine's loop a fraction of a millisecond each time.
    """

    WARM_UP = 128  # samples over which every observation refits: the fit moves fast while it learns

    # Feature scales: a typical microbatch (hundreds of tokens, ~1e5 attention keys, tens of samples).
    # The ridge and the solve work in these units so every column is of order one.
    _SCALE: Features = (1.0, 256.0, 256.0 * 512.0, 64.0 * 1024.0, 64.0)

    def __init__(self, prior: StepCost | None = None, forgetting: float = 0.995, ridge: float = 1e-6,
                 min_samples: int = 8, refit_every: int = 8) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting!r}")
        if ridge < 0 or min_samples < 1 or refit_every < 1:
            raise ValueError(f"need ridge >= 0, min_samples >= 1 and refit_every >= 1, got {ridge!r}, "
                             f"{min_samples!r}, {refit_every!r}")
        self.refit_every = refit_every
        self.prior = prior or StepCost()
        self.forgetting = forgetting
        self.ridge = ridge
        self.min_samples = min_samples
        self.num_samples = 0
        n = NUM_FEATURES
        self._xtx = [[0.0] * n for _ in range(n)]  # weighted sums in scaled units
        self._xty = [0.0] * n
        self._yy = 0.0
        self._cost = self.prior
        self._dirty = False
        self._free_hint: list[bool] | None = None  # which coefficients the last fit left above zero

    def observe(self, x: Sequence[float], seconds: float, weight: float = 1.0) -> None:
        z = self.scaled(x)
        self.observe_scaled(z, [[zi * zj for zj in z] for zi in z], seconds, weight)

    @classmethod
    def scaled(cls, x: Sequence[float]) -> list[float]:
        """Features in the fit's units (`_SCALE`)."""
        return [f / s for f, s in zip(x, cls._SCALE, strict=True)]

    def observe_scaled(self, z: Sequence[float], zz: Sequence[Sequence[float]], seconds: float,
                       weight: float = 1.0) -> None:
        """`observe` with the features already scaled (`z`) and their outer product (`zz`): every stage
        of a pipeline sees the same microbatch, so `OnlinePipelineCost` forms them once. `weight`: what
        the sample counts in the least squares (`OnlinePipelineCost`'s decode-only microbatches)."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return  # a broken measurement teaches nothing
        # A sample is forgotten in proportion to its weight: at the full rate the chunk piece's few
        # chunks would wear out in a few hundred decodes, and it would fit what was left
        # (docs/decisions.md#the-step-costs-two-pieces).
        lam = self.forgetting ** weight  # exactly `forgetting` at weight 1
        for i, zi in enumerate(z):
            self._xty[i] = lam * self._xty[i] + weight * zi * seconds
            row = self._xtx[i]
            for j, zzij in enumerate(zz[i]):
                row[j] = lam * row[j] + weight * zzij
        self._yy = lam * self._yy + weight * seconds * seconds
        self.num_samples += 1
        self._dirty = (self._dirty or self.num_samples % self.refit_every == 0
                       or self.num_samples <= self.min_samples + self.WARM_UP)

    @property
    def calibrated(self) -> bool:
        return self.num_samples >= self.min_samples

    @property
    def cost(self) -> StepCost:
        """The coefficients in force: the prior until calibrated, then the latest fit."""
        if self._dirty:
            self._dirty = False
            if self.calibrated:
                self._cost = self._fit()
        return self._cost

    def normal_equations(self) -> tuple[list[list[float]], list[float]]:
        """The ridge-regularised normal equations `m @ w = v` the fit solves, in the scaled units of `_SCALE`:
        the ridge pulls toward the prior, scaled by the data's own weight so it stays weak."""
        lam = self.ridge * max(self._xtx[0][0], 1e-12)
        prior = [p * s for p, s in zip(self.prior.coefficients, self._SCALE, strict=True)]
        n = NUM_FEATURES
        m = [[self._xtx[i][j] + (lam if i == j else 0.0) for j in range(n)] for i in range(n)]
        v = [self._xty[i] + lam * prior[i] for i in range(n)]
        return m, v

    def _fit(self) -> StepCost:
        m, v = self.normal_equations()
        sol = solve_linear(m, v)
        if sol is not None and min(sol) < 0:
            # Common where a term is absent from the stage's times (no attention cost to speak of at short
            # contexts, a floor the roofline folds into its tokens): the same variables stay at zero from
            # one refit to the next, so the last solution's free set is tried first (one solve, not ~4).
            sol = solve_nonnegative(m, v, self._free_hint)
        if sol is None:
            return self._cost
        self._free_hint = [w > 0 for w in sol]
        return StepCost.of([w / s for w, s in zip(sol, self._SCALE, strict=True)])

    def rms_residual(self) -> float:
        """Weighted RMS of the fit's residuals over the (forgotten-down) samples; 0 before any."""
        w = self._xtx[0][0]
        if w <= 0:
            return 0.0
        c = [k * s for k, s in zip(self.cost.coefficients, self._SCALE, strict=True)]
        # sum (y - x.c)^2 = yy - 2 c.xty + c.XtX.c
        sse = self._yy - 2 * sum(ci * v for ci, v in zip(c, self._xty, strict=True))
        sse += sum(c[i] * self._xtx[i][j] * c[j] for i in range(NUM_FEATURES) for j in range(NUM_FEATURES))
        return math.sqrt(max(0.0, sse) / w)


class OnlinePipelineCost:
    """A `StepCostFit` per stage, fed every microbatch's measured stage times (`StepResult.stage_seconds`):
    the scheduler's live `PipelineCost`. `prior` (a saved profile, a calibration, the roofline) is what
    it predicts before `min_samples` microbatches and what the weak ridge pulls toward.

    With `decode_only_weight` < 1 (the scheduler's default, `DECODE_ONLY_WEIGHT`) the cost has two pieces:
    `fits`, where a decode-only microbatch weighs that much and one with a prefill chunk 1 (what a budget
    sizes chunks with), and `decode_fits`, on decode-only microbatches alone (`PipelineCost.decode_stages`).
    At 1 (an offline fit of a whole run, `sched/partition.py`) every microbatch weighs alike in one piece."""

    def __init__(self, num_stages: int, prior: PipelineCost | None = None, forgetting: float = 0.995,
                 ridge: float = 1e-6, min_samples: int = 8, refit_every: int = 8,
                 decode_only_weight: float = DECODE_ONLY_WEIGHT) -> None:
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages!r}")
        if not 0.0 < decode_only_weight <= 1.0:
            raise ValueError(f"decode_only_weight must be in (0, 1], got {decode_only_weight!r}")
        self._num_stages = num_stages
        self.decode_only_weight = decode_only_weight
        self.forgetting = forgetting
        self.ridge = ridge
        self.min_samples = min_samples
        self.refit_every = refit_every
        self.reset(prior)

    def reset(self, prior: PipelineCost | None = None) -> None:
        """Forget what was fitted and start again from `prior` (e.g. after the layers were re-split)."""
        if prior is not None and prior.num_stages != self._num_stages:
            raise ValueError(f"a prior of {prior.num_stages} stages for a pipeline of {self._num_stages}")
        priors: Sequence[StepCost | None] = prior.stages if prior is not None else (None,) * self._num_stages
        self.fits = [StepCostFit(p, self.forgetting, self.ridge, self.min_samples, self.refit_every)
                     for p in priors]
        # The decode-only piece: fitted on decode-only microbatches alone, at full weight (none where they
        # weigh as much as the others: one fit is then true for both).
        self.decode_fits = [StepCostFit(p, self.forgetting, self.ridge, self.min_samples, self.refit_every)
                            for p in priors] if self.decode_only_weight < 1.0 else []
        self.has_prior = prior is not None
        self._current: PipelineCost | None = None

    @property
    def num_stages(self) -> int:
        return len(self.fits)

    @property
    def calibrated(self) -> bool:
        """Whether predictions mean anything: fitted on enough microbatches, or given a prior."""
        return self.has_prior or all(f.calibrated for f in self.fits)

    def observe(self, shape: BatchShape, stage_seconds: Sequence[float]) -> None:
        """One microbatch's compute seconds per stage; ignored when they cover another pipeline."""
        if len(stage_seconds) != len(self.fits) or not shape.chunks:
            return
        x = features(shape.chunks, shape.num_sampled)
        z = StepCostFit.scaled(x)
        zz = [[zi * zj for zj in z] for zi in z]
        decode_only = x[2] == 0  # no prefill keys: no chunk of more than one token
        weight = self.decode_only_weight if decode_only else 1.0
        for fit, seconds in zip(self.fits, stage_seconds, strict=True):
            fit.observe_scaled(z, zz, seconds, weight)
        if decode_only and self.decode_fits:  # none at full weight
            for fit, seconds in zip(self.decode_fits, stage_seconds, strict=True):
                fit.observe_scaled(z, zz, seconds)
        if any(f._dirty for f in self.fits) or any(f._dirty for f in self.decode_fits):
            self._current = None

    @property
    def current(self) -> PipelineCost:
        if self._current is None:
            # Until the decode-only piece has its own samples the other piece prices every microbatch. Every
            # stage's fit sees every microbatch, so the stages' decode-only fits calibrate together.
            calibrated = bool(self.decode_fits) and self.decode_fits[0].calibrated
            decode = tuple(d.cost for d in self.decode_fits) if calibrated else None
            self._current = PipelineCost(tuple(f.cost for f in self.fits), decode)
        return self._current


@dataclass(frozen=True)
class LayerCosts:
    """The cost of one decoder layer and of what the last stage adds to its layers (final norm, LM head,
    sampling), in the one vocabulary; `pipeline` gives any layer split's `PipelineCost`. The embedding
    lookup on the first stage is a gather, counted as free."""

    layer: StepCost
    head: StepCost

    def stage(self, num_layers: int, is_last: bool) -> StepCost:
        cost = self.layer.times(num_layers)
        return cost.plus(self.head) if is_last else cost

    def pipeline(self, ranges: Sequence[tuple[int, int]]) -> PipelineCost:
        last = len(ranges) - 1
        return PipelineCost(tuple(self.stage(end - start, s == last)
                                  for s, (start, end) in enumerate(ranges)))

    def to_json(self) -> dict[str, dict[str, float]]:
        return {"layer": self.layer.to_json(), "head": self.head.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> LayerCosts:
        try:
            layer, head = data["layer"], data["head"]
        except KeyError as e:
            raise ValueError(f"layer costs need 'layer' and 'head', missing {e}") from None
        if not isinstance(layer, Mapping) or not isinstance(head, Mapping):
            raise ValueError("layer costs: 'layer' and 'head' must be step costs")
        return cls(StepCost.from_json(layer), StepCost.from_json(head))


def fit_layer_costs(stages: PipelineCost, ranges: Sequence[tuple[int, int]],
                    reference: Sequence[float] | None = None) -> LayerCosts:
    """Per-layer and head costs from a pipeline's measured per-stage costs: the non-last stages hold
    decoder layers only (their cost per layer, weighted by their layers, is the layer's), and the head
    is what the last stage costs beyond its own layers at that rate. Needs two stages or more.

    The head is a difference of two fits, taken per coefficient and clamped at zero; where the fits'
    features are nearly collinear (a run whose decodes all have the same batch size: floor, tokens and
    samples move together) the two stages share the same time out differently, and the clamped
    difference can be far off. With `reference` (features) the head's floor is moved so that the head
    costs at the reference what the stages measured there (as far as a floor >= 0 allows), so a split
    priced at the reference sees the head the stages measured."""
    if len(ranges) < 2 or len(ranges) != stages.num_stages:
        raise ValueError(f"fitting layer costs needs two stages or more, one range each; got "
                         f"{stages.num_stages} stages, {len(ranges)} ranges")
    counts = [end - start for start, end in ranges]
    front = sum(counts[:-1])
    total = StepCost()
    for cost in stages.stages[:-1]:
        total = total.plus(cost)
    layer = total.times(1.0 / front)
    head = StepCost.of([t - counts[-1] * c for t, c in
                        zip(stages.stages[-1].coefficients, layer.coefficients, strict=True)])
    if reference is not None:
        exact = stages.stages[-1].of_features(reference) - counts[-1] * layer.of_features(reference)
        head = replace(head, floor_s=max(0.0, head.floor_s + exact - head.of_features(reference)))
    return LayerCosts(layer, head)
