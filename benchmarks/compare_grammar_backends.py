"""Side-by-side measurement of xgrammar and llguidance on JSON-schema constrained decoding.

Run: python benchmarks/compare_grammar_backends.py [--tok DIR] [--reps N] [--out FILE]
(in an environment with both xgrammar and llguidance installed)

For each library:
  * tokenizer index build time (once);
  * cold compile time per schema (median of --reps fresh compiles; xgrammar's cache is off,
    llguidance has no cross-matcher cache), plus accepted/rejected with the error's first line;
  * mask time per step while a fresh matcher is driven through a hand-written valid instance
    (its HF tokenization, each token checked against the mask before it is accepted), then EOS.

JSON is compiled compact on both sides (xgrammar any_whitespace=False, llguidance
whitespace_flexible=False), as ppserve/structured/backend.py does for xgrammar.
"""
import argparse
import glob
import json
import os
import statistics
import sys
import time

import numpy as np

# ----------------------------------------------------------------------------- schema suite
# (name, schema, valid instance). Instances list properties in schema order (both libraries
# emit declared properties in declaration order).
S = []


def add(name, schema, inst):
    S.append((name, schema, inst))


def obj(props, required=None, **kw):
    d = {"type": "object", "properties": props}
    if required is not None:
        d["required"] = required
    d.update(kw)
    return d


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

add("simple_object", obj({"name": STR, "age": INT}, ["name", "age"]), {"name": "Alice", "age": 30})
add("nested_object",
    obj({"user": obj({"name": STR, "address": obj({"street": STR, "city": STR, "zip": STR},
                                                  ["street", "city", "zip"])}, ["name", "address"]),
         "active": BOOL}, ["user", "active"]),
    {"user": {"name": "Bob", "address": {"street": "1 Main St", "city": "Paris", "zip": "75001"}},
     "active": True})
add("array_min_max", obj({"tags": {"type": "array", "items": STR, "minItems": 1, "maxItems": 5}}, ["tags"]),
    {"tags": ["red", "green", "blue"]})
add("enum_strings", obj({"status": {"type": "string", "enum": ["pending", "active", "closed", "archived"]}},
                        ["status"]), {"status": "closed"})
add("enum_mixed", obj({"v": {"enum": [1, "two", None, True, 3.5]}}, ["v"]), {"v": "two"})
add("anyOf_scalar", obj({"value": {"anyOf": [STR, NUM]}, "unit": STR}, ["value", "unit"]),
    {"value": 12.75, "unit": "kg"})
add("ref_defs",
    {"$defs": {"addr": obj({"street": STR, "city": STR}, ["street", "city"])},
     **obj({"home": {"$ref": "#/$defs/addr"}, "work": {"$ref": "#/$defs/addr"}}, ["home", "work"])},
    {"home": {"street": "A st", "city": "Rome"}, "work": {"street": "B ave", "city": "Oslo"}})
add("recursive_ref",
    {"$defs": {"node": obj({"value": INT, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                           ["value", "children"])},
     "$ref": "#/$defs/node"},
    {"value": 1, "children": [{"value": 2, "children": []},
                              {"value": 3, "children": [{"value": 4, "children": []}]}]})
add("string_pattern",
    obj({"phone": {"type": "string", "pattern": "^\\+?[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
         "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}, ["phone", "code"]),
    {"phone": "+555-123-4567", "code": "AB12"})
add("format_date_time", obj({"ts": {"type": "string", "format": "date-time"}}, ["ts"]),
    {"ts": "2024-05-01T12:34:56Z"})
add("format_email", obj({"email": {"type": "string", "format": "email"}}, ["email"]),
    {"email": "alice.smith@example.com"})
add("formats_misc",
    obj({"d": {"type": "string", "format": "date"}, "t": {"type": "string", "format": "time"},
         "id": {"type": "string", "format": "uuid"}, "url": {"type": "string", "format": "uri"},
         "ip": {"type": "string", "format": "ipv4"}}, ["d", "t", "id", "url", "ip"]),
    {"d": "2024-02-29", "t": "12:34:56Z", "id": "123e4567-e89b-12d3-a456-426614174000",
     "url": "https://example.com/a?b=1", "ip": "192.168.0.1"})
add("numeric_bounds",
    obj({"age": {"type": "integer", "minimum": 0, "maximum": 120},
         "score": {"type": "number", "minimum": 0.5, "maximum": 99.5}}, ["age", "score"]),
    {"age": 42, "score": 87.25})
add("exclusive_bounds",
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1000},
         "count": {"type": "integer", "exclusiveMinimum": 10}}, ["price", "count"]),
    {"price": 12.5, "count": 11})
add("optional_fields", obj({"a": STR, "b": INT, "c": BOOL, "d": NUM}, ["a"]), {"a": "x", "c": False})
add("nullable",
    obj({"nick": {"type": ["string", "null"]}, "parent": {"anyOf": [INT, {"type": "null"}]}},
        ["nick", "parent"]),
    {"nick": None, "parent": 7})
add("const", obj({"version": {"const": "v1"}, "kind": {"const": 3}, "payload": STR},
                 ["version", "kind", "payload"]), {"version": "v1", "kind": 3, "payload": "hi"})
add("additional_props_false",
    obj({"id": INT, "meta": obj({"k": STR}, ["k"], additionalProperties=False)}, ["id", "meta"],
        additionalProperties=False),
    {"id": 5, "meta": {"k": "v"}})
add("oneOf_discriminated",
    obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": NUM}, ["kind", "r"],
                                 additionalProperties=False),
                             obj({"kind": {"const": "square"}, "side": NUM}, ["kind", "side"],
                                 additionalProperties=False)]}}, ["shape"]),
    {"shape": {"kind": "square", "side": 2.5}})
