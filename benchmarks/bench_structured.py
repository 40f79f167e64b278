"""Structured outputs end to end: whether constrained outputs are valid, what the constraint costs the
output rate at pp 1 and pp 2, how much of the last stage's mask time the decode cycle sees, what each
schema of the suite takes to compile, and whether forced tool calls parse and validate. One run, the
figures side by side (benchmarks/structured_schemas.py holds the suite).

    python benchmarks/bench_structured.py                       # every part
    python benchmarks/bench_structured.py --quick               # smoke test: a few schemas, tiny loads
    python benchmarks/bench_structured.py --parts validity,tools --schemas 12

Parts:
- `validity`: each schema of the suite with its prompt, greedy and sampled (temperature 0.8, seeded),
  through the official `openai` client with `response_format={"type": "json_schema", ...,
  "strict": true}` against `ppserve serve --http-port` (default model, pp 1, the in-process executor, a
  subprocess), --concurrency requests at a time. Of the outputs finishing "stop": the share that
  `json.loads` and validate (`jsonschema`, formats asserted as well in a second column); and the share
  finishing "stop". Where the server refuses response_format, the same requests run offline
  (`LLM.chat` with `structured_outputs={"json": schema}`) and the table says so.
- `rate`: --requests chat requests at once, --rate-tokens output tokens each, greedy, at each --pp:
  constrained by a regex (`[a-z ]{N}`, N > max_tokens) or a JSON schema (an array of more strings than
  max_tokens) that cannot end before max_tokens (--constraints), against unconstrained with ignore_eos;
  rounds interleaved (C U U C ...) after one unmeasured round of each (none with --quick); output tok/s
  over each `LLM.chat` call's wall and over its decode window (first to last token), each side's median
  over its rounds and the ratio of the medians. pp 2 runs the multi-process executor.
- `mask` (from the pp 2 constrained rounds' spans): for each microbatch with a `grammar_mask` span on
  the last stage, the part of that span after stage 0's `send` of the step ended (the hidden states
  were available; a mask that ended before is hidden, and the last stage then waits in `recv_wait`),
  as a fraction of the step's decode `compute` span on the last stage: mean and p90; the mask span's
  own mean length beside it, and the last stage's decode compute minus stage 0's (where applying the
  mask to the logits shows), constrained and unconstrained.
- `compile`: each schema compiled cold (a fresh GrammarCache whose backend is built first, so the
  vocabulary index is not counted) and cached (a second `get`), ms per schema and the totals.
- `tools`: the suite's tools (weather, calculator, search) with `tool_choice="required"` and with a
  named function, greedy and sampled, through the openai client: the share of responses whose
  `message.tool_calls` name a given tool and whose arguments `json.loads` and validate against its
  parameters. Skipped, with the server's reason, where the HTTP API refuses tools.

Results: a Markdown table per part on stdout and JSON at results/<date-time>-structured-<tag>/ (or
--out DIR).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from structured_schemas import SCHEMAS, TOOL_PROMPTS, TOOLS, SchemaCase, tool_parameters  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ALL_PARTS = ("compile", "validity", "tools", "rate", "mask")
SAMPLED_TEMPERATURE = 0.8
STARTUP_TIMEOUT_S = 300.0


# ---- checking outputs -----------------------------------------------------------------------------------
def check_json(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    """Whether `text` parses, validates against `schema`, and validates with formats asserted."""
    import jsonschema

    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        return {"parses": False, "valid": False, "valid_formats": False, "error": f"json: {e}"}
    cls = jsonschema.validators.validator_for(schema)
    errors = [e.message for e in cls(schema).iter_errors(value)]
    fmt_errors = [e.message for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value)]
    return {"parses": True, "valid": not errors, "valid_formats": not fmt_errors,
            "error": (errors or fmt_errors or [None])[0]}


def pct(n: int, d: int) -> float | None:
    return None if d == 0 else 100.0 * n / d


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} %"


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


# ---- the HTTP server ------------------------------------------------------------------------------------
class Server:
    """`ppserve serve --http-port 0` as a subprocess (its own session), its base URL read off stdout."""

    def __init__(self, log_path: Path, sets: Sequence[str]) -> None:
        cmd = [sys.executable, "-m", "ppserve.cli", "serve", "--port", "0", "--http-port", "0"]
        for s in sets:
            cmd += ["--set", s]
        self.log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
                                     cwd=REPO, start_new_session=True)
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            m = re.search(r"ppserve OpenAI API on (\S+)", line)
            if m:
                self.url = m.group(1)
            if "ppserve serving on" in line:
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float) -> str:
        self._ready.wait(timeout_s)
        if self.url is None or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"the server did not come up; see {self.log.name}")
        return self.url

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()


@contextmanager
def http_server(out_dir: Path) -> Iterator[tuple[Any, str]]:
    """An openai client of a started pp 1 server, and the served model's name."""
    import openai

    server = Server(out_dir / "server.log", ["parallel.pipeline_parallel_size=1", "parallel.executor=inproc"])
    try:
        url = server.wait_ready(STARTUP_TIMEOUT_S)
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        yield client, model
    finally:
        server.stop()


