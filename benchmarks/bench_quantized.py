"""The default model quantized, against bf16 on this CPU: decode step time, weight bytes and quality.

Three variants of SmolLM2-135M-Instruct, each a whole one-stage model in bf16 as a stage worker builds it
(its attention backend, its linear paths):

- `bf16`: the checkpoint as it is;
- `int8`: `model.quantization: int8` (weight-only int8 made at load, torch's int8 kernel);
- `w8a8`: a compressed-tensors W8A8 checkpoint (int8 weights a channel, int8 activations a token);
- `w4a16`: a compressed-tensors W4A16 checkpoint (groups of 64, round to nearest, ppserve/model/quant/rtn.py)
  on torch's int4 kernel.

Decode step time: one step of N sequences with 128 tokens of context each, medians of interleaved steps.
Quality: perplexity on a fixed text (ppserve/ARCHITECTURE.md's first tokens), and greedy agreement with
bf16 over 64 prompts (the fraction of 16-token continuations that match bf16's exactly, and of tokens up
to the first difference).

`--moe HIDDENxINTERxEXPERTS` runs the same variants on a random Qwen3-MoE of that shape instead (4 layers,
8 experts a token, every layer sparse): the experts on torch's kernels; "linear" bytes then count the
experts too. Random weights have no meaningful quality, so only bytes and step times are reported.

    python benchmarks/bench_quantized.py [--seqs 1,16,64] [--repeats 20] [--prompts 64] [--moe 1024x384x64]

Writes results/bench_quantized.json (or --out). Not a test.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ppserve.bench.report import write_json
from ppserve.model.attention import AttentionMetadata, allocate_kv_cache
from ppserve.model.backend_select import select_backend
from ppserve.model.loader import iter_weights, read_hf_config, resolve_model
from ppserve.model.ops import settings
from ppserve.model.quant.rtn import compressed_tensors_copy
from ppserve.model.registry import build_stage_model, describe_model
from ppserve.model.stage_model import StageModel

CONTEXT = 128
BLOCK = 16
NEW_TOKENS = 16


def load(model_dir: Path, quantization: str | None) -> StageModel:
    arch = describe_model(read_hf_config(model_dir))
    before = settings.current()
    settings.configure(settings.KernelSettings(quantization=quantization))
    try:
        model = build_stage_model(arch, 0, arch.num_layers, dtype=torch.bfloat16,
                                  attn_backend=select_backend("cpu"))
        model.load_weights(iter_weights(model_dir, 0, arch.num_layers, arch.num_layers, need_embed=True,
                                        need_head=True))
    finally:
        settings.configure(before)
    return model.eval()


class Runner:
    """Sequences on a paged KV cache: prefill whole prompts, then batched decode steps."""

    def __init__(self, model: StageModel, max_tokens: int) -> None:
        arch = model.arch
        self.model = model
        self.blocks_per_seq = -(-max_tokens // BLOCK)
        self.caches: list[torch.Tensor] = []
        self.lens: list[int] = []
        self.arch = arch

    def reset(self, num_seqs: int) -> None:
        a = self.arch
        blocks = num_seqs * self.blocks_per_seq + 1
        self.caches = allocate_kv_cache(self.model.num_local_layers, blocks, BLOCK,
                                        self.model.num_kv_heads_local, a.head_dim, torch.bfloat16, "cpu")
        self.lens = [0] * num_seqs

    def table(self, seq: int) -> list[int]:
        return list(range(1 + seq * self.blocks_per_seq, 1 + (seq + 1) * self.blocks_per_seq))

    def step(self, work: list[tuple[int, list[int]]]) -> torch.Tensor:
        """One forward over [(sequence, new tokens)]; the last position's logits of each [N, vocab]."""
        ids, pos, q, ctx, tables = [], [], [], [], []
        for seq, tokens in work:
            start = self.lens[seq]
            ids += tokens
            pos += range(start, start + len(tokens))
            self.lens[seq] = start + len(tokens)
            q.append(len(tokens))
            ctx.append(self.lens[seq])
            tables.append(self.table(seq))
        meta = AttentionMetadata.build(q, ctx, tables, BLOCK, "cpu")
        hidden = self.model(torch.tensor(ids), None, torch.tensor(pos), self.caches, meta)
        last = torch.tensor(q).cumsum(0) - 1
        return self.model.compute_logits(hidden[last])

    def all_logits(self, tokens: list[int]) -> torch.Tensor:
        self.reset(1)
        meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [self.table(0)], BLOCK, "cpu")
        hidden = self.model(torch.tensor(tokens), None, torch.arange(len(tokens)), self.caches, meta)
        return self.model.compute_logits(hidden)


