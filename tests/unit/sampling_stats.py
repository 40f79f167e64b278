"""Statistics for the sampling tests: transformers' reference distribution and a chi-square test."""

from __future__ import annotations

import math

import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ppserve.request import SamplingParams


def chi2_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the bins of positive expectation, those with fewer than 5
    expected counts merged into one (or into the largest bin); Wilson-Hilferty's tail approximation."""
    assert observed[expected == 0].sum() == 0, "an event of probability zero occurred"
    observed, expected = observed[expected > 0], expected[expected > 0]
    keep = expected >= 5
    obs = torch.cat([observed[keep], observed[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] < 5:
        big = int(exp[:-1].argmax())
        obs[big] += obs[-1]
        exp[big] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def reference_probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """transformers' warpers in its order (temperature, top-k, top-p, min-p), then a softmax: [V] float64."""
    scores = TemperatureLogitsWarper(sp.temperature)(None, row[None].clone())
    if sp.top_k > 0:
        scores = TopKLogitsWarper(sp.top_k)(None, scores)
    if sp.top_p < 1.0:
        scores = TopPLogitsWarper(sp.top_p)(None, scores)
    if sp.min_p > 0:
        scores = MinPLogitsWarper(sp.min_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0].double()