def refusal(call: Callable[[], Any]) -> str | None:
    """None when the request is accepted; the server's message when it answers 400."""
    import openai

    try:
        call()
    except openai.BadRequestError as e:
        return str(e)
    return None


def response_format(case: SchemaCase) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}


def modes() -> list[tuple[str, dict[str, Any]]]:
    return [("greedy", {"temperature": 0.0}), ("sampled", {"temperature": SAMPLED_TEMPERATURE, "seed": 1234})]


# ---- part: validity -------------------------------------------------------------------------------------
def summarize_validity(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("greedy", "sampled", "all"):
        rs = [r for r in rows if mode == "all" or r["mode"] == mode]
        stop = [r for r in rs if r["finish_reason"] == "stop"]
        out[mode] = {
            "requests": len(rs),
            "stop": len(stop),
            "stop_pct": pct(len(stop), len(rs)),
            "valid_of_stop_pct": pct(sum(r["valid"] for r in stop), len(stop)),
            "valid_formats_of_stop_pct": pct(sum(r["valid_formats"] for r in stop), len(stop)),
            "mean_completion_tokens": statistics.fmean([r["completion_tokens"] for r in rs]) if rs else None,
        }
    return out


def validity_http(client: Any, model: str, cases: list[SchemaCase], max_tokens: int,
                  concurrency: int) -> list[dict[str, Any]]:
    def one(case: SchemaCase, mode: str, kw: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": case.prompt}],
                                           max_tokens=max_tokens, response_format=response_format(case), **kw)
        ch = r.choices[0]
        text = ch.message.content or ""
        return {"schema": case.name, "mode": mode, "finish_reason": ch.finish_reason,
                "latency_s": time.perf_counter() - t0,
                "completion_tokens": r.usage.completion_tokens if r.usage else None, "text": text,
                **check_json(text, case.schema)}

    jobs = [(c, m, kw) for m, kw in modes() for c in cases]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda j: one(*j), jobs))


def validity_offline(cases: list[SchemaCase], max_tokens: int) -> list[dict[str, Any]]:
    from ppserve import LLM, SamplingParams

    rows = []
    with LLM(pipeline_parallel_size=1) as llm:
        for mode, kw in modes():
            sps = [SamplingParams(max_tokens=max_tokens, structured_outputs={"json": c.schema}, **kw)
                   for c in cases]
            outs = llm.chat([[{"role": "user", "content": c.prompt}] for c in cases], sps)
            for c, o in zip(cases, outs, strict=True):
                rows.append({"schema": c.name, "mode": mode, "finish_reason": o.finish_reason,
                             "completion_tokens": len(o.token_ids), "text": o.text,
                             **check_json(o.text, c.schema)})
    return rows


