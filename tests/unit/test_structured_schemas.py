"""The structured-outputs benchmark's suite (benchmarks/structured_schemas.py): enough schemas of every
kind it claims, each a valid JSON Schema that compiles against the default model's tokenizer, and tools
whose parameters are valid schemas too."""

from __future__ import annotations

import re

import jsonschema
import pytest

from tests.bench_scripts import load_benchmark

suite = load_benchmark("structured_schemas")
KINDS = {"nested object", "array", "enum", "anyOf", "$ref", "$defs", "pattern", "format", "numeric bounds",
         "optional", "boolean", "nullable", "const"}


def test_the_suite_covers_every_kind():
    assert len(suite.SCHEMAS) >= 30
    names = [c.name for c in suite.SCHEMAS]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", n) for n in names)  # OpenAI's json_schema name
    assert KINDS <= {k for c in suite.SCHEMAS for k in c.kinds}
    assert all(c.prompt.startswith("Return a JSON object") for c in suite.SCHEMAS)


@pytest.mark.parametrize("case", suite.SCHEMAS, ids=lambda c: c.name)
def test_schema_is_valid_json_schema(case):
    jsonschema.validators.validator_for(case.schema).check_schema(case.schema)


def test_tools_parameters_are_valid():
    for t in suite.TOOLS:
        params = t["function"]["parameters"]
        jsonschema.validators.validator_for(params).check_schema(params)
        assert suite.tool_parameters(t["function"]["name"]) is params
    assert {name for _, name in suite.TOOL_PROMPTS} == {t["function"]["name"] for t in suite.TOOLS}


@pytest.fixture(scope="module")
def grammar_cache(default_model_dir):
    from transformers import AutoTokenizer

    from ppserve.model.loader import read_generation_defaults, read_hf_config
    from ppserve.model.registry import describe_model
    from ppserve.structured.backend import build_backend
    from ppserve.structured.grammars import GrammarCache

    arch = describe_model(read_hf_config(default_model_dir))
    _, gen_eos = read_generation_defaults(default_model_dir)
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    cache = GrammarCache(lambda: build_backend(tok, arch.vocab_size, (*arch.eos_token_ids, *gen_eos)))
    yield cache
    cache.shutdown()


def test_every_schema_and_tool_compiles(grammar_cache):
    from ppserve.structured.spec import StructuredOutputs

    schemas = [c.schema for c in suite.SCHEMAS] + [t["function"]["parameters"] for t in suite.TOOLS]
    for s in schemas:
        assert grammar_cache.get(StructuredOutputs(json=s)) is not None
    assert grammar_cache.stats.failures == 0
    assert grammar_cache.stats.compiles == len(schemas)
