"""`ppserve offline`: run prompts through the offline API (no server) and print outputs and bubbles."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from ppserve.config import add_config_arguments


def add_parser(sub: Any) -> None:
    p = sub.add_parser("offline",
                       help="generate offline (no server): prompts in, text and bubble figures out")
    p.add_argument("prompts", nargs="*", help="prompts (default: a few built-in questions)")
    add_config_arguments(p)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace here")
    p.add_argument("--json", dest="json_out", help="write outputs and figures as JSON here")
    p.set_defaults(func=run)


DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about pipelines.",
    "Explain in one sentence what a GPU does.",
    "List three prime numbers.",
]


def run(args: argparse.Namespace) -> int:
    from ppserve.engine.llm import LLM
    from ppserve.request import SamplingParams

    prompts = args.prompts or DEFAULT_PROMPTS
    with LLM(config=args.config, overrides=args.overrides) as llm:
        if args.chat or not args.prompts:
            # The engine's own rendering (the model's chat template): a model without one is told so.
            prompts = [llm.engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
        wall = time.perf_counter() - t0
        for o in outs:
            print(f"--- {o.request_id} ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text.strip()}")
        ntok = sum(len(o.token_ids) for o in outs)
        print(f"\n{len(outs)} requests, {ntok} output tokens in {wall:.2f} s ({ntok / wall:.1f} tok/s)")
        report = llm.bubble_stats()
        print(report.format_text())
        if args.trace:
            print(f"trace: {llm.save_trace(args.trace)}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"outputs": [{"text": o.text, "token_ids": o.token_ids} for o in outs],
                           "wall_s": wall, "bubbles": report.to_dict()}, f, indent=2)
    return 0
