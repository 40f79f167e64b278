"""Speculative verification (`rejection.speculative_sample`) against the exact target distributions:
greedy prefixes and corrections, chi-square of many replicated requests against the autoregressive
probabilities (per top-k / top-p / min-p / penalties group), seeded reproducibility and agreement with
`sample`, log-probabilities from the raw rows, shape checks, and the one allowed host read."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from ppserve.request import SamplingParams
from ppserve.worker.host_sync import step_guard
from ppserve.worker.rejection import speculative_sample
from ppserve.worker.sampler import apply_penalties, sample, target_weights, top_logprobs
from tests.unit.sampling_stats import chi2_p_value, reference_probs

REPLICAS = 20_000  # copies of one request in one call: the draws the chi-square tests see
LEVEL = 1e-4  # p-values below this fail (the torch seed is fixed: the outcome is deterministic)


def _stops(sp: SamplingParams, stop_ids: Sequence[int]) -> tuple[int, ...]:
    return sp.stop_token_ids if sp.ignore_eos else (*stop_ids, *sp.stop_token_ids)


def _row_targets(rows: torch.Tensor, sp: SamplingParams, drafts: Sequence[int],
                 history: tuple[Sequence[int], int], stop_ids: Sequence[int]) -> list[torch.Tensor]:
    """p_j for each row j: penalties with the history followed by drafts[:j], then the warpers."""
    ids, prompt = history
    out = []
    for j in range(len(drafts) + 1):
        row = apply_penalties(rows[j:j + 1], [sp], [([*ids, *drafts[:j]], prompt)], [_stops(sp, stop_ids)])[0]
        out.append(reference_probs(row, sp))
    return out


def _replicate(rows: torch.Tensor, sp: SamplingParams | list[SamplingParams], drafts: list[int],
               history: tuple[Sequence[int], int], stop_ids: Sequence[int], n: int = REPLICAS,
               position: int = 3) -> list[list[int]]:
    params = sp if isinstance(sp, list) else [sp] * n
    tokens, _ = speculative_sample(rows.repeat(n, 1), params, [drafts] * n, [position] * n, [history] * n,
                                   stop_ids)
    return tokens


# ---- greedy -------------------------------------------------------------------------------------------
def test_greedy_keeps_the_matching_prefix_and_corrects_or_adds_a_bonus():
    torch.manual_seed(0)
    vocab = 50
    rows_a, rows_b, rows_c = torch.randn(4, vocab), torch.randn(3, vocab), torch.randn(1, vocab)
    best_a, best_b = rows_a.argmax(-1).tolist(), rows_b.argmax(-1).tolist()
    wrong = (best_a[2] + 1) % vocab
    drafts = [[best_a[0], best_a[1], wrong], [best_b[0], best_b[1]], []]
    logits = torch.cat([rows_a, rows_b, rows_c])
    params = [SamplingParams()] * 3
    tokens, logprobs = speculative_sample(logits, params, drafts, [0, 5, 9])
    assert tokens == [best_a[:3], best_b, sample(rows_c, [SamplingParams()], [9])[0]]
    assert logprobs == [None, None, None]
    # A first-row miss emits only the correction; a tie goes to the first maximum.
    rows_a[0, 7] = rows_a[0, 9] = rows_a[0].max() + 1
    assert speculative_sample(rows_a[:2], [SamplingParams()], [[9]], [0])[0] == [[7]]
    assert speculative_sample(rows_a[:2], [SamplingParams()], [[7]], [0])[0] == [[7, best_a[1]]]
    # Greedy rows sharing a call with sampled ones give the same tokens.
    mixed = speculative_sample(torch.cat([logits, rows_c]), [*params, SamplingParams(temperature=1.0)],
                               [*drafts, []], [0, 5, 9, 0])[0]
    assert mixed[:3] == tokens


def _sequential_greedy(rows: torch.Tensor, sp: SamplingParams, drafts: Sequence[int],
                       history: tuple[list[int], int], position: int, stop_ids: Sequence[int]) -> list[int]:
    """The reference: sample() row by row with the extended histories, stopping at the first miss."""
    ids, prompt = history
    out: list[int] = []
    for j in range(len(drafts) + 1):
        tok = sample(rows[j:j + 1], [sp], [position + j], [([*ids, *drafts[:j]], prompt)], stop_ids)[0][0]
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return out


def test_greedy_penalties_and_min_tokens_use_each_rows_own_history():
    torch.manual_seed(1)
    vocab, stop = 20, 3
    rows = torch.randn(4, vocab)
    history = ([1, 2, 4, 5], 3)  # one output so far: token 5
    # min_tokens=3: rows 0 and 1 (1 and 2 outputs) keep the stop id out, rows 2 and 3 do not.
    sp = SamplingParams(repetition_penalty=4.0, presence_penalty=1.5, min_tokens=3)
    rows[:, stop] = 10.0  # the stop id is every row's raw maximum
    rows[:3, 11] = 9.0  # the best after the stop id, until a row's history holds it
    drafts = [11, 11, stop]
    want = _sequential_greedy(rows, sp, drafts, history, 1, [stop])
    got = speculative_sample(rows, [sp], [drafts], [1], [history], [stop])[0][0]
    assert got == want
    assert got[0] == 11 and got[1] not in (11, stop)  # row 1 saw the draft in its history; min_tokens held
    # All drafts accepted, then the bonus row; compared with sample() row by row again.
    accepted = _sequential_greedy(rows, sp, [], history, 1, [stop])
    for _ in range(3):
        accepted = _sequential_greedy(rows, sp, accepted, history, 1, [stop])
    full = accepted[:3]
    want = _sequential_greedy(rows, sp, full, history, 1, [stop])
    assert len(want) == 4
    assert speculative_sample(rows, [sp], [full], [1], [history], [stop])[0][0] == want
    assert stop in want[2:]  # past min_tokens the stop id (the raw maximum) comes back
    with pytest.raises(ValueError, match="histories"):
        speculative_sample(rows, [sp], [full], [1])


# ---- the target distribution, exactly -------------------------------------------------------------------
VOCAB = 8
PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.6, presence_penalty=0.7,
                           frequency_penalty=0.4, min_tokens=3)
CASES = [  # (params, drafts by rank in each row's target: 0 the most likely; -1 a token of probability zero)
    (SamplingParams(temperature=0.8), [1, 0, 2]),
    (SamplingParams(temperature=1.0, top_k=4), [0, -1, 1]),
    (SamplingParams(temperature=1.2, top_p=0.7), [1, 0, 0]),
    (SamplingParams(temperature=1.0, min_p=0.15), [0, 1, 0]),
    (SamplingParams(temperature=0.9, top_k=6, top_p=0.85, min_p=0.05), [2, 0, 1]),
    (PENALISED, [0, 0, 1]),
    (SamplingParams(temperature=1.0, top_k=5, seed=0), [1, 1, 0]),  # seeds 0 .. REPLICAS - 1
]


def _draft_by_rank(p: torch.Tensor, rank: int) -> int:
    if rank < 0:
        return int((p == 0).nonzero()[0])
    return int(p.argsort(descending=True)[rank])


@pytest.mark.parametrize("sp, ranks", CASES,
                         ids=lambda c: (f"T{c.temperature}-k{c.top_k}-p{c.top_p}-minp{c.min_p}"
                                        f"-pen{c.processes_logits}-seed{c.seed}")
                         if isinstance(c, SamplingParams) else str(c))
def test_emitted_tokens_follow_the_target_exactly(sp, ranks):
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(len(ranks) + 1, VOCAB, generator=gen) * 1.5
    history, stop_ids = ([0, 5, 2, 6, 1], 3), [4]  # two outputs so far: 6 and 1
    if sp.processes_logits:
        rows[:2, 4] = rows[:2].max() + 0.5  # the stop id leads the rows where min_tokens blocks it
    drafts: list[int] = []
    for rank in ranks:  # draft j from row j's own target, which depends on drafts[:j]
        p = _row_targets(rows, sp, drafts, history, stop_ids)[len(drafts)]
        drafts.append(_draft_by_rank(p, rank))
    p = _row_targets(rows, sp, drafts, history, stop_ids)
    params = ([SamplingParams(temperature=sp.temperature, top_k=sp.top_k, seed=i) for i in range(REPLICAS)]
              if sp.seed is not None else sp)
    torch.manual_seed(0)
    tokens = _replicate(rows, params, drafts, history, stop_ids)

    # The first token: p_0 exactly.
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=VOCAB).double()
    assert chi2_p_value(first, p[0] * REPLICAS) > LEVEL
    # The first two: (d0, t) with p_0(d0) p_1(t); a lone t != d0 (rejected at row 0) with p_0(t).
    pairs = torch.zeros(2 * VOCAB, dtype=torch.float64)
    for t in tokens:
        pairs[t[1] if len(t) > 1 else VOCAB + t[0]] += 1
    lone = p[0].clone()
    lone[drafts[0]] = 0.0
    assert chi2_p_value(pairs, torch.cat([p[0][drafts[0]] * p[1], lone]) * REPLICAS) > LEVEL
    # The number of drafts accepted: prod_{j<k} p_j(d_j) (1 - p_k(d_k)), and all of them.
    kept = torch.bincount(torch.tensor([len(t) - 1 for t in tokens]), minlength=len(drafts) + 1).double()
    accept = torch.stack([p[j][d] for j, d in enumerate(drafts)])
    reach = torch.cat([torch.ones(1, dtype=torch.float64), accept.cumprod(0)])
    expected_kept = reach * torch.cat([1 - accept, torch.ones(1, dtype=torch.float64)])
    assert chi2_p_value(kept, expected_kept * REPLICAS) > LEVEL
    # Whole sequences: the drafts' prefix, then a token from the row that ended it (not its draft).
    seqs: dict[tuple[int, ...], int] = {}
    for t in tokens:
        assert t[:-1] == drafts[:len(t) - 1]
        seqs[tuple(t)] = seqs.get(tuple(t), 0) + 1
    ended = [p[k].index_fill(0, torch.tensor(drafts[k]), 0.0) for k in range(len(drafts))] + [p[-1]]
    expected_seq = torch.cat([reach[k] * ended[k] for k in range(len(drafts) + 1)])
    observed_seq = torch.zeros_like(expected_seq)
    for seq, count in seqs.items():
        observed_seq[(len(seq) - 1) * VOCAB + seq[-1]] = count
    assert chi2_p_value(observed_seq, expected_seq * REPLICAS) > LEVEL


def test_target_weights_are_the_reference_distribution():
    torch.manual_seed(2)
    logits = torch.randn(6, 700) * 2.5
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=60, top_p=0.9),
              SamplingParams(temperature=1.0, min_p=0.05), SamplingParams()]
    weights = target_weights(logits, params)
    assert weights.shape == (6, 700) and weights.dtype == torch.float32 and bool((weights >= 0).all())
    for i, sp in enumerate(params[:5]):
        ref = reference_probs(logits[i], sp)
        got = weights[i].double() / weights[i].double().sum()
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-9)
    assert weights[5].nonzero().flatten().tolist() == [int(logits[5].argmax())]  # greedy: a one-hot
    assert float(weights[5].max()) == 1.0


def test_a_draft_holding_all_the_mass_is_always_accepted():
    torch.manual_seed(3)
    rows = torch.randn(3, 30)
    best = rows.argmax(-1).tolist()
    sp = SamplingParams(temperature=1.0, top_k=1)  # one token per row keeps all the mass
    n = 200
    out = speculative_sample(rows.repeat(n, 1), [sp] * n, [best[:2]] * n, [0] * n)[0]
    assert out == [best] * n
    wrong = [(best[0] + 1) % 30, best[1]]
    assert speculative_sample(rows.repeat(n, 1), [sp] * n, [wrong] * n, [0] * n)[0] == [[best[0]]] * n


# ---- seeds ----------------------------------------------------------------------------------------------
SEEDED = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8, top_k=40, seed=12),
          SamplingParams(temperature=1.0, top_p=0.9, seed=13),
          SamplingParams(temperature=1.0, min_p=0.05, seed=14),
          SamplingParams(temperature=0.7, top_k=300, top_p=0.95, seed=-5),
          SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.2, seed=15)]


def test_a_seeded_request_without_drafts_emits_what_sample_emits():
    torch.manual_seed(4)
    vocab = 700
    logits = torch.randn(len(SEEDED), vocab) * 2.0
    history = ([3, 9, 27, 81], 2)
    for position in (0, 2, 17):
        want = sample(logits, SEEDED, [position] * len(SEEDED), [history] * len(SEEDED))[0]
        got = speculative_sample(logits, SEEDED, [[]] * len(SEEDED), [position] * len(SEEDED),
                                 [history] * len(SEEDED))[0]
        assert got == [[t] for t in want]


def test_a_seeded_request_emits_what_sample_emits_whatever_its_drafts():
    """Row j emits sample()'s token at output position o + j; drafts decide only how many rows count."""
    torch.manual_seed(7)
    vocab = 300
    for sp in SEEDED:
        rows = torch.randn(4, vocab) * 2.0
        history = ([3, 9, 27, 81], 2)
        want: list[int] = []
        for j in range(4):
            want.append(sample(rows[j:j + 1], [sp], [5 + j], [((*history[0], *want), 2)])[0][0])
        for drafts in ([], want[:3], [want[0], (want[1] + 1) % vocab, want[2]], [(want[0] + 1) % vocab] * 3):
            got = speculative_sample(rows[:len(drafts) + 1], [sp], [drafts], [5], [history])[0][0]
            kept = 0
            while kept < len(drafts) and drafts[kept] == want[kept]:
                kept += 1
            assert got == want[:kept + 1]