# ---- part: tools ----------------------------------------------------------------------------------------
def tools_http(client: Any, model: str, max_tokens: int, concurrency: int,
               prompts: list[tuple[str, str]]) -> list[dict[str, Any]]:
    import jsonschema

    names = {t["function"]["name"] for t in TOOLS}

    def one(prompt: str, tool: str, choice_kind: str, mode: str, kw: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        choice: Any = "required" if choice_kind == "required" else {"type": "function",
                                                                     "function": {"name": tool}}
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, **kw)
        ch = r.choices[0]
        calls = ch.message.tool_calls or []
        ok, error = bool(calls), None if calls else "no tool_calls"
        for call in calls:
            fn = call.function
            if fn.name not in names or (choice_kind == "named" and fn.name != tool):
                ok, error = False, f"tool {fn.name!r}"
                break
            try:
                args = json.loads(fn.arguments)
                jsonschema.validate(args, tool_parameters(fn.name))
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                ok, error = False, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                break
        return {"prompt": prompt, "tool_choice": choice_kind, "mode": mode, "finish_reason": ch.finish_reason,
                "latency_s": time.perf_counter() - t0,
                "completion_tokens": r.usage.completion_tokens if r.usage else None,
                "calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
                "valid": ok, "error": error}

    jobs = [(p, t, ck, m, kw) for m, kw in modes() for ck in ("required", "named") for p, t in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda j: one(*j), jobs))


def summarize_tools(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for ck in ("required", "named"):
        for mode in ("greedy", "sampled"):
            rs = [r for r in rows if r["tool_choice"] == ck and r["mode"] == mode]
            out[f"{ck}/{mode}"] = {"requests": len(rs),
                                   "valid_pct": pct(sum(r["valid"] for r in rs), len(rs))}
    return out


# ---- part: compile --------------------------------------------------------------------------------------
def fresh_grammar_cache() -> Any:
    """A GrammarCache for the default model's tokenizer, not the process's shared one, its backend built."""
    from transformers import AutoTokenizer

    from ppserve.config import load_config
    from ppserve.model.loader import read_generation_defaults, read_hf_config, resolve_model
    from ppserve.model.registry import describe_model
    from ppserve.structured.backend import build_backend
    from ppserve.structured.grammars import GrammarCache

    cfg = load_config()
    model_dir = resolve_model(cfg.model.model, cfg.model.cache_dir)
    arch = describe_model(read_hf_config(model_dir))
    _, gen_eos = read_generation_defaults(model_dir)
    eos = tuple(dict.fromkeys((*arch.eos_token_ids, *gen_eos)))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cache = GrammarCache(lambda: build_backend(tok, arch.vocab_size, eos))
    _ = cache.backend
    return cache


def compile_times(cases: list[SchemaCase]) -> list[dict[str, Any]]:
    from ppserve.structured.spec import StructuredOutputs

    cache = fresh_grammar_cache()
    rows = []
    try:
        for c in cases:
            spec = StructuredOutputs(json=c.schema)
            t0 = time.perf_counter()
            cache.get(spec)
            t1 = time.perf_counter()
            cache.get(StructuredOutputs(json=c.schema))
            t2 = time.perf_counter()
            rows.append({"schema": c.name, "cold_ms": 1e3 * (t1 - t0), "cached_ms": 1e3 * (t2 - t1)})
    finally:
        cache.shutdown()
    return rows


# ---- parts: rate and mask -------------------------------------------------------------------------------
RATE_PROMPTS = [
    "Describe a quiet morning in a small fishing village.",
    "Write a few sentences about why the sky looks blue.",
    "Tell a short story about a robot learning to paint.",
    "Explain how bread rises, in plain words.",
    "Describe the sounds of a busy train station.",
    "Write about a walk through an autumn forest.",
    "Explain what a pipeline is in a factory.",
    "Describe your favourite kind of weather and why.",
]


def rate_constraint(kind: str, max_tokens: int) -> dict[str, Any]:
    """A constraint no output can satisfy within max_tokens: a regex of 8 * max_tokens letters, or a JSON
    array of more strings than max_tokens (each string takes a token at least)."""
    if kind == "regex":
        return {"regex": f"[a-z ]{{{8 * max_tokens}}}"}
    if kind == "json":
        return {"json": {"type": "object", "required": ["notes"], "additionalProperties": False,
                         "properties": {"notes": {"type": "array", "minItems": 2 * max_tokens,
                                                  "items": {"type": "string", "maxLength": 24}}}}}
    raise ValueError(f"unknown rate constraint {kind!r}; known: regex, json")


def rate_round(llm: Any, constraint: str | None, n: int, max_tokens: int) -> dict[str, Any]:
    from ppserve import SamplingParams

    convs = [[{"role": "user", "content": RATE_PROMPTS[i % len(RATE_PROMPTS)]}] for i in range(n)]
    if constraint:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                            structured_outputs=rate_constraint(constraint, max_tokens))
    else:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.chat(convs, sp)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    first = min(o.token_times[0] for o in outs if o.token_times)
    last = max(o.token_times[-1] for o in outs if o.token_times)
    decode_tokens = sum(max(0, len(o.token_times) - 1) for o in outs)
    return {"constraint": constraint, "output_tokens": tokens, "wall_s": wall,
            "output_tok_s": tokens / wall,
            "decode_tok_s": decode_tokens / (last - first) if last > first else None,
            "finish_reasons": sorted({str(o.finish_reason) for o in outs}),
            "lengths": sorted({len(o.token_ids) for o in outs})}