def random_moe(path: Path, shape: str) -> Path:
    """A random Qwen3-MoE checkpoint of HIDDENxINTERxEXPERTS, every layer sparse, saved per expert."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, inter, experts = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=8192, hidden_size=hidden, num_hidden_layers=4, num_attention_heads=16,
                            num_key_value_heads=4, head_dim=hidden // 16, intermediate_size=4 * hidden,
                            moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=8,
                            norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path, save_original_format=True)
    return path


def linear_bytes(model: StageModel) -> int:
    ends = sum(p.untyped_storage().nbytes() for n, p in model.named_parameters() if "layers." not in n)
    return model.weight_bytes() - ends


def perplexity(runner: Runner, tokens: list[int]) -> float:
    logits = runner.all_logits(tokens).float()
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(tokens[1:]))
    return math.exp(float(nll))


def greedy(runner: Runner, prompts: list[list[int]]) -> list[list[int]]:
    runner.reset(len(prompts))
    last = torch.cat([runner.step([(i, p)]) for i, p in enumerate(prompts)])
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        tokens = last.argmax(-1).tolist()
        for seq, t in enumerate(tokens):
            out[seq].append(t)
        last = runner.step([(seq, [t]) for seq, t in enumerate(tokens)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="1,16,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--moe", default="", help="HIDDENxINTERxEXPERTS: a random Qwen3-MoE instead")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.out = args.out or f"results/bench_quantized{'_moe' if args.moe else ''}.json"
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_moe(Path(tmp) / "moe", args.moe) if args.moe else resolve_model(None)
        tok = None if args.moe else AutoTokenizer.from_pretrained(model_dir)
        w4_dir = compressed_tensors_copy(model_dir, Path(tmp) / "w4a16", "W4A16", "pack-quantized", 64)
        w8_dir = compressed_tensors_copy(model_dir, Path(tmp) / "w8a8", "W8A8", "int-quantized")
        models = {"bf16": load(model_dir, None), "int8": load(model_dir, "int8"), "w8a8": load(w8_dir, None),
                  "w4a16": load(w4_dir, None)}
    kinds = {name: sorted({str(getattr(m, "quant", None) and m.quant.kind) for m in model.modules()
                           if hasattr(m, "quant")}) for name, model in models.items()}
    seqs = [int(s) for s in args.seqs.split(",")]
    runners = {name: Runner(m, CONTEXT + args.repeats + 8 + args.text_tokens) for name, m in models.items()}
    results: dict[str, dict] = {name: {"linear_kernels": kinds[name], "linear_bytes": linear_bytes(m),
                                       "weight_bytes": m.weight_bytes(), "step_ms": {}}
                                for name, m in models.items()}
    text = (Path(__file__).resolve().parent.parent / "ppserve" / "ARCHITECTURE.md").read_text()
    text_ids = [] if tok is None else tok(text)["input_ids"][: args.text_tokens]
    rng = torch.Generator().manual_seed(0)
    vocab = models["bf16"].arch.vocab_size
    with torch.inference_mode():
        for n in seqs:
            context = torch.randint(3, vocab, (n, CONTEXT), generator=rng).tolist()
            for r in runners.values():
                r.reset(n)
                for seq, ids in enumerate(context):
                    r.step([(seq, ids)])
                r.step([(seq, [7]) for seq in range(n)])  # an untimed step
            times: dict[str, list[float]] = {name: [] for name in runners}
            for _ in range(args.repeats):
                for name, r in runners.items():
                    start = time.perf_counter()
                    r.step([(seq, [11]) for seq in range(n)])
                    times[name].append((time.perf_counter() - start) * 1e3)
            for name in runners:
                results[name]["step_ms"][n] = statistics.median(times[name])
        if tok is not None:  # quality: a real model's text
            for name, r in runners.items():
                results[name]["perplexity"] = perplexity(r, text_ids)
            words = text.split()
            prompts = [tok(" ".join(words[i * 7: i * 7 + 12]))["input_ids"] for i in range(args.prompts)]
            outs = {name: greedy(r, prompts) for name, r in runners.items()}
            for name in runners:
                same = [a == b for a, b in zip(outs[name], outs["bf16"], strict=True)]
                prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), NEW_TOKENS)
                          for a, b in zip(outs[name], outs["bf16"], strict=True)]
                results[name]["greedy_exact"] = sum(same) / len(same)
                results[name]["greedy_prefix_tokens"] = sum(prefix) / (len(prefix) * NEW_TOKENS)
    base = results["bf16"]
    quality = " | perplexity | greedy exact / prefix |" if tok is not None else " |"
    print("| variant | kernels | linear MiB | bytes vs bf16 | " +
          " | ".join(f"step ms @{n} (speed)" for n in seqs) + quality)
    print("|---" * (4 + len(seqs) + (2 if tok is not None else 0)) + "|")
    for name, r in results.items():
        speeds = " | ".join(f"{r['step_ms'][n]:.2f} ({base['step_ms'][n] / r['step_ms'][n]:.2f}x)"
                            for n in seqs)
        scores = (f" | {r['perplexity']:.3f} | {r['greedy_exact']:.2f} / {r['greedy_prefix_tokens']:.2f} |"
                  if tok is not None else " |")
        print(f"| {name} | {','.join(r['linear_kernels'])} | {r['linear_bytes'] / 2**20:.1f} | "
              f"{r['linear_bytes'] / base['linear_bytes']:.2f} | {speeds}{scores}")
    write_json(args.out, {"args": vars(args), "threads": torch.get_num_threads(), "load_avg": os.getloadavg(),
                          "context": CONTEXT, "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
