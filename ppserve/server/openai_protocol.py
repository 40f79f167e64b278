"""The OpenAI-compatible request bodies ppserve accepts, and how they become SamplingParams.

Only the fields ppserve implements are modelled; a known OpenAI field it does not implement (echo,
best_of, logit_bias, suffix, tools) is refused with 400 rather than silently ignored, and unknown
fields are ignored as OpenAI's own server does. Sampling fields a client leaves unset take the model's
defaults (its generation_config.json), then OpenAI's. Values are checked by SamplingParams.validate,
so a bad value gets the same message here as over gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from ppserve.request import SamplingParams

if TYPE_CHECKING:
    from typing_extensions import TypeIs


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's: vLLM's extension, kept for the same clients
    min_p: float | None = None  # vLLM's extension too
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None  # vLLM's field: only requests with the same salt share cached prefixes
    # Known OpenAI fields ppserve does not implement: refused, not ignored.
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported; use n")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")

    def sampling(self, defaults: dict[str, Any], max_tokens: int | None,
                 logprobs: int | None) -> SamplingParams:
        """SamplingParams: the fields the client set, else the model's defaults (generation_config.json),
        else OpenAI's (temperature 1, top_p 1). `max_tokens` is the request's own limit (None: the
        model's default, else what the context leaves). Raises ValueError naming a bad field."""
        chosen: dict[str, Any] = {"temperature": 1.0, **defaults}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "min_tokens"):
            value = getattr(self, name)
            if value is not None:
                chosen[name] = value
        if max_tokens is not None:
            chosen["max_tokens"] = max_tokens
        chosen.setdefault("max_tokens", None)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sp = SamplingParams(stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()), seed=self.seed,
                            ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n, **chosen)
        sp.validate()
        return sp


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # alternatives per token (OpenAI allows 5; ppserve up to 20)
    echo: bool = False
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")

    def prompts(self) -> list[str | list[int]]:
        """One prompt or a batch of them: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        if _is_token_ids(p):
            return [list(p)]
        return [x if isinstance(x, str) else list(x) for x in p]


def _is_token_ids(p: list[str] | list[int] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether a prompt list is one prompt's token ids rather than a batch of prompts."""
    return all(isinstance(x, int) for x in p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text: a string, or the text parts of a content list (other parts refused)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if not self.messages:
            raise ValueError("messages is empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")

    def conversation(self) -> tuple[tuple[str, str], ...]:
        # OpenAI's "developer" role is the system prompt of newer models: the chat template knows "system".
        return tuple(("system" if m.role == "developer" else m.role, m.text()) for m in self.messages)

    def logprob_count(self) -> int | None:
        """None: no logprobs; else how many alternatives per token besides the sampled one."""
        return (self.top_logprobs or 0) if self.logprobs else None
