"""The sampler against torch's and transformers' own sampling: distributions (chi-square on many draws),
top-k / top-p / min-p edges, the sort-free nucleus, seeded reproducibility, greedy unchanged."""

from __future__ import annotations

import pytest
import torch

from ppserve.request import SamplingParams
from ppserve.worker import sampler
from ppserve.worker.sampler import draw, nucleus_threshold, sample, seeded_uniforms
from tests.unit.sampling_stats import chi2_p_value, reference_probs

DRAWS = 20_000  # per distribution: a 3 % deviation of a 5 % token fails the test


def _counts(tokens: list[int] | torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(torch.as_tensor(tokens), minlength=vocab).double()


def _draw_many(logits: torch.Tensor, sp: SamplingParams, draws: int, rows: int = 1000) -> torch.Tensor:
    """`draws` tokens from one row of logits, in batches of `rows` identical rows (independent draws)."""
    batch = logits[None].expand(rows, logits.shape[0])
    return torch.tensor([t for _ in range(draws // rows) for t in sample(batch, [sp] * rows, [0] * rows)[0]])


# 700 tokens: more than one BLOCK of the two-level draw, and not a multiple of it (the padded tail).
CASES = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
         SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, top_k=60, top_p=0.9),
         SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=1.1, top_p=0.95, min_p=0.02)]


@pytest.mark.parametrize("sp", CASES,
                         ids=lambda sp: f"T{sp.temperature}-k{sp.top_k}-p{sp.top_p}-minp{sp.min_p}")
def test_draws_follow_transformers_distribution_and_match_torch_multinomial(sp):
    torch.manual_seed(0)
    vocab = 700
    logits = torch.randn(vocab) * 2.5
    expected = reference_probs(logits, sp)
    ours = _counts(_draw_many(logits, sp, DRAWS), vocab)
    assert ours[expected == 0].sum() == 0, "a filtered-out token was drawn"
    assert chi2_p_value(ours, expected * DRAWS) > 1e-3
    # Two-sample homogeneity against torch's own sampler on the same distribution.
    theirs = _counts(torch.multinomial(expected.float(), DRAWS, replacement=True), vocab)
    pooled = (ours + theirs) / (2 * DRAWS)
    both_obs, both_exp = torch.cat([ours, theirs]), torch.cat([pooled, pooled]) * DRAWS
    assert chi2_p_value(both_obs, both_exp) > 1e-3


def test_the_full_vocabulary_draw_over_many_blocks():
    """A 49,152-token vocabulary (192 blocks): block frequencies and the tokens of one heavy block."""
    torch.manual_seed(1)
    vocab = 49_152
    logits = torch.randn(vocab) * 1.5
    draws = 8000
    tokens = _draw_many(logits, SamplingParams(temperature=1.0), draws, rows=500)
    expected = torch.softmax(logits.double(), -1)
    by_block = expected.view(-1, sampler.BLOCK).sum(-1)
    assert chi2_p_value(_counts(tokens // sampler.BLOCK, vocab // sampler.BLOCK), by_block * draws) > 1e-3
    top = expected.topk(30).indices
    observed = torch.stack([(tokens == t).sum() for t in top]).double()
    assert chi2_p_value(torch.cat([observed, draws - observed.sum()[None]]),
                         torch.cat([expected[top], 1 - expected[top].sum()[None]]) * draws) > 1e-3


def _sorted_nucleus_threshold(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The reference: probabilities in float64, sorted, the prefix whose mass before each token is under
    top_p."""
    probs = weights.double() / weights.double().sum(-1, keepdim=True)
    sorted_probs, order = probs.sort(-1, descending=True)
    last = ((sorted_probs.cumsum(-1) - sorted_probs) < top_p[:, None].double()).sum(-1) - 1
    return weights.gather(1, order).gather(1, last[:, None])[:, 0]


@pytest.mark.parametrize("find",
                         [nucleus_threshold, sampler._nucleus_threshold_radix,
                          sampler._nucleus_threshold_cpu])
def test_nucleus_threshold_equals_the_sorted_prefix(find):
    """Both ways of finding the threshold (the radix search a GPU runs, the bin-then-sort a CPU runs)."""
    torch.manual_seed(2)
    for vocab in (2, 37, 700, 5000):
        logits = torch.randn(16, vocab) * torch.linspace(0.1, 8, 16)[:, None]
        top_p = torch.rand(16) * 0.98 + 0.01
        weights = torch.exp(logits - logits.amax(-1, keepdim=True))
        assert torch.equal(find(weights, top_p), _sorted_nucleus_threshold(weights, top_p))


def _kept(weights: torch.Tensor, threshold: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many tokens a threshold keeps per row, and their mass."""
    mask = weights >= threshold[:, None]
    return mask.sum(-1), torch.where(mask, weights, 0.0).double().sum(-1)


@pytest.mark.parametrize("find", [sampler._nucleus_threshold_radix, sampler._nucleus_threshold_cpu])
def test_nucleus_threshold_over_the_default_vocabulary(find):
    """At 49,152 tokens the float32 histogram's rounding may move the nucleus's edge by one token, in a
    rare row where the mass up to that token is within ~1e-5 of top_p. Ties and a NaN row stay in range."""
    torch.manual_seed(5)
    for scale in (0.5, 1.0, 3.0, 6.0):
        weights = torch.exp(torch.randn(64, 49_152) * scale)
        weights /= weights.amax(-1, keepdim=True)
        top_p = torch.rand(64) * 0.98 + 0.01
        got, expected = find(weights, top_p), _sorted_nucleus_threshold(weights, top_p)
        moved = got != expected
        assert moved.float().mean() <= 0.1

        (n_got, mass_got), (n_expected, mass_expected) = _kept(weights, got), _kept(weights, expected)
        assert ((n_got - n_expected).abs() <= 1).all()
        total, target = weights.double().sum(-1), top_p.double() * weights.double().sum(-1)
        near = torch.minimum((mass_got - target).abs(), (mass_expected - target).abs()) <= 1e-5 * total
        assert near[moved].all()
    tied = torch.ones(3, 1000)
    assert torch.equal(find(tied, torch.tensor([0.5, 0.999, 0.01])), torch.ones(3))  # every tie stays in
    nan = torch.rand(2, 1000)
    nan[1, 7] = float("nan")
    got = find(nan, torch.tensor([0.9, 0.9]))
    assert got[0] == _sorted_nucleus_threshold(nan[:1], torch.tensor([0.9]))[0]


def test_top_k_and_top_p_edges():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0, 4.0]]).repeat(400, 1)
    n = logits.shape[0]
    one = sample(logits, [SamplingParams(temperature=2.0, top_k=1)] * n, [0] * n)[0]
    assert set(one) == {1}  # top-k 1 is greedy at any temperature
    tiny = sample(logits, [SamplingParams(temperature=2.0, top_p=1e-6)] * n, [0] * n)[0]
    assert set(tiny) == {1}  # the token crossing the nucleus's mass stays, so the top one always does
    both = sample(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.5)] * n, [0] * n)[0]
    assert set(both) == {1, 2}  # p(1) ~ 0.5 within the top 3: the nucleus ends at token 2
    wide = sample(logits, [SamplingParams(temperature=1.0, top_k=1000, seed=5)] * n, list(range(n)))[0]
    full = sample(logits, [SamplingParams(temperature=1.0, seed=5)] * n, list(range(n)))[0]
    assert wide == full  # a top-k at or above the vocabulary is no top-k at all
    assert set(sample(logits, [SamplingParams(temperature=1.0, min_p=1.0)] * n, [0] * n)[0]) == {1}


