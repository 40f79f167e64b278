"""The greedy shortcut on a CPU (worker/grammar_masks.py greedy_tokens): the unmasked argmax where the
grammar allows it, the masked argmax elsewhere, equals masking every row and taking the argmax, ties and
rows without a grammar included; anything but plain greedy rows takes the usual path."""

from __future__ import annotations

import types

import pytest
import torch

from ppserve.metrics.spans import NULL_RECORDER
from ppserve.request import SamplingParams
from ppserve.structured.backend import XGrammarBackend
from ppserve.worker.grammar_masks import GrammarMasks, StepMask

xgr = pytest.importorskip("xgrammar")
V = 1000


def _masks() -> GrammarMasks:
    backend = types.SimpleNamespace(_xgr=xgr, vocab_size=V)
    backend.apply_bitmask = lambda logits, bm, rows: XGrammarBackend.apply_bitmask(backend, logits, bm, rows)
    return GrammarMasks(types.SimpleNamespace(backend=backend), NULL_RECORDER)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(5))
def test_shortcut_equals_masking_every_row(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    logits = torch.randn(n, V, generator=g).round(decimals=1)  # rounded: ties for the maximum
    bitmask = xgr.allocate_token_bitmask(n, V)
    rows = [i for i in range(n) if i % 4]  # rows 0, 4, 8 have no grammar (all ones)
    for i in rows:
        bits = torch.rand(V, generator=g) < (0.002 if i % 3 == 0 else 0.5)  # some rows allow a few tokens
        bits[torch.randint(V, (1,), generator=g)] = True
        packed = torch.zeros(bitmask.shape[1] * 32, dtype=torch.int64)
        packed[:V] = bits.long()
        words = (packed.view(-1, 32) << torch.arange(32)).sum(-1)
        bitmask[i] = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)
    mask = StepMask(bitmask, rows)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=V)
    got = _masks().greedy_tokens(logits.clone(), mask, [SamplingParams()] * n)
    assert got == expected.argmax(-1).tolist()


def test_other_rows_take_the_usual_path():
    logits = torch.zeros(2, V)
    mask = StepMask(xgr.allocate_token_bitmask(2, V), [0])
    for sp in (SamplingParams(temperature=0.7), SamplingParams(logprobs=1),
               SamplingParams(presence_penalty=1)):
        assert _masks().greedy_tokens(logits, mask, [SamplingParams(), sp]) is None