def mask_exposure(spans: Sequence[Any]) -> dict[str, Any]:
    """Per microbatch with a grammar_mask span on the last stage: the mask time after stage 0's send of
    that step ended, over the step's decode compute span on the last stage."""
    last = max(s.stage for s in spans if s.stage >= 0)
    by = {(s.stage, s.kind, s.step_id): s for s in spans if s.tp_rank == 0 and s.kind != "send"}
    sends0: dict[int, int] = {}
    for s in spans:
        if s.stage == 0 and s.kind == "send" and s.tp_rank == 0:
            sends0[s.step_id] = max(sends0.get(s.step_id, 0), s.end_ns)
    rows = []
    for m in (s for s in spans if s.kind == "grammar_mask" and s.stage == last):
        comp = by.get((last, "compute", m.step_id))
        if comp is None or not comp.num_decode_tokens:
            continue
        avail = sends0.get(m.step_id)
        wait = by.get((last, "recv_wait", m.step_id))
        if avail is None:  # no send seen: the receive's end is when the hidden states were there
            if wait is None:
                continue
            avail = wait.end_ns
        exposed = min(m.duration_ns, max(0, m.end_ns - max(m.start_ns, avail)))
        rows.append({"step_id": m.step_id, "mask_ns": m.duration_ns, "exposed_ns": exposed,
                     "compute_ns": comp.duration_ns, "waited_after_ns": wait.duration_ns if wait else None})
    fr = [r["exposed_ns"] / r["compute_ns"] for r in rows if r["compute_ns"] > 0]
    ratio = [r["mask_ns"] / r["compute_ns"] for r in rows if r["compute_ns"] > 0]
    return {
        "microbatches": len(rows),
        "exposed_fraction_mean": statistics.fmean(fr) if fr else None,
        "exposed_fraction_p90": percentile(fr, 0.9) if fr else None,
        "hidden_pct": pct(sum(r["exposed_ns"] == 0 for r in rows), len(rows)),
        "mask_ms_mean": 1e-6 * statistics.fmean(r["mask_ns"] for r in rows) if rows else None,
        "mask_over_compute_mean": statistics.fmean(ratio) if ratio else None,
        "compute_ms_mean": 1e-6 * statistics.fmean(r["compute_ns"] for r in rows) if rows else None,
    }


def compute_gap_ms(spans: Sequence[Any]) -> float | None:
    """Mean, over decode steps, of the last stage's compute span minus stage 0's (ms): where the mask's
    application to the logits shows (inside the last stage's compute, with its sampling)."""
    last = max((s.stage for s in spans if s.stage >= 0), default=0)
    if last == 0:
        return None
    comp = {(s.stage, s.step_id): s.duration_ns for s in spans
            if s.kind == "compute" and s.tp_rank == 0 and s.num_decode_tokens}
    gaps = [comp[(last, step)] - ns for (stage, step), ns in comp.items()
            if stage == 0 and (last, step) in comp]
    return 1e-6 * statistics.fmean(gaps) if gaps else None