add("allOf_merge",
    {"allOf": [obj({"a": STR}, ["a"]), obj({"b": INT}, ["b"])]},
    {"a": "x", "b": 2})
add("uniqueItems", obj({"ids": {"type": "array", "items": INT, "uniqueItems": True}}, ["ids"]),
    {"ids": [3, 1, 4, 15]})
add("min_max_length", obj({"code": {"type": "string", "minLength": 3, "maxLength": 8},
                           "note": {"type": "string", "maxLength": 40}}, ["code", "note"]),
    {"code": "ABCD1", "note": "short note"})
add("array_of_objects",
    obj({"items": {"type": "array", "minItems": 2,
                   "items": obj({"id": INT, "price": NUM, "qty": INT}, ["id", "price", "qty"])}}, ["items"]),
    {"items": [{"id": 1, "price": 9.99, "qty": 2}, {"id": 2, "price": 0.5, "qty": 10}]})
add("tuple_prefixItems",
    {"type": "array", "prefixItems": [STR, INT, BOOL], "items": False, "minItems": 3},
    ["x", 1, True])
add("map_additionalProperties", {"type": "object", "additionalProperties": INT},
    {"apples": 3, "pears": 11})
add("deep_nesting",
    obj({"l1": obj({"l2": obj({"l3": obj({"l4": obj({"l5": obj({"leaf": STR}, ["leaf"])}, ["l5"])}, ["l4"])},
                              ["l3"])}, ["l2"])}, ["l1"]),
    {"l1": {"l2": {"l3": {"l4": {"l5": {"leaf": "deep"}}}}}})
