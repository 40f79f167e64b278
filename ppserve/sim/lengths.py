"""Dataset-like request lengths: log-normal stand-ins for the two datasets Sarathi-Serve evaluates on, and
for the Azure conversation trace where a checkout lacks ../shared/traces.

Prompt and output lengths are drawn independently from log-normals fitted to each dataset's published
median and P90 (Sarathi-Serve, Agrawal et al., OSDI'24, Table 3). They have the dataset's centre and
spread, not the dataset: the tail beyond P90 and the correlation of prompt and output length are not
reproduced. Where a real trace is at hand (../shared/traces, its README says how to cite it), read it
with `workload.read_trace` instead. Pure Python, seeded.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ppserve.sim.workload import WorkloadRequest, clip_to_context

__all__ = ["LengthDistribution", "SHAREGPT4_LIKE", "ARXIV_SUMMARIZATION_LIKE", "SPLITWISE_CONV_LIKE",
           "LENGTH_DISTRIBUTIONS"]

# z of the standard normal's 90th percentile: a log-normal with median m and P90 q has sigma ln(q/m) / z.
_Z90 = 1.2815515655446004


@dataclass(frozen=True)
class LengthDistribution:
    """A dataset's prompt and output lengths as two log-normals (median and P90 each, in tokens)."""

    name: str
    prompt_median: float
    prompt_p90: float
    output_median: float
    output_p90: float
    source: str

    def __post_init__(self) -> None:
        if not (0 < self.prompt_median < self.prompt_p90 and 0 < self.output_median < self.output_p90):
            raise ValueError(f"{self.name}: need 0 < median < P90 for prompts and outputs, got {self}")

    def sample(self, n: int, max_model_len: int, seed: int = 0) -> list[WorkloadRequest]:
        """n requests, all arriving at 0, clipped to the context (the prompt first, then the output)."""
        rng = random.Random(seed)
        out = [WorkloadRequest(0.0, _log_normal(rng, self.prompt_median, self.prompt_p90),
                               _log_normal(rng, self.output_median, self.output_p90)) for _ in range(n)]
        return clip_to_context(out, max_model_len)


def _log_normal(rng: random.Random, median: float, p90: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), math.log(p90 / median) / _Z90)))


_TABLE = "Sarathi-Serve (Agrawal et al., OSDI'24), Table 3"
# openchat_sharegpt4: ShareGPT conversations answered by GPT-4 (55K requests): prompt median 1730 / P90
# 5696 tokens, output median 415 / P90 834.
SHAREGPT4_LIKE = LengthDistribution("sharegpt4-like", 1730, 5696, 415, 834, f"{_TABLE}, openchat_sharegpt4")
# arxiv_summarization: summaries of arXiv papers (203K requests): prompt median 7059 / P90 12985, output
# median 208 / P90 371; long prompts, short answers.
ARXIV_SUMMARIZATION_LIKE = LengthDistribution("arxiv-summarization-like", 7059, 12985, 208, 371,
                                              f"{_TABLE}, arxiv_summarization")
# splitwise_conv.csv (../shared/traces; the Azure LLM inference trace 2023, conversation service, Azure
# Public Dataset, CC-BY-4.0): prompt median 1020 / P90 2734 tokens, output median 129 / P90 424, read
# from its 19,366 rows. The conversation workload falls back to it where the trace is absent.
SPLITWISE_CONV_LIKE = LengthDistribution("splitwise-conv-like", 1020, 2734, 129, 424,
                                         "Azure LLM inference trace 2023 (conversation), splitwise_conv.csv")
LENGTH_DISTRIBUTIONS = {d.name: d for d in (SHAREGPT4_LIKE, ARXIV_SUMMARIZATION_LIKE, SPLITWISE_CONV_LIKE)}