def test_tokens_of_zero_probability_are_never_drawn():
    """-inf logits (min_tokens' masked stops), padded block tails and the last uniform before 1."""
    logits = torch.full((3, 300), float("-inf"))
    logits[:, 7] = 0.0
    logits[:, 255] = 1.0  # the last token of the first block
    n = 500
    tokens = sample(logits.repeat(n, 1)[:n], [SamplingParams(temperature=1.0)] * n, [0] * n)[0]
    assert set(tokens) == {7, 255}
    weights = torch.zeros(2, 600)
    weights[:, 3] = 1.0
    weights[:, 300] = 2.0
    last = torch.tensor([1 - 2.0**-53, 0.0], dtype=torch.float64)
    assert draw(weights, last).tolist() == [300, 3]


def test_seeded_rows_are_reproducible_whatever_shares_the_batch():
    torch.manual_seed(3)
    logits = torch.randn(6, 3000)
    seeded = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=40, seed=12),
              SamplingParams(temperature=1.0, top_p=0.9, seed=13)]
    alone = [sample(logits[i:i + 1], [sp], [4])[0][0] for i, sp in enumerate(seeded)]
    crowd_params = [*seeded, SamplingParams(), SamplingParams(temperature=1.0, top_k=300),
                    SamplingParams(temperature=0.5, top_p=0.5)]
    for _ in range(3):
        crowd = sample(logits, crowd_params, [4, 4, 4, 0, 9, 2])[0]
        assert crowd[:3] == alone
    reversed_batch = sample(logits[[5, 4, 3, 2, 1, 0]], crowd_params[::-1], [2, 9, 0, 4, 4, 4])[0]
    assert reversed_batch[3:][::-1] == alone
    # Another position of the same seed draws afresh.
    positions = sample(logits[:1].repeat(64, 1), [seeded[0]] * 64, list(range(64)))[0]
    assert len(set(positions)) > 10