add("tool_call",
    obj({"name": {"type": "string", "enum": ["get_weather", "search"], "description": "tool"},
         "arguments": obj({"location": {"type": "string", "description": "City"},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                          ["location", "unit"], additionalProperties=False)},
        ["name", "arguments"], additionalProperties=False),
    {"name": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius", "days": 3}})
_big = {}
_big_inst = {}
for i in range(25):
    kind = i % 5
    k = f"field_{i:02d}"
    if kind == 0:
        _big[k], _big_inst[k] = STR, f"value {i}"
    elif kind == 1:
        _big[k], _big_inst[k] = INT, i * 7
    elif kind == 2:
        _big[k], _big_inst[k] = BOOL, bool(i % 2)
    elif kind == 3:
        _big[k], _big_inst[k] = {"type": "array", "items": NUM}, [i, i + 0.5]
    else:
        _big[k], _big_inst[k] = {"type": "string", "enum": ["lo", "mid", "hi"]}, "mid"
add("large_object_25", obj(_big, list(_big)), _big_inst)
add("multipleOf", obj({"n": {"type": "integer", "multipleOf": 5}}, ["n"]), {"n": 35})
add("string_escapes", obj({"text": STR}, ["text"]),
    {"text": "He said \"hi\" \u2014 caf\u00e9 \u2713\n\ttab\\"})
add("fixed_len_enum_array",
    obj({"rgb": {"type": "array", "items": {"enum": ["r", "g", "b"]}, "minItems": 3, "maxItems": 3}},
        ["rgb"]),
    {"rgb": ["g", "b", "r"]})
add("nested_arrays",
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": NUM, "minItems": 2, "maxItems": 2}}},
        ["matrix"]),
    {"matrix": [[1, 2.5], [-3, 4e2]]})
add("min_max_properties",
    {"type": "object", "additionalProperties": STR, "minProperties": 1, "maxProperties": 3},
    {"a": "1", "b": "2"})


# Invalid instances: each violates exactly the keyword the schema is about. A library "enforces"
# it when the matcher rejects one of the tokens or refuses EOS at the end.
NEG = {
    "array_min_max": [{"tags": []}, {"tags": ["a", "b", "c", "d", "e", "f"]}],
    "enum_strings": [{"status": "open"}],
    "enum_mixed": [{"v": 2}],
    "anyOf_scalar": [{"value": True, "unit": "kg"}],
    "recursive_ref": [{"value": 1, "children": [{"value": "x", "children": []}]}],
    "string_pattern": [{"phone": "555-1234", "code": "AB12"}, {"phone": "+555-123-4567", "code": "ab12"}],
    "format_date_time": [{"ts": "yesterday"}, {"ts": "2024-13-01T12:34:56Z"}],
    "format_email": [{"email": "not-an-email"}],
    "formats_misc": [{"d": "2024-02-29", "t": "12:34:56Z", "id": "not-a-uuid",
                      "url": "https://example.com/a?b=1", "ip": "192.168.0.1"},
                     {"d": "2024-02-29", "t": "12:34:56Z", "id": "123e4567-e89b-12d3-a456-426614174000",
                      "url": "https://example.com/a?b=1", "ip": "999.1.1.1"}],
    "numeric_bounds": [{"age": 121, "score": 87.25}, {"age": 42, "score": 0.25}],
    "exclusive_bounds": [{"price": 0, "count": 11}, {"price": 12.5, "count": 10}],
    "optional_fields": [{"c": False}],
    "nullable": [{"nick": 1, "parent": 7}],
    "const": [{"version": "v2", "kind": 3, "payload": "hi"}],
    "additional_props_false": [{"id": 5, "meta": {"k": "v"}, "x": 1}],
    "oneOf_discriminated": [{"shape": {"kind": "circle", "side": 2.5}}],
    "allOf_merge": [{"a": "x"}, {"b": 2}],
    "uniqueItems": [{"ids": [1, 1]}],
    "min_max_length": [{"code": "AB", "note": "x"}, {"code": "ABCDEFGHI", "note": "x"}],
    "tuple_prefixItems": [["x", 1, True, 4], [1, 1, True]],
    "map_additionalProperties": [{"apples": "3"}],
    "tool_call": [{"name": "get_weather", "arguments": {"location": "SF", "unit": "celsius", "days": 15}}],
    "multipleOf": [{"n": 36}],
    "fixed_len_enum_array": [{"rgb": ["g", "b"]}],
    "nested_arrays": [{"matrix": [[1, 2, 3]]}],
    "min_max_properties": [{}, {"a": "1", "b": "2", "c": "3", "d": "4"}],
}


# ----------------------------------------------------------------------------- helpers
def first_line(e):
    s = str(e).strip()
    return (s.splitlines() or [""])[0][:200]


def us_stats(ns):
    if not ns:
        return None
    a = np.array(ns, dtype=np.float64) / 1e3
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "mean": float(a.mean()), "max": float(a.max())}


def bit(mask_row_np, t):
    return (int(mask_row_np[t >> 5]) >> (t & 31)) & 1


def popcount(mask_row_np, V):
    b = np.unpackbits(mask_row_np.view(np.uint8), bitorder="little")
    return int(b[:V].sum())


def find_tokenizer_dir():
    c = sorted(glob.glob(os.path.expanduser("~/.cache/ppserve/SmolLM2-135M-Instruct*/tokenizer.json")))
    if not c:
        sys.exit("no converted SmolLM2-135M-Instruct dir with tokenizer.json under ~/.cache/ppserve")
    return os.path.dirname(c[0])


# ----------------------------------------------------------------------------- xgrammar
class XGR:
    name = "xgrammar"

    def __init__(self, tok, V, threads):
        import xgrammar as xgr
        self.xgr, self.V = xgr, V
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
        t1 = time.perf_counter()
        self.threads = threads
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        t2 = time.perf_counter()
        self.index_ms = {"tokenizer_info": (t1 - t0) * 1e3, "compiler": (t2 - t1) * 1e3}
        self.eos = list(self.info.stop_token_ids)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(",", ":"))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self):
        m = self.xgr.allocate_token_bitmask(1, self.V)
        return m, m.numpy()[0]

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask)

    def accept(self, m, t):
        return m.accept_token(t)

    def done(self, m):
        return m.is_terminated()