def test_seeded_requests_are_reproducible_whatever_shares_the_call():
    torch.manual_seed(5)
    vocab = 700
    rows = torch.randn(len(SEEDED), 4, vocab)
    history = ([3, 9, 27, 81], 2)
    drafts = [rows[i].argsort(-1, descending=True)[:3, 1].tolist() for i in range(len(SEEDED))]
    drafts[0] = rows[0].argmax(-1)[:3].tolist()

    def run(order: list[int], others: int) -> list[list[int]]:
        extra = SamplingParams(temperature=1.0)
        params = [SEEDED[i] for i in order] + [extra] * others
        logits = torch.cat([rows[i] for i in order] + [torch.randn(2, vocab)] * others)
        tokens = speculative_sample(logits, params, [drafts[i] for i in order] + [[5]] * others,
                                    [4] * len(params), [history] * len(params))[0]
        mine = tokens[:len(order)]
        return [mine[order.index(i)] for i in range(len(SEEDED))]

    alone = run(list(range(len(SEEDED))), 0)
    assert run(list(range(len(SEEDED)))[::-1], 3) == alone
    assert run([2, 0, 5, 1, 4, 3], 1) == alone
    # Other output positions give other draws for the same seed.
    many = [speculative_sample(rows[0], [SEEDED[0]], [drafts[0]], [pos])[0][0] for pos in range(40)]
    assert len({tuple(t) for t in many}) > 5


