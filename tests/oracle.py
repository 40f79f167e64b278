"""The correctness oracle: transformers `generate` (greedy, eos disabled) on the same weights."""

from __future__ import annotations

import random
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain pipeline parallelism to a child.",
    "List five fruits and their colors.",
    "Why is the sky blue? Answer in two sentences.",
    "Translate 'good morning' into Spanish, French and German.",
    "What are the main causes of inflation?",
]

# Real English text for long prompts; the licence files ship with Debian, the fallback with us.
_LICENCE = Path("/usr/share/common-licenses/GPL-3")
_FALLBACK = (
    "The licenses for most software and other practical works are designed to take away your freedom to "
    "share and change the works. By contrast, the General Public License is intended to guarantee your "
    "freedom to share and change all versions of a program, to make sure it remains free software for all "
    "its users. When we speak of free software, we are referring to freedom, not price. "
)


def long_text(num_words: int = 600) -> str:
    words = (_LICENCE.read_text() if _LICENCE.exists() else _FALLBACK * 40).split()
    while len(words) < num_words:
        words = words + words
    return " ".join(words[:num_words])


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def default_prompts(tokenizer) -> list[list[int]]:
    """Eight prompts of varied length, one of them 700+ tokens."""
    prompts = [chat_prompt_ids(tokenizer, q) for q in QUESTIONS]
    long_ids = chat_prompt_ids(tokenizer, "Summarize this text:\n" + long_text())
    assert len(long_ids) >= 700, len(long_ids)
    return [*prompts[:4], long_ids, *prompts[4:]]


@lru_cache(maxsize=4)
def _hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early; min_new_tokens would change argmax
    return model.eval()


def reference_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    return greedy_continuations(_hf(str(model_dir)), prompts, max_new_tokens)


def greedy_continuations(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy, one prompt at a time (no padding): the new tokens of each."""
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:
            g = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def random_prompts(seed: int, lengths: Iterable[int], vocab: int = 256) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths (ids from 3 up: clear of the special ones)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def ppserve_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: int,
                   **llm_kwargs) -> tuple[list[list[int]], int]:
    """ppserve's greedy output in float32 (exactness is a float32 property), eos ignored, with an engine
    built from `llm_kwargs` for this call; returns the new tokens of each prompt and the preemptions seen."""
    from ppserve import LLM, SamplingParams

    with LLM(str(model_dir), dtype="float32", **llm_kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, ignore_eos=True))
        return [o.token_ids for o in outs], llm.engine.scheduler.num_preemptions