# ----------------------------------------------------------------------------- llguidance
class LLG:
    name = "llguidance"

    def __init__(self, tok, V):
        import llguidance
        import llguidance.hf
        import llguidance.numpy as lnp
        self.llg, self.lnp, self.V = llguidance, lnp, V
        t0 = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
        t1 = time.perf_counter()
        self.index_ms = {"from_tokenizer": (t1 - t0) * 1e3}
        self.eos = list(self.tok.eos_tokens)
        self.opts = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def compile(self, schema):
        # grammar text + matcher construction (the grammar is built and checked in the ctor);
        # llguidance has no compiled-grammar object, the matcher is the unit.
        g = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=self.opts)
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return g, m

    def matcher(self, compiled):
        g, m = compiled
        return m  # fresh: constructed by compile() and never used before

    def new_mask(self):
        a = self.lnp.allocate_token_bitmask(1, self.V)
        return a, a[0]

    def fill(self, m, mask):
        self.lnp.fill_next_token_bitmask(m, mask)

    def accept(self, m, t):
        return m.consume_token(t)

    def done(self, m):
        return m.is_stopped()


# ----------------------------------------------------------------------------- run
def compile_cold(lib, schema, reps):
    times, err, last = [], None, None
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        try:
            last = lib.compile(schema)
        except Exception as e:  # noqa: BLE001 - record any rejection
            err = first_line(e) or type(e).__name__
            times.append(time.perf_counter_ns() - t0)
            break
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6, err, last, [t / 1e6 for t in times]


def walk(lib, compiled, tokens):
    """Fresh matcher driven through `tokens` then EOS. Returns timings and outcome."""
    t0 = time.perf_counter_ns()
    m = lib.matcher(compiled)
    t_ctor = time.perf_counter_ns() - t0
    mask_t, mask_np = lib.new_mask()
    fill_ns, acc_ns = [], []
    first_allowed = None
    status = "ok"
    for i, t in enumerate(tokens + [None]):
        a = time.perf_counter_ns()
        lib.fill(m, mask_t)
        b = time.perf_counter_ns()
        fill_ns.append(b - a)
        if i == 0:
            first_allowed = popcount(mask_np, lib.V)
        if t is None:  # end of instance: EOS must be allowed
            eos = next((e for e in lib.eos if bit(mask_np, e)), None)
            if eos is None:
                status = "eos_not_allowed"
                break
            a = time.perf_counter_ns()
            ok = lib.accept(m, eos)
            acc_ns.append(time.perf_counter_ns() - a)
            if not ok:
                status = "eos_rejected"
            elif not lib.done(m):
                status = "not_terminated"
            break
        if not bit(mask_np, t):
            status = f"token_masked@{i}"
            break
        a = time.perf_counter_ns()
        ok = lib.accept(m, t)
        acc_ns.append(time.perf_counter_ns() - a)
        if not ok:
            status = f"token_rejected@{i}"
            break
    return {"status": status, "steps": len(fill_ns), "ctor_us": t_ctor / 1e3,
            "first_mask_us": fill_ns[0] / 1e3 if fill_ns else None,
            "first_allowed": first_allowed,
            "mask_us": us_stats(fill_ns), "mask_us_after_first": us_stats(fill_ns[1:]),
            "accept_us": us_stats(acc_ns), "_fill_ns": fill_ns, "_acc_ns": acc_ns}


def enforces(lib, schema, tokens):
    """True when a fresh matcher refuses the invalid token sequence (a token or the final EOS)."""
    compiled = lib.compile(schema)
    m = lib.matcher(compiled)
    for t in tokens:
        if not lib.accept(m, t):
            return True
    return not any(lib.accept(m.deep_copy() if hasattr(m, "deep_copy") else m, e) for e in lib.eos[:1])