# ---- log-probabilities, shapes, the host read -------------------------------------------------------------
def test_logprobs_come_from_the_raw_row_of_each_emitted_token():
    torch.manual_seed(6)
    vocab = 64
    rows = torch.randn(9, vocab)
    params = [SamplingParams(logprobs=3), SamplingParams(temperature=1.0, repetition_penalty=2.0, logprobs=0),
              SamplingParams(temperature=1.0, top_k=10)]
    drafts = [rows[0:3].argmax(-1).tolist()[:2], rows[3:7].argmax(-1).tolist()[:3], [1]]
    history = ([1, 2, 3], 1)
    tokens, logprobs = speculative_sample(rows, params, drafts, [0, 0, 0], [history] * 3)
    assert tokens[0] == rows[0:3].argmax(-1).tolist() and logprobs[2] is None
    starts = [0, 3, 7]
    for i in (0, 1):
        lps = logprobs[i]
        assert lps is not None and len(lps) == len(tokens[i])
        raw = rows[starts[i]:starts[i] + len(tokens[i])]
        assert lps == top_logprobs(raw, tokens[i], [params[i].logprobs or 0] * len(tokens[i]))
    assert logprobs[0][0] == sample(rows[:1], params[:1], [0])[1][0]


def test_shapes_are_checked():
    sp = SamplingParams()
    with pytest.raises(ValueError, match=r"each request needs len\(drafts\) \+ 1 rows, 3 in all"):
        speculative_sample(torch.zeros(2, 10), [sp], [[1, 2]], [0])
    with pytest.raises(ValueError, match="draft lists"):
        speculative_sample(torch.zeros(2, 10), [sp, sp], [[]], [0, 0])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        speculative_sample(torch.zeros(2, 10), [sp], [[10]], [0])
    assert speculative_sample(torch.zeros(0, 10), [], [], []) == ([], [])


