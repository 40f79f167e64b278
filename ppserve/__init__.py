"""ppserve: pipeline-parallel LLM serving with Sarathi-Serve scheduling and measured pipeline bubbles."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppserve.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from ppserve.engine.llm import LLM

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; import it lazily so `import ppserve.sched` stays torch-free.
    if name == "LLM":
        from ppserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
