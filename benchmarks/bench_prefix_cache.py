"""Prefix caching on vs off, side by side in one run (issue 23), on the default model.

1. Shared prefixes: GROUPS system prompts of PREFIX tokens, each followed by PER_GROUP distinct
   QUESTION-token questions, OUTPUT tokens out, all arriving at once, through a PP=2 pipeline: TTFT p50,
   output tokens/s, mean bubble, prefix-cache hit rate.
2. Multi-turn chat replay: CONVERSATIONS chats of TURNS turns; each turn re-sends the whole history (a
   system prompt, every earlier question and the model's own answers) and a new question, and waits for
   its answer before the next turn: prompt tokens computed per turn (prompt minus cached), on vs off.

Each engine (off, then on) runs both; the order alternates over --rounds.

    python benchmarks/bench_prefix_cache.py                     # 8 x 8 requests, 1024 + 64 tokens, 64 out
    python benchmarks/bench_prefix_cache.py --groups 2 --per-group 2 --prefix 64 --question 8 --output 4 \\
        --conversations 2 --turns 2 --pp 1                      # a smoke run

Writes results/bench_prefix_cache.json (or --out) and prints both tables. Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from ppserve.bench.harness import EngineSpec, build_llm, replay, warm_up
from ppserve.bench.prompts import PromptBuilder
from ppserve.sim.workload import shared_prefix


def shared_prefix_run(
    llm: Any, builder: PromptBuilder, args: argparse.Namespace, name: str
) -> dict[str, Any]:
    reqs = shared_prefix(args.groups, args.per_group, args.prefix, args.question, args.output)
    prompts = builder.build_for(reqs)
    s = replay(llm.engine, reqs, prompts, name=name, progress=False).summary("active")
    return {
        "ttft_p50_s": s["latency"]["ttft_s"]["p50"],
        "output_tok_s": s["throughput"]["output_tokens_per_s"],
        "mean_bubble": s["bubbles"]["mean_bubble_fraction"],
        "prefix_cache_hit_rate": s["prefix_cache_hit_rate"],
        "num_requests": s["latency"]["num_requests"],
    }


def multi_turn_run(llm: Any, builder: PromptBuilder, args: argparse.Namespace) -> list[dict[str, int]]:
    """Per turn, summed over the conversations: prompt tokens, of them cached, computed."""
    from ppserve import SamplingParams

    sp = SamplingParams(max_tokens=args.output, ignore_eos=True)
    systems = builder.build([args.prefix] * args.conversations)
    builder.seed += 1
    histories = [list(s) for s in systems]
    turns = []
    for t in range(args.turns):
        builder.seed += 1
        questions = builder.build([args.question] * args.conversations)
        prompts = [h + q for h, q in zip(histories, questions, strict=True)]
        outs = llm.generate(prompts, sp)
        cached = sum(o.num_cached_tokens for o in outs)
        total = sum(len(p) for p in prompts)
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": total,
                "cached_tokens": cached,
                "computed_tokens": total - cached,
            }
        )
        histories = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=1024, help="system prompt tokens")
    ap.add_argument("--question", type=int, default=64, help="tokens per question")
    ap.add_argument("--output", type=int, default=64, help="output tokens per request")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="results/bench_prefix_cache.json")
    args = ap.parse_args()
    spec = EngineSpec(pp=args.pp, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                      max_model_len=4096)
    rounds: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
        res: dict[str, Any] = {}
        for mode in order:
            eng = dataclasses.replace(
                spec, overrides=(f"cache.enable_prefix_caching={str(mode == 'on').lower()}",)
            )
            with build_llm(eng, "sarathi") as llm:
                builder = PromptBuilder(llm.tokenizer, llm.engine.arch.vocab_size, seed=rnd)
                warm_up(llm.engine)
                res[mode] = {"shared_prefix": shared_prefix_run(llm, builder, args, f"shared-prefix-{mode}"),
                             "multi_turn": multi_turn_run(llm, builder, args)}
            print(f"round {rnd + 1} caching {mode}: {json.dumps(res[mode]['shared_prefix'])}", flush=True)
        rounds.append(res)
    on_sp = [r["on"]["shared_prefix"] for r in rounds]
    off_sp = [r["off"]["shared_prefix"] for r in rounds]
    ttft_x = statistics.median(f["ttft_p50_s"] / n["ttft_p50_s"] for f, n in zip(off_sp, on_sp, strict=True))
    tput_x = statistics.median(
        n["output_tok_s"] / f["output_tok_s"] for f, n in zip(off_sp, on_sp, strict=True)
    )
    print(f"\nshared prefix: {args.groups} x {args.per_group} requests, {args.prefix}-token system prompt + "
          f"{args.question}-token question, {args.output} out, pp={args.pp}, budget {args.token_budget}")
    print("| caching | TTFT p50 (s) | out tok/s | mean bubble | prefix hit |\n|---|---|---|---|---|")
    for mode, sp in (("off", off_sp[-1]), ("on", on_sp[-1])):
        print(
            f"| {mode} | {sp['ttft_p50_s']:.2f} | {sp['output_tok_s']:.1f} | {100 * sp['mean_bubble']:.1f}% "
            f"| {100 * sp['prefix_cache_hit_rate']:.1f}% |"
        )
    print(f"TTFT p50 {ttft_x:.2f}x lower (goal >= 3x), throughput {tput_x:.2f}x higher (goal >= 2x); "
          f"medians over {args.rounds} round(s)")
    print(
        f"\nmulti-turn: {args.conversations} conversations x {args.turns} turns, {args.prefix}-token system "
        "prompt, "
        f"{args.question}-token questions, {args.output}-token answers (the model's own)"
    )
    print("| turn | prompt tokens | computed off | computed on | fewer |\n|---|---|---|---|---|")
    last = rounds[-1]
    for off_t, on_t in zip(last["off"]["multi_turn"], last["on"]["multi_turn"], strict=True):
        ratio = off_t["computed_tokens"] / max(1, on_t["computed_tokens"])
        print(
            f"| {off_t['turn']} | {off_t['prompt_tokens']} | {off_t['computed_tokens']} | "
            f"{on_t['computed_tokens']} "
            f"| {ratio:.1f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"args": vars(args), "rounds": rounds, "ttft_p50_x": ttft_x, "throughput_x": tput_x}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
