"""Finding, configuring and loading models: HF folders (safetensors, sharded too), GGUF files,
and random 'dummy' weights."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

BUILTIN_CONFIGS = os.path.join(os.path.dirname(__file__), "configs")


def resolve_model_path(model: str, load_format: str) -> str:
    """With ``load_format='dummy'`` a built-in shape name (``qwen3-0.6b``, ``llama-3.1-8b``)
    stands for its config folder in ``pagedllm/model/configs``; other paths are unchanged."""
    builtin = os.path.join(BUILTIN_CONFIGS, model)
    if load_format == "dummy" and not os.path.exists(model) and os.path.isdir(builtin):
        return builtin
    return model


def detect_load_format(model: str, load_format: str = "auto") -> str:
    """'gguf' for a .gguf file, 'safetensors' for an HF folder; FileNotFoundError if neither.
    'dummy' (random weights) needs only a config folder or a built-in shape name."""
    if load_format == "dummy":
        if not os.path.exists(os.path.join(resolve_model_path(model, "dummy"), "config.json")):
            names = sorted(os.listdir(BUILTIN_CONFIGS))
            raise FileNotFoundError(
                f"model config not found: {model!r} (a folder with config.json, or one of {names})"
            )
        return "dummy"
    if not os.path.exists(model):
        raise FileNotFoundError(
            f"model not found: {model!r} (give an HF model folder or a .gguf file; "
            "nothing is downloaded)"
        )
    if os.path.isfile(model):
        if load_format in ("auto", "gguf"):
            return "gguf"
        raise ValueError(f"model {model!r} is a file; load_format {load_format!r} needs a folder")
    if not os.path.exists(os.path.join(model, "config.json")):
        raise FileNotFoundError(f"no config.json in model folder {model!r}")
    if load_format == "gguf":
        raise ValueError(f"load_format 'gguf' needs a .gguf file, got folder {model!r}")
    return "safetensors"


def load_hf_config(model: str, load_format: str) -> Any:
    """The model's transformers config (from config.json, or from GGUF metadata)."""
    if load_format == "gguf":
        from pagedllm.model.gguf_loader import load_gguf_config

        return load_gguf_config(model)
    from transformers import AutoConfig

    path = model if os.path.isdir(model) else os.path.dirname(model)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the model config in {path!r}: {e}") from e


def load_tokenizer(model_path: str, tokenizer_path: str | None, load_format: str) -> Any:
    """The HF tokenizer for a model (from the folder, or from GGUF metadata). None for a dummy
    model whose folder has no tokenizer (then prompts must be token ids)."""
    tok = tokenizer_path or model_path
    if load_format == "dummy" and tokenizer_path is None:
        folder = resolve_model_path(model_path, "dummy")
        if not any(
            os.path.exists(os.path.join(folder, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return None
        tok = folder
    if tok.endswith(".gguf") and os.path.isfile(tok):
        from pagedllm.model.gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(tok)
    from transformers import AutoTokenizer

    if not os.path.exists(tok):
        raise FileNotFoundError(f"tokenizer not found: {tok!r}")
    return AutoTokenizer.from_pretrained(tok, local_files_only=True)


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's *.safetensors files (sharded checkpoints included)."""
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(folder, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(model_config: Any, device: str) -> torch.nn.Module:
    """Instantiate the architecture on ``device`` in the configured dtype and load weights."""
    from pagedllm.model.registry import get_model_class

    hf = model_config.text_config
    cls = get_model_class(model_config.hf_config)
    dtype = model_config.torch_dtype
    with torch.device(device):
        model = cls(hf, dtype)
    fmt = model_config.load_format
    if fmt == "dummy":
        model.init_dummy_weights(model_config.seed)
    elif fmt == "gguf":
        from pagedllm.model.gguf_loader import iter_gguf_weights

        model.load_weights(iter_gguf_weights(model_config.model))
    else:
        model.load_weights(iter_safetensors(model_config.model))
    if device == "cpu":  # matmuls in oneDNN's weight layout (layers/linear.py, ops/cpu)
        for module in model.modules():
            pack = getattr(module, "pack_for_cpu", None)
            if pack is not None:
                pack()
    return model.eval()