def rate_at(pp: int, n: int, max_tokens: int, rounds: int, constraints: Sequence[str], want_spans: bool,
            warmup: bool = True) -> dict[str, Any]:
    """Each constraint's rounds against the unconstrained ones on one LLM, interleaved (r j U, U j r, ...)."""
    from ppserve import LLM

    kw: dict[str, Any] = {"executor": "mp"} if pp > 1 else {}
    order: list[str | None] = []
    for i in range(rounds):
        block: list[str | None] = [*constraints, None]
        order += block if i % 2 == 0 else block[::-1]
    with LLM(pipeline_parallel_size=pp, **kw) as llm:
        if warmup:  # unmeasured: the first runs at a batch size are slower (and compile the grammars)
            for c in [*constraints, None]:
                rate_round(llm, c, n, max_tokens)
        llm.engine.collect_spans()
        runs: list[dict[str, Any]] = []
        spans: dict[str | None, list[Any]] = {c: [] for c in [*constraints, None]}
        for c in order:
            runs.append(rate_round(llm, c, n, max_tokens))
            spans[c].extend(llm.engine.collect_spans())

    res: dict[str, Any] = {"pp": pp, "requests": n, "max_tokens": max_tokens, "runs": runs}
    res.update(summarize_rate(runs, constraints))
    res["unconstrained"]["compute_gap_ms"] = compute_gap_ms(spans[None])
    for c in constraints:
        res["constraints"][c]["compute_gap_ms"] = compute_gap_ms(spans[c])
        if want_spans and spans[c]:
            res["constraints"][c]["mask"] = mask_exposure(spans[c])
    return res


def summarize_rate(runs: list[dict[str, Any]], constraints: Sequence[str]) -> dict[str, Any]:
    """Each side's median rate over its rounds (one slow round on a shared machine moves a mean far) and
    each constraint's ratio to the unconstrained side; means beside them."""
    def stat(c: str | None, key: str, fn: Callable[[list[float]], float]) -> float | None:
        vals = [r[key] for r in runs if r["constraint"] == c and r[key] is not None]
        return fn(vals) if vals else None

    keys = ("output_tok_s", "decode_tok_s")
    out: dict[str, Any] = {"unconstrained": {k: stat(None, k, statistics.median) for k in keys},
                           "constraints": {}}
    for c in constraints:
        row: dict[str, Any] = {}
        for key in keys:
            cm, um = stat(c, key, statistics.median), stat(None, key, statistics.median)
            cmean, umean = stat(c, key, statistics.fmean), stat(None, key, statistics.fmean)
            row[key] = {"constrained": cm, "unconstrained": um, "ratio": cm / um if cm and um else None,
                        "ratio_of_means": cmean / umean if cmean and umean else None}
        out["constraints"][c] = row
    return out


