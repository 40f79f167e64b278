"""Structured-output test helpers: a byte-level tokenizer for the tiny random checkpoints (id = byte
value, so every text is spellable and id 2, the tiny models' end-of-sequence, is a control byte no
constraint uses), and constrained greedy decoding by transformers with xgrammar's logits processor:
the oracle a constrained ppserve run must equal token for token. Also what the tool-calling tests of
both front doors share: the tools they offer, and an in-process gRPC server."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ppserve.server.client import PPServeClient

# The tools both front doors' tool tests offer (bounded strings, so a forced call ends well inside
# max_tokens), and the question they ask.
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
               "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time in a city",
                                      "parameters": TIME_PARAMS}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The question, the assistant's call and the tool's answer: a conversation to continue.
TOOL_TURNS = [*ASK,
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather",
                                "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]


@contextmanager
def grpc_client(overrides: list[str]) -> Iterator[PPServeClient]:
    """A gRPC server (config `overrides`) on its own event loop thread, since the tests' client blocks;
    its client, ready; the server stopped on the way out."""
    from ppserve.config import load_config
    from ppserve.engine.async_engine import AsyncEngine
    from ppserve.engine.llm_engine import LLMEngine
    from ppserve.server.server import start_server

    cfg = load_config(None, overrides)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Any:
        return await start_server(AsyncEngine(LLMEngine(cfg)), "127.0.0.1", 0)  # starts the engine too

    running = asyncio.run_coroutine_threadsafe(start(), loop).result(240)
    try:
        with PPServeClient(running.address) as c:
            c.wait_ready(30)
            yield c
    finally:
        asyncio.run_coroutine_threadsafe(running.stop(1.0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


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
