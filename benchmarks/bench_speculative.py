"""Speculative decoding side by side with decoding without drafts, on the default model: time per output
token where outputs copy their prompt, and what speculation costs where they do not.

    python benchmarks/bench_speculative.py                   # every workload, pp 1 and 2, concurrency 1 and 4
    python benchmarks/bench_speculative.py --quick           # smoke test: one round, short outputs
    python benchmarks/bench_speculative.py --workloads repetitive --pp 1 --method suffix

Workloads (chat prompts through the model's template, greedy):
- `repetitive`: rewrite or edit a given text or code (Python source of this repository's standard
  library neighbours and English prose), outputs that copy much of the prompt;
- `chat`: the benchmark questions, outputs with little repetition;
- `saturated`: --saturated-requests chat requests at once, the pipeline full;
- `ring-trip` (pp > 1): chat without drafts, the token ring off ("on" column) against on ("off"
  column): the trip to the engine that a speculating decode makes instead of riding the ring.
Each (workload, pp, concurrency) runs speculation off and on in interleaved rounds (off, on, on, off,
...) after one unmeasured round of each (none with --quick), on one engine per side kept across rounds.
Concurrency c: c requests at a time (`LLM.generate` of c prompts), until the workload's prompts are
done. Figures per side, the median over rounds: TPOT (per request: (last token time - first) / (tokens -
1), averaged), output tok/s over the rounds' wall, and the drafts' acceptance (accepted / drafted, and
the mean tokens per speculating step). pp 2 runs the multi-process executor.

Results: a Markdown table on stdout, JSON at results/<date-time>-speculative/ (or --out DIR).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ppserve import LLM, SamplingParams
from ppserve.bench.prompts import english_text

QUESTIONS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "Explain pipeline parallelism to a child.", "List five fruits and their colors.",
    "Why is the sky blue? Answer in two sentences.", "What are the main causes of inflation?",
    "Give three tips for learning a new language.", "Describe a sunrise over the mountains.",
]


def _sources() -> list[str]:
    """Short Python functions from the standard library (real code, no download)."""
    import json as json_mod
    import shutil
    import textwrap as textwrap_mod

    picks: list[Callable[..., Any]] = [textwrap_mod.dedent, shutil.copyfileobj, json_mod.dumps,
                                       textwrap_mod.shorten, shutil.which, statistics.median,
                                       statistics.mean, inspect.cleandoc]
    out = []
    for fn in picks:
        src = textwrap.dedent(inspect.getsource(fn))
        out.append("\n".join(line for line in src.splitlines() if line.strip())[:1200])
    return out


def repetitive_messages(n: int) -> list[list[dict[str, str]]]:
    """Edit tasks: rename in code, fix the spelling of a passage, copy it out with one change."""
    codes = _sources()
    prose = " ".join(english_text()[0].split())[:6000]
    paragraphs = [prose[i:i + 700] for i in range(0, len(prose), 700)]
    tasks = []
    for i in range(n):
        if i % 2 == 0:
            code = codes[(i // 2) % len(codes)]
            tasks.append(f"Rewrite this Python function exactly as it is, but add a one-line comment "
                         f"above the def line:\n\n```python\n{code}\n```")
        else:
            text = paragraphs[(i // 2) % len(paragraphs)]
            tasks.append(f"Copy the following text exactly, changing only the first word to upper "
                         f"case:\n\n{text}")
    return [[{"role": "user", "content": t}] for t in tasks]


def chat_messages(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(n)]


def tpot(token_times: Sequence[float]) -> float | None:
    if len(token_times) < 2:
        return None
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def one_round(llm: LLM, convs: list[list[dict[str, str]]], concurrency: int,
              max_tokens: int) -> dict[str, Any]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tpots: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(convs), concurrency):
        for out in llm.chat(convs[i:i + concurrency], sp):
            tokens += len(out.token_ids)
            t = tpot(out.token_times)
            if t is not None:
                tpots.append(t)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tokens": tokens, "tpot_s": statistics.mean(tpots) if tpots else None,
            "output_tok_s": tokens / wall}


def engine(pp: int, method: str | None, k: int, ring: bool = True) -> LLM:
    kw: dict[str, Any] = {"pipeline_parallel_size": pp, "executor": "mp" if pp > 1 else "inproc"}
    if method:
        kw["speculative_config"] = {"method": method, "num_speculative_tokens": k}
    return LLM(**kw, overrides=[] if ring else ["scheduler.token_ring=false"])


def counters(llm: LLM) -> dict[str, Any]:
    spec = llm.engine.scheduler.spec
    return spec.counters.as_dict() if spec is not None else {}


def run_case(workload: str, pp: int, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    if workload == "repetitive":
        convs = repetitive_messages(args.requests)
    elif workload in ("chat", "ring-trip"):
        convs = chat_messages(args.requests)
    else:
        convs = chat_messages(args.saturated_requests)
        concurrency = len(convs)
    # "ring-trip": what leaving the token ring costs a decode (speculating decodes wait for their
    # tokens): the ring off ("on" side) against on, no drafts on either side.
    trip = workload == "ring-trip"
    drafting = engine(pp, None, args.k, ring=False) if trip else engine(pp, args.method, args.k)
    sides = {"off": engine(pp, None, args.k), "on": drafting}
    rounds: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    try:
        if not args.quick:
            for llm in sides.values():
                one_round(llm, convs, concurrency, args.max_tokens)
        before = {name: counters(llm) for name, llm in sides.items()}
        order = ["off", "on", "on", "off"]
        for r in range(args.rounds):
            for name in order[(r % 2) * 2:(r % 2) * 2 + 2]:
                rounds[name].append(one_round(sides[name], convs, concurrency, args.max_tokens))
        spec_after = counters(sides["on"])
    finally:
        for llm in sides.values():
            llm.shutdown()
    result: dict[str, Any] = {"workload": workload, "pp": pp, "concurrency": concurrency}
    for name, rs in rounds.items():
        ts = [r["tpot_s"] for r in rs if r["tpot_s"] is not None]
        result[name] = {"tpot_ms": statistics.median(ts) * 1e3 if ts else None,
                        "output_tok_s": statistics.median(r["output_tok_s"] for r in rs), "rounds": rs}
    b = before["on"]
    drafted = spec_after.get("num_draft_tokens", 0) - b.get("num_draft_tokens", 0)
    accepted = spec_after.get("num_accepted_tokens", 0) - b.get("num_accepted_tokens", 0)
    drafts = spec_after.get("num_drafts", 0) - b.get("num_drafts", 0)
    result["spec"] = {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                      "acceptance_rate": accepted / drafted if drafted else None,
                      "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    off, on = result["off"], result["on"]
    both = off["tpot_ms"] and on["tpot_ms"]
    result["tpot_off_over_on"] = off["tpot_ms"] / on["tpot_ms"] if both else None
    result["rate_on_over_off"] = on["output_tok_s"] / off["output_tok_s"]
    return result


def table(results: list[dict[str, Any]], method: str) -> str:
    lines = [f"| workload | pp | conc | TPOT off ms | TPOT {method} ms | TPOT off/on | tok/s off | "
             "tok/s on | on/off rate | accepted/drafted | tokens per spec step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["spec"]

        def f(x: float | None, fmt: str = ".2f") -> str:
            return "-" if x is None else format(x, fmt)

        lines.append(f"| {r['workload']} | {r['pp']} | {r['concurrency']} | {f(r['off']['tpot_ms'])} | "
                     f"{f(r['on']['tpot_ms'])} | {f(r['tpot_off_over_on'])}x | "
                     f"{f(r['off']['output_tok_s'], '.1f')} | {f(r['on']['output_tok_s'], '.1f')} | "
                     f"{f(r['rate_on_over_off'], '.3f')}x | "
                     f"{f(s['acceptance_rate'])} | {f(s['mean_acceptance_length'])} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="repetitive,chat,saturated")
    ap.add_argument("--pp", default="1,2")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--requests", type=int, default=8, help="prompts per round (repetitive, chat)")
    ap.add_argument("--saturated-requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.requests, args.saturated_requests, args.max_tokens = 1, 2, 8, 24
    results = []
    for workload in args.workloads.split(","):
        for pp in [int(x) for x in args.pp.split(",")]:
            if workload == "ring-trip" and pp == 1:
                continue
            concs = [1] if workload == "saturated" else [int(x) for x in args.concurrency.split(",")]
            for c in concs:
                r = run_case(workload, pp, c, args)
                results.append(r)
                print(table([r], args.method).splitlines()[-1], flush=True)
    print()
    print(table(results, args.method))
    out = Path(args.out or f"results/{time.strftime('%Y%m%d-%H%M%S')}-speculative")
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    print(f"\nwrote {out / 'speculative.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
