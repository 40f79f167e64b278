"""Structured-output test helpers: a byte-level tokenizer for the tiny random checkpoints (id = byte
value, so every text is spellable and id 2, the tiny models' end-of-sequence, is a control byte no
constraint uses), and constrained greedy decoding by transformers with xgrammar's logits processor:
the oracle a constrained ppserve run must equal token for token."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def add_byte_tokenizer(model_dir: Path, out_dir: Path) -> Path:
    """A copy of `model_dir` (vocab 256) with a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    by_byte = _bytes_to_unicode()
    assert set(by_byte) == set(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(by_byte)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=by_byte[2], bos_token=by_byte[1])
    fast.save_pretrained(out_dir)
    return out_dir


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value 0..255 (the ByteLevel alphabet, by byte)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def constrained_reference(model_dir: Path, prompts: list[list[int]], spec_kwargs: dict,
                          max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate under xgrammar's logits processor, float32, one prompt at a time."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppserve.structured.backend import XGrammarBackend
    from ppserve.structured.spec import StructuredOutputs

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    backend = XGrammarBackend(tok, model.config.vocab_size, [model.config.eos_token_id])
    compiled = backend.compile(StructuredOutputs(**spec_kwargs))
    outs = []
    for p in prompts:
        proc = xgr.contrib.hf.LogitsProcessor(compiled)
        ids = torch.tensor([p])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, logits_processor=[proc],
                                 eos_token_id=model.config.eos_token_id, pad_token_id=0)
        outs.append(gen[0, len(p):].tolist())
    return outs
