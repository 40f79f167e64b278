"""Config loading, overrides and validation messages (no torch)."""

import re

import pytest

from ppserve.config import EngineConfig, load_config, parse_overrides
from ppserve.request import SamplingParams


def test_defaults_and_yaml(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, EngineConfig) and cfg.scheduler.policy == "sarathi"
    p = tmp_path / "c.yaml"
    p.write_text("scheduler:\n  token_budget: 64\n"
                 "parallel:\n  pipeline_parallel_size: 2\n  layer_partition: [14, 16]\n")
    cfg = load_config(p, ["scheduler.policy=vllm", "cache.block_size=8"])
    assert cfg.scheduler.token_budget == 64 and cfg.scheduler.policy == "vllm"
    assert cfg.parallel.layer_partition == (14, 16) and cfg.cache.block_size == 8


def test_the_shipped_default_yaml_says_what_the_code_does():
    """configs/default.yaml documents the defaults; ppserve/config.py is their one source: equal."""
    from pathlib import Path

    path = Path(__file__).parents[2] / "ppserve" / "configs" / "default.yaml"
    assert load_config(path) == EngineConfig()
    # balanced out of the box: the head's stage is lighter
    assert EngineConfig().parallel.partition_mode == "cost"


def test_shipped_configs_load():
    from pathlib import Path

    for path in sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml")):
        load_config(path)


@pytest.mark.parametrize(
    "override,message",
    [
        ("scheduler.policy=fifo", "scheduler.policy"),
        ("scheduler.token_budget=0", "token_budget"),
        ("scheduler.token_budget=abc", "scheduler.token_budget must be an integer"),
        ("parallel.pipeline_parallel_size=0", "pipeline_parallel_size"),
        ("model.dtype=int8", "model.dtype"),
        ("nosuch.key=1", "unknown config key"),
        ("scheduler.nosuch=1", "scheduler.nosuch"),
        ("scheduler", "section.key=value"),
        ("cache.block_size=1.5", "cache.block_size must be an integer"),
        ("parallel.startup_timeout_s=0", "parallel.startup_timeout_s"),
        ("cache.gpu_memory_utilization=1.5", "cache.gpu_memory_utilization"),
        ("model.attention_backend=flashinfer", "model.attention_backend must be one of"),
        ("parallel.gpus_per_worker=-1", "parallel.gpus_per_worker"),
    ],
)
def test_validation_names_the_value(override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_config(overrides=[override])


def test_partition_length_must_match_stages():
    with pytest.raises(ValueError, match="layer_partition"):
        load_config(overrides=["parallel.layer_partition=[10,10,10]", "parallel.pipeline_parallel_size=2"])


def test_configs_are_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.scheduler.token_budget = 3  # type: ignore[misc]


def test_parse_overrides_yaml_scalars():
    assert parse_overrides(["a.b=1", "a.c=true", "d.e=[1, 2]"]) == {"a": {"b": 1, "c": True},
                                                                    "d": {"e": [1, 2]}}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_context_limit_respects_positions_and_sliding_window():
    from ppserve.engine.llm_engine import context_limit

    assert context_limit(None, 4096, None) == 4096
    assert context_limit(1024, 4096, None) == 1024
    assert context_limit(None, 4096, 2047) == 2047  # capped where full attention stops being exact
    assert context_limit(2000, 4096, 2047) == 2000
    with pytest.raises(ValueError, match="max_position_embeddings"):
        context_limit(5000, 4096, None)
    with pytest.raises(ValueError, match="sliding window of 2047"):
        context_limit(3000, 4096, 2047)


def test_every_section_takes_overrides():
    """Each section of EngineConfig is built from its mapping (a section missing from the table would be
    left a dict)."""
    import dataclasses

    cfg = load_config(None, ["structured.compile_timeout_s=5", "speculative.method=ngram",
                             "speculative.num_speculative_tokens=3"])
    assert cfg.structured.compile_timeout_s == 5.0
    assert cfg.speculative.method == "ngram" and cfg.speculative.num_speculative_tokens == 3
    for f in dataclasses.fields(EngineConfig):
        assert dataclasses.is_dataclass(getattr(cfg, f.name)), f.name


@pytest.mark.parametrize("override,message", [
    ("speculative.method=eagle", "speculative.method must be one of"),
    ("speculative.num_speculative_tokens=0", "num_speculative_tokens must be >= 1"),
    ("speculative.prompt_lookup_min=5", "1 <= min <= max"),
    ("speculative.min_accept_prob=1.5", "min_accept_prob must be in (0, 1)"),
])
def test_bad_speculative_settings_are_named(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, [override])


def test_llm_takes_vllms_speculative_config():
    from ppserve.engine.llm import LLM

    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        LLM(speculative_config="ngram")