def test_seeded_uniforms_are_uniform_and_distinct():
    seeds = torch.arange(20_000, dtype=torch.int64)
    u = seeded_uniforms(seeds, torch.zeros_like(seeds))
    assert u.min() >= 0 and u.max() < 1 and len(set(u.tolist())) == len(u)
    counts = torch.histc(u.float(), bins=20, min=0, max=1).double()
    assert chi2_p_value(counts, torch.full((20,), len(u) / 20.0)) > 1e-3
    # Neighbouring (seed, position) pairs are not the same stream shifted.
    assert not torch.equal(seeded_uniforms(seeds[1:], torch.zeros_like(seeds[1:])),
                           seeded_uniforms(seeds[:-1], torch.ones_like(seeds[:-1])))
    huge = seeded_uniforms(torch.tensor([sampler._as_int64(2**80 + 5)]), torch.tensor([0]))
    assert 0 <= float(huge) < 1


def test_greedy_rows_are_the_argmax_bit_for_bit():
    torch.manual_seed(4)
    logits = torch.randn(8, 49_152)
    logits[2, 100] = logits[2, 200] = logits[2].max() + 1  # a tie: the first index wins
    logits[5, 333] = float("nan")  # a NaN wins, as in torch.argmax
    expected = logits.argmax(-1).tolist()
    assert sample(logits, [SamplingParams()] * 8, [0] * 8)[0] == expected
    mixed = [SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, top_p=0.9) for i in range(8)]
    tokens = sample(logits, mixed, [0] * 8)[0]
    assert tokens[0::2] == expected[0::2]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="output positions"):
        sample(torch.zeros(2, 10), [SamplingParams(), SamplingParams()], [0])
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)


@pytest.mark.gpu
def test_sampling_on_cuda_needs_no_host_sync_until_the_ids():
    device = torch.device("cuda")
    logits = torch.randn(64, 49_152, device=device)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, seed=2), SamplingParams()] * 16
    sample(logits, params, list(range(64)))  # warm the kernels and the pinned allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = sampler._sampled_ids(logits, params, list(range(64)))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu = sampler._sampled_ids(logits.cpu(), params, list(range(64)))
    got = ids.tolist()
    assert got[3::4] == logits[3::4].argmax(-1).tolist()
    assert got[1::4] == cpu.tolist()[1::4] and got[2::4] == cpu.tolist()[2::4]  # seeded: the same on both
