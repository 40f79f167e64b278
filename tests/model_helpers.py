"""Test helpers for the model package: tiny random HF checkpoints and a minimal paged-KV runner."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ppserve.model.attention import AttentionMetadata, allocate_kv_cache
from ppserve.model.loader import load_stage_model
from ppserve.model.parallel import TPContext
from ppserve.model.stage_model import StageModel

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def make_tiny_llama_dir(path: Path, *, num_layers: int = 4, hidden: int = 64, heads: int = 4,
                        kv_heads: int = 2, vocab: int = 256, intermediate: int = 128, arch: str = "llama",
                        tie: bool = False, rope_scaling: dict | None = None, seed: int = 0) -> Path:
    """Save a random-weight Llama, Qwen2 or Phi-3 model as a real HF directory (config.json + safetensors)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  tie_word_embeddings=tie, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0, rope_scaling=rope_scaling)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "phi3":  # fused qkv_proj and gate_up_proj checkpoints
        cfg = Phi3Config(**common, rope_theta=10000.0, pad_token_id=0, sliding_window=None)
        model = Phi3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    # The default init (std 0.02) makes all logits nearly equal; larger weights give a peaked,
    # meaningful distribution, so greedy comparisons actually test something.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    return Path(path)


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # never stop early: compare a fixed number of tokens
    return model.eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> Tensor:
    """[len, vocab] float32 logits of the reference model over a whole sequence."""
    return model(torch.tensor([list(token_ids)])).logits[0].float()


class PagedRunner:
    """Feeds token chunks of several sequences through one or more pipeline stages with paged KV caches.

    Blocks are handed out from a shuffled free list, so block tables are never contiguous.
    """

    def __init__(self, stages: Sequence[StageModel], num_blocks: int = 128, block_size: int = 4,
                 seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        self.stages = list(stages)
        self.block_size = block_size
        self.caches = [allocate_kv_cache(s.num_local_layers, num_blocks, block_size, s.num_kv_heads_local,
                                         s.arch.head_dim, dtype, "cpu") for s in self.stages]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _reserve(self, seq: int, new_len: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < new_len:
            table.append(self.free.pop())
        return table

    @torch.no_grad()
    def step(self, work: Sequence[tuple[int, Sequence[int]]]) -> list[Tensor]:
        """One forward over a mixed batch [(seq_id, new token ids)]; returns each sequence's
        logits [q, vocab]."""
        query_lens, context_lens, tables, ids, positions = [], [], [], [], []
        for seq, tokens in work:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            tables.append(list(self._reserve(seq, end)))
            query_lens.append(len(tokens))
            context_lens.append(end)
            ids.extend(tokens)
            positions.extend(range(start, end))
            self.lens[seq] = end
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, "cpu")
        pos = torch.tensor(positions, dtype=torch.int64)
        hidden: Tensor | None = None
        for stage, caches in zip(self.stages, self.caches, strict=True):
            if stage.is_first:
                hidden = stage(torch.tensor(ids, dtype=torch.int64), None, pos, caches, meta)
            else:
                hidden = stage(None, hidden, pos, caches, meta)
        assert hidden is not None
        logits = self.stages[-1].compute_logits(hidden)
        return list(logits.split(query_lens))

    def run_chunked(self, seq: int, token_ids: Sequence[int], chunk: int) -> Tensor:
        """Prefill a whole sequence in chunks of `chunk` tokens; returns [len, vocab] logits."""
        parts = [self.step([(seq, token_ids[i:i + chunk])])[0] for i in range(0, len(token_ids), chunk)]
        return torch.cat(parts)

    def greedy(self, seq: int, prompt: Sequence[int], max_new_tokens: int, chunk: int = 7) -> list[int]:
        """Greedy generation: chunked prefill, then one decode per token."""
        last = self.run_chunked(seq, prompt, chunk)[-1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(last.argmax())
            out.append(token)
            last = self.step([(seq, [token])])[0][-1]
        return out


def load_stages(model_dir: Path, cuts: Sequence[int], tp: TPContext = TPContext()) -> list[StageModel]:
    """Stage models for layer ranges [cuts[0], cuts[1]), [cuts[1], cuts[2]), ..."""
    return [load_stage_model(model_dir, a, b, tp) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def tp_worker(rank: int, size: int, init_file: str, model_dir: str, prompts: list[list[int]],
              out_dir: str, dtype: str = "float32") -> None:
    """One TP rank (spawned process): load its shards in `dtype`, run a chunked prefill and a mixed batch,
    save logits."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    try:
        tp = TPContext(rank=rank, size=size, group=dist.group.WORLD)
        stage = load_stage_model(Path(model_dir), 0, load_num_layers(Path(model_dir)), tp,
                                 dtype=getattr(torch, dtype))
        results = tp_scenario(stage)
        if rank == 0:
            torch.save(results, Path(out_dir) / "logits.pt")
        dist.barrier()  # neither rank tears gloo down while the other is still in a collective
    finally:
        dist.destroy_process_group()


def load_num_layers(model_dir: Path) -> int:
    from ppserve.model.loader import read_hf_config

    return int(read_hf_config(model_dir)["num_hidden_layers"])


TP_PROMPTS = [[5, 17, 99, 3, 250, 42, 8, 61, 77, 12, 200, 31], [9, 8, 7, 6, 5]]


def tp_scenario(stage: StageModel) -> list[Tensor]:
    """The fixed workload the TP test runs on every rank and at tp=1: chunked prefills, then a mixed step."""
    runner = PagedRunner([stage], dtype=next(stage.parameters()).dtype)
    a = runner.run_chunked(0, TP_PROMPTS[0], 5)
    b = runner.run_chunked(1, TP_PROMPTS[1][:3], 3)
    mixed = runner.step([(0, [4]), (1, TP_PROMPTS[1][3:]), (2, [11, 22, 33])])
    return [a, b, *mixed]


def make_tiny_qwen3_dir(path: Path, *, arch: str = "qwen3_moe", num_layers: int = 4, hidden: int = 64,
                        heads: int = 4, kv_heads: int = 2, head_dim: int = 32, vocab: int = 256,
                        intermediate: int = 96, experts: int = 8, top_k: int = 2,
                        expert_intermediate: int = 32, dense_layers: Sequence[int] = (1,),
                        fused: bool = False, seed: int = 0) -> Path:
    """Save a random-weight Qwen3 ('qwen3'), Qwen3-MoE ('qwen3_moe': `dense_layers` keep a dense MLP) or
    Mixtral ('mixtral': every layer sparse, `expert_intermediate` wide) as a real HF directory. `fused`
    writes transformers' fused expert tensors instead of the Hub's per-expert ones."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=num_layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=intermediate, head_dim=head_dim))
    elif arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, head_dim=head_dim, intermediate_size=intermediate,
            moe_intermediate_size=expert_intermediate, num_experts=experts, num_experts_per_tok=top_k,
            norm_topk_prob=True, mlp_only_layers=list(dense_layers)))
    elif arch == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=expert_intermediate,
                                                 num_local_experts=experts, num_experts_per_tok=top_k))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    # peaked logits, as in make_tiny_llama_dir; routers sharp enough to pick distinct experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.15)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path, save_original_format=not fused)
    return Path(path)
