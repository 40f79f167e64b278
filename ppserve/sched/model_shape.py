"""What the scheduler's cost arithmetic reads of a model: one Protocol, so that ModelArch, the
simulator's model tables and a test's namespace all satisfy it. Read-only members, so a frozen
dataclass does."""

from __future__ import annotations

from typing import Protocol

__all__ = ["ExpertShape", "ModelShape"]


class ModelShape(Protocol):
    """A model's dimensions (ppserve.model.arch.ModelArch has them): the partition's layer costs and
    the MLP weights a token multiplies (sched/moe_cost.py) read them."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    # Also read where present: head_dim (when heads are not a split of the hidden size, Qwen3) and moe
    # (a mixture of experts' ExpertShape with its sparse_layers, sched/moe_cost.py; None when dense).


class ExpertShape(Protocol):
    """A model's sparse MLP as the cost models read it (ppserve.model.arch.MoeSpec has it)."""

    @property
    def num_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...
    @property
    def expert_intermediate_size(self) -> int: ...