def test_the_one_host_read_is_the_allowed_one():
    torch.manual_seed(7)
    rows = torch.randn(12, 300)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.8, min_p=0.1, seed=3, logprobs=2, frequency_penalty=0.5)]
    drafts = [[1, 2], [3], [4, 5, 6], [7, 8]]
    with step_guard(torch.device("cpu"), "test"):
        tokens, _ = speculative_sample(rows, params, drafts, [0, 1, 2, 3], [([1, 2], 1)] * 4)
        greedy_only, _ = speculative_sample(rows[:3], [params[0]], [drafts[0]], [0])
    assert all(1 <= len(t) <= len(d) + 1 for t, d in zip(tokens, drafts, strict=True))
    assert greedy_only == tokens[:1]


@pytest.mark.gpu
def test_verification_on_cuda_needs_no_host_sync_until_the_read():
    device = torch.device("cuda")
    torch.manual_seed(8)
    n, vocab = 16, 49_152
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, presence_penalty=0.5)] * (n // 4)
    drafts = [[(7 * i + j) % vocab for j in range(i % 4)] for i in range(n)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, device=device)
    histories = [([1, 2, 3], 2)] * n
    speculative_sample(logits, params, drafts, list(range(n)), histories)  # warm the kernels
    torch.cuda.synchronize()
    with step_guard(device, "test"):
        tokens, _ = speculative_sample(logits, params, drafts, list(range(n)), histories)
    cpu = speculative_sample(logits.cpu(), params, drafts, list(range(n)), histories)[0]
    assert tokens[0::4] == cpu[0::4]  # greedy: the same on both
    assert all(1 <= len(t) <= len(d) + 1 for t, d in zip(tokens, drafts, strict=True))
