"""Prompt inputs to token ids: text, token ids, or chat messages rendered by the chat template.

One class so that the engine and the replicas' router (ppserve/deploy) turn a request into the same
tokens: the router hashes the tokens a replica's prefix cache will see.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppserve.engine.messages import PromptInput, Turn, turn_dict

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ppserve.config import ModelConfig


class Prompter:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, chat_template: str | None,
                 vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # model.chat_template's text, or None for the model's own
        self.vocab_size = vocab_size

    @classmethod
    def for_model(cls, model: ModelConfig) -> Prompter:
        """The tokenizer and template `model` names, without its weights."""
        from ppserve.model.loader import read_hf_config, resolve_model
        from ppserve.model.registry import describe_model

        model_dir = resolve_model(model.model, model.cache_dir)
        return cls(load_tokenizer(model_dir), read_chat_template(model.chat_template),
                   describe_model(read_hf_config(model_dir)).vocab_size)

    def tokenize(self, prompt: str | list[int] | PromptInput) -> list[int]:
        """Token ids of a prompt: text, token ids, or chat messages rendered by the chat template."""
        if isinstance(prompt, PromptInput):
            if prompt.messages is not None:
                tools = json.loads(prompt.tools) if prompt.tools is not None else None
                prompt = self.render_chat(prompt.messages, tools=tools)
            elif prompt.text is not None:
                prompt = prompt.text
            else:
                assert prompt.token_ids is not None
                prompt = list(prompt.token_ids)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass prompts as lists of token ids")
            ids: list[int] = self.tokenizer.encode(prompt, add_special_tokens=False)
            return ids
        ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        return ids

    def render_chat(self, messages: Sequence[Turn] | Sequence[Mapping[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for chat messages (generation prompt added), by the first of: the template
        file `model.chat_template`; the model's own template, where the request has no tools or tool
        turns or the template knows tools (its source mentions them: then it gets `tools=`); else
        ppserve's Hermes-style one (structured/templates/hermes_tools.jinja), since a template that
        knows no tools would drop them and fail on an assistant turn whose content is None."""
        msgs = [dict(m) if isinstance(m, Mapping) else turn_dict(m) for m in messages]
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer; send prompt_token_ids")
        template = self.chat_template
        own = getattr(self.tokenizer, "chat_template", None)
        uses_tools = bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") or m.get("content") is None
                                        for m in msgs)
        if template is None and uses_tools and not (isinstance(own, str) and "tools" in own):
            from ppserve.structured.tools import hermes_template

            template = hermes_template()
        if template is None and not own:
            raise ValueError("messages: this model has no chat template; send prompt or prompt_token_ids "
                             "(or set model.chat_template)")
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                                  chat_template=template, **kwargs)
        if not isinstance(text, str):  # tokenize=False renders text: anything else is the tokenizer's bug
            raise TypeError(f"the chat template rendered a {type(text).__name__}, not text")
        return text


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    from ppserve.structured.grammars import has_tokenizer

    if not has_tokenizer(str(model_dir)):
        return None
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer


def read_chat_template(path: str | None) -> str | None:
    """model.chat_template, read once: a file that cannot be read fails the start, not a request."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"model.chat_template {path!r} cannot be read: {e}") from None
