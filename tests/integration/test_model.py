"""Our Llama-family model against transformers as the oracle: chunked prefill, mixed batches, PP and TP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ppserve.model.attention import AttentionMetadata
from ppserve.model.loader import iter_weights, read_hf_config
from ppserve.model.registry import build_stage_model, describe_model
from tests.model_helpers import (
    LLAMA3_ROPE,
    TP_PROMPTS,
    PagedRunner,
    hf_logits,
    hf_model,
    load_stages,
    make_tiny_llama_dir,
    tp_scenario,
    tp_worker,
)

ATOL = 1e-4
PROMPT = [int(x) for x in torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(1))]

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie=True),
    "qwen2": dict(arch="qwen2"),
    "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = make_tiny_llama_dir(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    return path, hf_model(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tp_llama"))


def test_arch_reads_config(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, ref = tiny
    arch = describe_model(read_hf_config(path))
    assert arch.num_layers == 4 and arch.num_heads == 4 and arch.num_kv_heads == 2 and arch.head_dim == 16
    assert arch.tie_word_embeddings == ref.config.tie_word_embeddings
    assert arch.attention_bias == (arch.architecture == "Qwen2ForCausalLM")


def test_unsupported_architecture_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        describe_model({"architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("chunk", [len(PROMPT), 1, 3, 7])
def test_chunked_prefill_matches_transformers(tiny: tuple[Path, torch.nn.Module], chunk: int) -> None:
    path, ref = tiny
    runner = PagedRunner(load_stages(path, [0, 4]), block_size=4)
    ours = runner.run_chunked(0, PROMPT, chunk)
    torch.testing.assert_close(ours, hf_logits(ref, PROMPT), atol=ATOL, rtol=0)
    # The block table really is scattered, so the test exercises the paged read path.
    table = runner.tables[0]
    assert table != sorted(table) or table != list(range(table[0], table[0] + len(table)))


def test_mixed_batch_of_decodes_and_prefill_chunk(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, ref = tiny
    runner = PagedRunner(load_stages(path, [0, 4]), block_size=4)
    a, b, c = PROMPT[:10], PROMPT[10:16], PROMPT[5:19]
    runner.run_chunked(0, a, 4)
    runner.run_chunked(1, b, 6)
    runner.step([(2, c[:3])])  # sequence 2 already has context before its chunk in the mixed step
    # A prefill chunk between two decodes: the flat token order interleaves both kinds.
    out = runner.step([(0, [7]), (2, c[3:11]), (1, [9])])
    torch.testing.assert_close(out[0][0], hf_logits(ref, [*a, 7])[-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(ref, c[:11])[3:11], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2][0], hf_logits(ref, [*b, 9])[-1], atol=ATOL, rtol=0)


def test_two_pipeline_stages_match_one(tiny: tuple[Path, torch.nn.Module]) -> None:
    path, ref = tiny
    stages = load_stages(path, [0, 2, 4])
    assert stages[0].is_first and not stages[0].is_last and stages[0].lm_head is None
    assert stages[1].is_last and not stages[1].is_first and stages[1].embed_tokens is None
    assert len(stages[0].layers) == 2 and len(stages[1].layers) == 2
    ours = PagedRunner(stages).run_chunked(0, PROMPT, 5)
    torch.testing.assert_close(ours, hf_logits(ref, PROMPT), atol=ATOL, rtol=0)


def test_greedy_generation_matches_transformers_generate(tiny_llama: Path) -> None:
    ref = hf_model(tiny_llama)
    prompt = PROMPT[:9]
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                            min_new_tokens=0)[0, len(prompt):].tolist()
    ours = PagedRunner(load_stages(tiny_llama, [0, 4])).greedy(0, prompt, 20, chunk=4)
    assert len(set(ours)) > 2, "degenerate model: greedy output should vary"
    assert ours == expected


def test_tensor_parallel_2_matches_tp_1(tiny_llama: Path, tmp_path: Path) -> None:
    expected = tp_scenario(load_stages(tiny_llama, [0, 4])[0])
    mp.spawn(tp_worker, args=(2, str(tmp_path / "init"), str(tiny_llama), TP_PROMPTS, str(tmp_path)),
             nprocs=2, join=True)
    got = torch.load(tmp_path / "logits.pt")
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)


def test_missing_tensor_is_reported(tiny_llama: Path) -> None:
    arch = describe_model(read_hf_config(tiny_llama))
    model = build_stage_model(arch, 2, 4)
    weights = [(n, t)
               for n, t in iter_weights(tiny_llama, 2, 4, 4, False, True) if "layers.3.mlp.up_proj" not in n]
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        model.load_weights(weights)


def test_stage_loads_only_its_layers(tiny_llama: Path) -> None:
    names = [n for n, _ in iter_weights(tiny_llama, 1, 3, 4, need_embed=False, need_head=False)]
    assert names and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in names)


@pytest.mark.parametrize("arch_name", ["llama", "phi3"])
def test_a_tp_rank_reads_only_its_shard_from_disk(tmp_path: Path, arch_name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """TP rank r of 2 loads exactly rows/columns of its shard, and reads about half of the sharded bytes."""
    from safetensors import safe_open

    from ppserve.model.checkpoint_tensor import CheckpointTensor
    from ppserve.model.parallel import TPContext
    from tests.model_helpers import make_tiny_llama_dir

    model_dir = make_tiny_llama_dir(tmp_path / arch_name, arch=arch_name, num_layers=4, hidden=64, heads=4,
                                    kv_heads=2)
    arch = describe_model(read_hf_config(model_dir))
    read_bytes = 0
    real_read = CheckpointTensor._read

    def counting_read(self, index):  # type: ignore[no-untyped-def]
        nonlocal read_bytes
        t = real_read(self, index)
        read_bytes += t.numel() * t.element_size()
        return t

    monkeypatch.setattr(CheckpointTensor, "_read", counting_read)
    (path,) = list(model_dir.glob("*.safetensors"))
    with safe_open(str(path), framework="pt") as f:
        layer_bytes = sum(f.get_tensor(n).numel() * 4 for n in f.keys()
                          if n.startswith(("model.layers.1.", "model.layers.2.")))
        full = {n: f.get_tensor(n) for n in f.keys()}
    per_rank = []
    for rank in (0, 1):
        read_bytes = 0
        model = build_stage_model(arch, 1, 3, TPContext(rank=rank, size=2))  # a middle stage
        model.load_weights(iter_weights(model_dir, 1, 3, 4, need_embed=False, need_head=False))
        per_rank.append(read_bytes)
        down = model.layers[1].mlp.down_proj.weight  # row-parallel: this rank's columns
        cols = down.shape[1]
        torch.testing.assert_close(
            down, full["model.layers.2.mlp.down_proj.weight"][:, rank * cols:(rank + 1) * cols])
    # The norms are replicated, the rest is split: each rank reads a little more than half.
    for b in per_rank:
        assert 0.45 * layer_bytes < b < 0.6 * layer_bytes, (b, layer_bytes)


def test_metadata_slot_mapping_follows_block_table() -> None:
    meta = AttentionMetadata.build([1, 3], [6, 3], [[7, 2], [4]], block_size=4, device="cpu")
    # seq 0: position 5 -> block 2, offset 1; seq 1: positions 0..2 in block 4
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 16, 17, 18]
    assert meta.decode_seqs == [0] and meta.prefill_seqs == [1]
    assert meta.cu_query_lens == [0, 1, 4]
    assert meta.context_slots().tolist() == [28, 29, 30, 31, 8, 9, 16, 17, 18]


def test_whole_prompts_of_one_length_side_by_side_take_one_batched_call() -> None:
    from ppserve.model.attention import SdpaBackend

    # seqs: a decode, three whole 4-token prompts, a chunk with earlier context, two whole 2-token prompts,
    # a whole 3-token prompt
    query_lens, context_lens = [1, 4, 4, 4, 2, 2, 2, 3], [5, 4, 4, 4, 6, 2, 2, 3]
    tables = [[i * 2, i * 2 + 1] for i in range(len(query_lens))]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size=4)
    assert meta.prefill_runs == [(1, 3), (4, 1), (5, 2), (7, 1)]

    g = torch.Generator().manual_seed(0)
    t, hq, hkv, d = sum(query_lens), 4, 2, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    cache = torch.randn(2, 2 * len(query_lens), 4, hkv, d, generator=g)
    backend = SdpaBackend()
    batched = backend.forward(q, k, v, cache.clone(), meta, d ** -0.5)
    one_by_one = AttentionMetadata.build(query_lens, context_lens, tables, block_size=4)
    one_by_one.__dict__["prefill_runs"] = [(i, 1) for i in one_by_one.prefill_seqs]
    # bit for bit what one call per prompt gives
    assert torch.equal(batched, backend.forward(q, k, v, cache.clone(), one_by_one, d ** -0.5))


def test_attention_backend_choice_on_cpu():
    """On CPU `auto` is the native paged kernel when it builds (SDPA otherwise); `sdpa` forces SDPA. The exact
    type is checked: the paged backend is an SDPA subclass, so isinstance would pass whatever was picked."""
    from ppserve.model.attention import CpuPagedBackend, SdpaBackend
    from ppserve.model.backend_select import select_backend
    from ppserve.model.ops import native

    expected = CpuPagedBackend if native.paged_decode() is not None else SdpaBackend
    assert type(select_backend("cpu")) is expected
    assert type(select_backend("cpu", "sdpa")) is SdpaBackend


def test_kernel_switches_are_config_fields(tiny_llama_dir, monkeypatch):
    """model.native_kernels=false keeps a stage on torch (SDPA attention, no native element-wise ops); the
    environment overrides the config for experiments."""
    from ppserve import LLM, SamplingParams
    from ppserve.model.attention import SdpaBackend
    from ppserve.model.ops import native
    from ppserve.model.ops.settings import KernelSettings, configure, current

    try:
        with LLM(str(tiny_llama_dir), executor="inproc", dtype="float32",
                 overrides=["model.native_kernels=false", "model.linear_path=plain"]) as llm:
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
            backend = llm.engine.executor.workers[0].model.layers[0].self_attn.backend
            assert type(backend) is SdpaBackend
            assert native.elementwise() is None and current().linear_path == "plain"
        configure(KernelSettings())
        monkeypatch.setenv("PPSERVE_LINEAR_PATH", "packed")
        monkeypatch.setenv("PPSERVE_DISABLE_AMX", "1")
        assert current() == KernelSettings(linear_path="packed", amx=False)
    finally:
        configure(KernelSettings())