def warmup(lib):
    c = lib.compile({"type": "object", "properties": {"w": {"type": "string"}}, "required": ["w"]})
    m = lib.matcher(c)
    mask, _ = lib.new_mask()
    lib.fill(m, mask)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="xgrammar GrammarCompiler max_threads")
    ap.add_argument("--out", default="benchmarks/results/grammar_backends.json")
    ap.add_argument("--only", default=None, help="comma list of schema names")
    args = ap.parse_args()

    import importlib.metadata as md

    from transformers import AutoTokenizer

    tokdir = args.tok or find_tokenizer_dir()
    V = json.load(open(os.path.join(tokdir, "config.json")))["vocab_size"]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(tokdir)
    hf_ms = (time.perf_counter() - t0) * 1e3

    versions = {p: md.version(p)
                for p in ("xgrammar", "llguidance", "torch", "transformers", "tokenizers", "numpy")}
    versions["python"] = sys.version.split()[0]

    libs = [XGR(tok, V, args.threads), LLG(tok, V)]
    print(f"tokenizer dir: {tokdir}\nvocab_size(config)={V} len(tok)={len(tok)} hf load {hf_ms:.0f} ms")
    print("versions:", versions)
    for L in libs:
        print(f"index build {L.name}: " + ", ".join(f"{k}={v:.1f} ms" for k, v in L.index_ms.items())
              + f"; eos={L.eos}")

    wu = {}
    for L in libs:
        t0 = time.perf_counter()
        warmup(L)
        wu[L.name] = (time.perf_counter() - t0) * 1e3
    print("process warm-up (first compile+mask, excluded): "
          + ", ".join(f"{k}={v:.1f} ms" for k, v in wu.items()))

    suite = S if not args.only else [s for s in S if s[0] in args.only.split(",")]
    rows = []
    all_fill = {L.name: [] for L in libs}
    all_acc = {L.name: [] for L in libs}
    for name, schema, inst in suite:
        text = json.dumps(inst, separators=(",", ":"), ensure_ascii=False)
        toks = tok.encode(text, add_special_tokens=False)
        assert tok.decode(toks) == text, name
        row = {"schema": name, "instance": text, "n_tokens": len(toks)}
        for L in libs:
            ms, err, compiled, all_ms = compile_cold(L, schema, args.reps)
            r = {"compile_ms": ms, "compile_ms_all": all_ms, "accepted": err is None, "error": err}
            if err is None:
                w = walk(L, compiled, toks)
                if w["status"] == "ok":
                    all_fill[L.name] += w["_fill_ns"]
                    all_acc[L.name] += w["_acc_ns"]
                w.pop("_fill_ns"), w.pop("_acc_ns")
                r.update(w)
            row[L.name] = r
        negs = NEG.get(name, [])
        for L in libs:
            r = row[L.name]
            if r["accepted"] and negs:
                res = []
                for bad in negs:
                    bt = tok.encode(json.dumps(bad, separators=(",", ":"), ensure_ascii=False),
                                    add_special_tokens=False)
                    try:
                        res.append(enforces(L, schema, bt))
                    except Exception as e:  # noqa: BLE001
                        res.append(f"error: {first_line(e)}")
                r["negatives"] = res
                r["enforced"] = all(x is True for x in res)
        rows.append(row)

    # ---------------------------------------------------------------- table
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    hdr = (f"{'schema':<26}{'tok':>4} | {'xgr ms':>8} {'llg ms':>8} | {'xgr p50':>8} {'p90':>7} | "
           f"{'llg p50':>8} {'p90':>7} | {'xgr 1st':>8} {'llg 1st':>8} | {'xgr':>4} {'llg':>4}")
    print(f"\ncompile = median of {args.reps} cold compiles; mask = fill_next_token_bitmask per step, µs; "
          "1st = first mask on a fresh matcher, µs; xgr/llg = accepted (Y) / rejected (N), "
          "! = instance walk failed, ~ = accepted but an invalid instance got through")
    print(hdr)
    print("-" * len(hdr))
    for row in rows:
        x, g = row["xgrammar"], row["llguidance"]
        cells = []
        for r in (x, g):
            ms = r.get("mask_us") or {}
            cells.append((f(ms.get("p50"), "{:.1f}"), f(ms.get("p90"), "{:.1f}")))

        def acc(r):
            if not r["accepted"]:
                return "N"
            if r.get("status") != "ok":
                return "Y!"
            return "Y" if r.get("enforced", True) else "Y~"
        print(f"{row['schema']:<26}{row['n_tokens']:>4} | {x['compile_ms']:>8.2f} {g['compile_ms']:>8.2f} | "
              f"{cells[0][0]:>8} {cells[0][1]:>7} | {cells[1][0]:>8} {cells[1][1]:>7} | "
              f"{f(x.get('first_mask_us'), '{:.0f}'):>8} {f(g.get('first_mask_us'), '{:.0f}'):>8} | "
              f"{acc(x):>4} {acc(g):>4}")

    # ---------------------------------------------------------------- totals
    totals = {}
    both = [r for r in rows if r["xgrammar"]["accepted"] and r["llguidance"]["accepted"]]
    for L in libs:
        n = L.name
        acc_rows = [r for r in rows if r[n]["accepted"]]
        totals[n] = {
            "index_build_ms": L.index_ms,
            "accepted": len(acc_rows),
            "rejected": [(r["schema"], r[n]["error"]) for r in rows if not r[n]["accepted"]],
            "walk_failed": [(r["schema"], r[n]["status"]) for r in acc_rows if r[n].get("status") != "ok"],
            "compile_ms_sum_accepted": sum(r[n]["compile_ms"] for r in acc_rows),
            "compile_ms_sum_common": sum(r[n]["compile_ms"] for r in both),
            "compile_ms_median_common": (statistics.median([r[n]["compile_ms"] for r in both])
                                         if both else None),
            "compile_ms_max_common": max([r[n]["compile_ms"] for r in both]) if both else None,
            "first_mask_us_median_common": statistics.median(
                [r[n]["first_mask_us"] for r in both if r[n].get("first_mask_us") is not None])
            if both else None,
            "not_enforced": [(r["schema"], r[n]["negatives"]) for r in acc_rows
                             if "negatives" in r[n] and not r[n]["enforced"]],
            "warmup_ms": wu[n],
            "mask_us_all_steps": us_stats(all_fill[n]),
            "accept_us_all_steps": us_stats(all_acc[n]),
        }
    print(f"\nTOTALS ({len(rows)} schemas; 'common' = the {len(both)} accepted by both)")
    for n, t in totals.items():
        ms, ac = t["mask_us_all_steps"] or {}, t["accept_us_all_steps"] or {}
        print(f"{n}: index {', '.join(f'{k}={v:.0f} ms' for k, v in t['index_build_ms'].items())}; "
              f"accepted {t['accepted']}/{len(rows)}; "
              f"compile sum(common) {t['compile_ms_sum_common']:.1f} ms, "
              f"median {f(t['compile_ms_median_common'])} ms, max {f(t['compile_ms_max_common'])} ms; "
              f"first mask median {f(t['first_mask_us_median_common'], '{:.0f}')} µs")
        print(f"   mask/step over {ms.get('n')} steps: p50 {f(ms.get('p50'), '{:.1f}')} p90 "
              f"{f(ms.get('p90'), '{:.1f}')} mean {f(ms.get('mean'), '{:.1f}')} "
              f"max {f(ms.get('max'), '{:.0f}')} µs;"
              f" accept/token p50 {f(ac.get('p50'), '{:.1f}')} p90 {f(ac.get('p90'), '{:.1f}')} "
              f"mean {f(ac.get('mean'), '{:.1f}')} µs")
        for s, e in t["rejected"]:
            print(f"   rejected {s}: {e}")
        for s, e in t["not_enforced"]:
            print(f"   accepted but NOT enforced {s}: invalid-instance rejected? {e}")
        for s, e in t["walk_failed"]:
            print(f"   walk failed {s}: {e}")

    out = {"versions": versions, "tokenizer_dir": tokdir, "vocab_size": V, "hf_tokenizer_load_ms": hf_ms,
           "settings": {"reps": args.reps, "xgrammar_max_threads": args.threads,
                        "xgrammar_cache_enabled": False, "xgrammar_any_whitespace": False,
                        "separators": [",", ":"], "llguidance_whitespace_flexible": False,
                        "llguidance_slices": "default (general_slices)", "cpu_count": os.cpu_count()},
           "totals": totals, "rows": rows,
           "schemas": {n: s for n, s, _ in suite}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1, ensure_ascii=False)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