# ---- tables ---------------------------------------------------------------------------------------------
def print_tables(res: dict[str, Any]) -> None:
    if "validity" in res:
        v = res["validity"]
        print(f"\n### Validity ({v['path']}, {v['schemas']} schemas, max_tokens {v['max_tokens']})\n")
        print("| mode | requests | finish stop | valid of stop | valid of stop, formats asserted | "
              "mean tokens |")
        print("|---|---|---|---|---|---|")
        for mode, s in v["summary"].items():
            print(f"| {mode} | {s['requests']} | {fmt_pct(s['stop_pct'])} | "
                  f"{fmt_pct(s['valid_of_stop_pct'])} | {fmt_pct(s['valid_formats_of_stop_pct'])} | "
                  f"{s['mean_completion_tokens'] or 0:.0f} |")
        bad = [r for r in v["rows"] if r["finish_reason"] != "stop" or not r["valid_formats"]]
        for r in bad:
            print(f"- {r['schema']} ({r['mode']}): finish {r['finish_reason']}, valid {r['valid']}, "
                  f"formats {r['valid_formats']}: {r['error']}")
    if "tools" in res:
        t = res["tools"]
        print("\n### Tool calls\n")
        if t.get("skipped"):
            print(f"skipped: {t['skipped']}")
        else:
            print("| tool_choice / mode | requests | valid tool_calls |")
            print("|---|---|---|")
            for k, s in t["summary"].items():
                print(f"| {k} | {s['requests']} | {fmt_pct(s['valid_pct'])} |")
            for r in t["rows"]:
                if not r["valid"]:
                    print(f"- {r['tool_choice']}/{r['mode']} {r['prompt']!r}: {r['error']}")
    if "rate" in res:
        print("\n### Output rate, constrained / unconstrained (greedy, every request max_tokens long; "
              "medians of the rounds)\n")
        print("| pp | constraint | requests x tokens | constrained tok/s | unconstrained tok/s | ratio | "
              "decode-window ratio | ratio of means |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res["rate"]:
            for c, row in r["constraints"].items():
                o, d = row["output_tok_s"], row["decode_tok_s"]
                dr = f"{d['ratio']:.3f}x" if d["ratio"] else "-"
                print(f"| {r['pp']} | {c} | {r['requests']} x {r['max_tokens']} | {o['constrained']:.1f} | "
                      f"{o['unconstrained']:.1f} | {o['ratio']:.3f}x | {dr} | {o['ratio_of_means']:.3f}x |")
    masks = [(r["pp"], c, row["mask"], row["compute_gap_ms"] or 0.0,
              r["unconstrained"]["compute_gap_ms"] or 0.0)
             for r in res.get("rate", []) for c, row in r["constraints"].items() if "mask" in row]
    if masks:
        print("\n### Mask time exposed on the decode cycle\n")
        print("| pp | constraint | microbatches | exposed / compute mean | p90 | fully hidden | "
              "mask span mean | mask / compute mean | compute span mean | last - first compute |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for pp, c, m, gap, gap_u in masks:
            print(f"| {pp} | {c} | {m['microbatches']} | {100 * m['exposed_fraction_mean']:.2f} % | "
                  f"{100 * m['exposed_fraction_p90']:.2f} % | {fmt_pct(m['hidden_pct'])} | "
                  f"{m['mask_ms_mean']:.3f} ms | {100 * m['mask_over_compute_mean']:.2f} % | "
                  f"{m['compute_ms_mean']:.2f} ms | {gap:.2f} ms (unconstrained {gap_u:.2f}) |")
    if "compile" in res:
        rows = res["compile"]["rows"]
        print("\n### Compile time per schema (ms)\n")
        print("| schema | cold | cached |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['schema']} | {r['cold_ms']:.2f} | {r['cached_ms']:.3f} |")
        c = res["compile"]
        print(f"| **total ({len(rows)})** | **{c['cold_total_ms']:.1f}** | **{c['cached_total_ms']:.3f}** |")


# ---- main -----------------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    from ppserve.bench.report import results_dir

    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(ALL_PARTS)
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}; known: {', '.join(ALL_PARTS)}")
    cases = SCHEMAS[: args.schemas] if args.schemas else SCHEMAS
    out_dir = Path(args.out) if args.out else results_dir(REPO / "results", "structured",
                                                          "quick" if args.quick else "full")
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"args": vars(args), "part_seconds": {}}
    t0 = time.perf_counter()
    if "compile" in parts:
        rows = compile_times(cases)
        res["compile"] = {"rows": rows, "cold_total_ms": sum(r["cold_ms"] for r in rows),
                          "cached_total_ms": sum(r["cached_ms"] for r in rows)}
        res["part_seconds"]["compile"], t0 = time.perf_counter() - t0, time.perf_counter()
    if "validity" in parts or "tools" in parts:
        with http_server(out_dir) as (client, model):
            res["part_seconds"]["server_start"] = t_part = time.perf_counter() - t0
            print(f"server up in {t_part:.0f} s", flush=True)
            if "validity" in parts:
                why = refusal(lambda: client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Return a JSON object."}],
                    max_tokens=4, response_format=response_format(cases[0])))
                if why is None:
                    rows = validity_http(client, model, cases, args.max_tokens, args.concurrency)
                    path = "http"
                else:
                    print(f"the server refuses response_format ({why}); validity runs offline", flush=True)
                    rows, path = None, f"offline (LLM.chat): the HTTP API refused response_format: {why}"
                res["validity"] = {"path": path, "schemas": len(cases), "max_tokens": args.max_tokens,
                                   "rows": rows}
                res["part_seconds"]["validity"] = time.perf_counter() - t0 - t_part
                t_part += res["part_seconds"]["validity"]
            if "tools" in parts:
                why = refusal(lambda: client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=4,
                    tools=TOOLS, tool_choice="required"))
                if why is None:
                    prompts = TOOL_PROMPTS[: args.tool_prompts]
                    rows = tools_http(client, model, args.max_tokens, args.concurrency, prompts)
                    res["tools"] = {"rows": rows, "summary": summarize_tools(rows)}
                else:
                    res["tools"] = {"skipped": f"the HTTP API refused tools: {why}"}
                res["part_seconds"]["tools"] = time.perf_counter() - t0 - t_part
        if "validity" in res and res["validity"]["rows"] is None:
            res["validity"]["rows"] = validity_offline(cases, args.max_tokens)
        if "validity" in res:
            res["validity"]["summary"] = summarize_validity(res["validity"]["rows"])
        res["part_seconds"]["validity+tools"], t0 = time.perf_counter() - t0, time.perf_counter()
    if "rate" in parts or "mask" in parts:
        pps = [int(p) for p in args.pp.split(",")]
        if "rate" not in parts:  # the mask figure alone: the pp >= 2 runs only
            pps = [p for p in pps if p > 1]
        constraints = [c for c in args.constraints.split(",") if c]
        res["rate"] = [rate_at(pp, args.requests, args.rate_tokens, args.rounds, constraints,
                               "mask" in parts and pp > 1, warmup=not args.quick) for pp in pps]
        res["part_seconds"]["rate+mask"] = time.perf_counter() - t0
    print_tables(res)
    from ppserve.bench.report import write_json

    path = write_json(out_dir / "structured.json", res)
    print("\nseconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in res["part_seconds"].items()))
    print(f"wrote {path}")
    return res


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(ALL_PARTS),
                    help=f"comma-separated, of {', '.join(ALL_PARTS)}")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 3 schemas, tiny loads, pp 1 only, no warm-up rounds")
    ap.add_argument("--schemas", type=int, default=0, help="the first N schemas of the suite (0: all)")
    ap.add_argument("--max-tokens", type=int, default=400, help="validity and tools requests' max_tokens")
    ap.add_argument("--concurrency", type=int, default=8, help="HTTP requests in flight at a time")
    ap.add_argument("--tool-prompts", type=int, default=len(TOOL_PROMPTS))
    ap.add_argument("--pp", default="1,2", help="pipeline sizes of the rate part")
    ap.add_argument("--requests", type=int, default=16, help="concurrent requests of the rate part")
    ap.add_argument("--rate-tokens", type=int, default=64, help="output tokens per rate-part request")
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds of each side per pp")
    ap.add_argument("--constraints", default="regex,json",
                    help="the rate part's constraints: regex ([a-z ]{N}), json (an over-long array)")
    ap.add_argument("--out", help="results folder (default results/<date-time>-structured-<tag>/)")
    args = ap.parse_args(argv)
    if args.quick:
        args.schemas = args.schemas or 3
        args.max_tokens = min(args.max_tokens, 160)
        args.tool_prompts = min(args.tool_prompts, 2)
        args.requests, args.rate_tokens, args.rounds = 4, 8, 1
        args.pp, args.constraints = "1", "regex"
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
