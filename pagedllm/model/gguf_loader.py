"""Load a GGUF checkpoint: HF config, HF tokenizer and HF-named float32 weights.

The header (metadata and tensor table) is read by a small struct-based parser over a memory map,
using the ``gguf`` package's type tables; ``gguf.GGUFReader`` builds a numpy object per vocabulary
entry and takes ~10 s on Gemma-3's 262k-token vocabulary, this parser ~0.05 s. Tensor data is
dequantized one tensor at a time with ``gguf.quants.dequantize`` straight from the memory map.

llama.cpp's converter changes two things that are undone here: for ``llama`` files the Q/K rows
are permuted for its rotary layout (see ``reverse_permute``), and for ``gemma3`` every
``*norm.weight`` is stored as ``w + 1`` (HF Gemma stores ``w`` and computes ``x * (1 + w)``).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# Q/K rows permuted by llama.cpp's LlamaModel.permute. llama.cpp converts Mistral models to
# "llama" too; no llama.cpp writes a "mistral" file, and transformers leaves those unpermuted.
_PERMUTED_QK = ("llama",)
_MAX_KEPT_ARRAY = 1024  # longer metadata arrays (vocabularies, merges) are only counted

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip

# GGUF metadata key (after "<arch>.") -> HF config attribute, as transformers maps them.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "vocab_size": "vocab_size",
}  # fmt: skip
_ARCH_CONFIG_KEYS = {
    "llama": {"rope.dimension_count": "head_dim"},
    "mistral": {"rope.dimension_count": "head_dim"},
    "qwen2": {"attention.key_length": "head_dim"},
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
}
_TOKEN_ID_KEYS = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad"}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}  # fmt: skip
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_GEMMA3_BLOCK_TENSORS = {
    **_BLOCK_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",  # llama.cpp's gemma3 naming
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SKIPPED_TENSORS = ("rope_freqs.weight",)  # llama3 rope factors; HF derives them from the config


class _Counted(NamedTuple):
    """A long metadata array that was skipped over; only its length is kept."""

    count: int

    def __len__(self) -> int:
        return self.count


class _TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy/torch order (GGUF stores dimensions fastest-first)
    qtype: GGMLQuantizationType
    offset: int  # absolute file offset of the data
    nbytes: int


class _Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: tuple[_TensorInfo, ...]


def _invalid(path: str, reason: object) -> ValueError:
    return ValueError(f"{path} is not a valid GGUF file: {reason}")


def _check_path(path: str | os.PathLike[str]) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"expected a GGUF file, got a directory: {path}")
    return path


def _parse_header(path: str) -> _Header:
    """Parse metadata and the tensor table, checking every tensor lies inside the file."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def unpack(fmt: str) -> tuple[Any, ...]:
        nonlocal pos
        values = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return values

    def string() -> str:
        nonlocal pos
        (length,) = unpack("<Q")
        if pos + length > len(buf):
            raise ValueError("string runs past the end of the file")
        pos += length
        return bytes(buf[pos - length : pos]).decode("utf-8")

    def value(vtype: GGUFValueType) -> Any:
        nonlocal pos
        if vtype in _SCALAR_FORMATS:
            return unpack(_SCALAR_FORMATS[vtype])[0]
        if vtype == GGUFValueType.STRING:
            return string()
        if vtype != GGUFValueType.ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        etype, count = GGUFValueType(unpack("<I")[0]), unpack("<Q")[0]
        if etype == GGUFValueType.STRING and count > _MAX_KEPT_ARRAY:
            for _ in range(count):  # variable length: walk it without decoding
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
            if pos > len(buf):
                raise ValueError("string array runs past the end of the file")
            return _Counted(count)
        if etype in _SCALAR_FORMATS and count > _MAX_KEPT_ARRAY:
            pos += count * struct.calcsize(_SCALAR_FORMATS[etype])
            if pos > len(buf):
                raise ValueError("array runs past the end of the file")
            return _Counted(count)
        return [value(etype) for _ in range(count)]

    if len(buf) < 24 or unpack("<I")[0] != GGUF_MAGIC:
        raise ValueError("bad magic (expected b'GGUF')")
    version, n_tensors, n_kv = unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version}")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        metadata[key] = value(GGUFValueType(unpack("<I")[0]))
    entries = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = unpack("<I")
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = unpack(f"<{n_dims}Q")
        qtype, offset = GGMLQuantizationType(unpack("<I")[0]), unpack("<Q")[0]
        entries.append((name, dims, qtype, offset))
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"bad general.alignment {alignment!r}")
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors, seen = [], set()
    for name, dims, qtype, offset in entries:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if name in seen or dims[0] % block_size:
            raise ValueError(f"duplicate or malformed tensor {name!r}")
        seen.add(name)
        nbytes = math.prod(dims) // block_size * type_size
        if data_start + offset + nbytes > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        tensors.append(_TensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset, nbytes))
    return _Header(metadata, tuple(tensors))


@functools.lru_cache(maxsize=8)
def _cached_header(path: str, size: int, mtime_ns: int) -> _Header:
    try:
        return _parse_header(path)
    except (ValueError, struct.error, UnicodeDecodeError, KeyError, OverflowError) as exc:
        raise _invalid(path, exc) from exc


def _read(path: str | os.PathLike[str]) -> tuple[str, _Header, str]:
    """(path, header, architecture); raises for missing, invalid or unsupported files."""
    path = _check_path(path)
    stat = os.stat(path)
    header = _cached_header(path, stat.st_size, stat.st_mtime_ns)
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise _invalid(path, "no general.architecture in its metadata")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return path, header, arch


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The file's metadata key/values (long arrays such as the vocabulary only by length)."""
    return dict(_read(path)[1].metadata)


def load_gguf_config(path: str) -> PretrainedConfig:
    """The HF config of a GGUF model, as ``AutoConfig.from_pretrained(dir, gguf_file=name)``.

    Built from the metadata the same way transformers' GGUF loader does (its legacy path is
    ~20x slower on a 262k-token vocabulary). One deliberate difference: in ``qwen2``/``qwen3``
    files ``attention.key_length``, when present, sets ``head_dim`` (transformers ignores it and
    keeps the class default: none for Qwen2, 128 for Qwen3).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path, header, arch = _read(path)
    meta = header.metadata
    config: dict[str, Any] = {"model_type": "gemma3_text" if arch == "gemma3" else arch}
    if "general.name" in meta:
        config["_model_name_or_path"] = meta["general.name"]
    for key, attr in {**_CONFIG_KEYS, **_ARCH_CONFIG_KEYS[arch]}.items():
        if f"{arch}.{key}" in meta:
            config[attr] = meta[f"{arch}.{key}"]
    for key, attr in _TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[f"{attr}_token_id"] = meta[f"tokenizer.ggml.{key}_token_id"]
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def load_gguf_tokenizer(path: str) -> Any:
    """The HF tokenizer described by the GGUF metadata, with its chat template if the file has one.

    Equivalent to ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``: the same tokenizer class
    (the one registered for the model type, else ``TokenizersBackend``) built from the file, but
    without AutoTokenizer's slow config pass.
    """
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    model_type = load_gguf_config(path).model_type
    class_name = TOKENIZER_MAPPING_NAMES.get(model_type)
    tokenizer_class = tokenizer_class_from_name(class_name) if class_name else None
    if tokenizer_class is None:
        tokenizer_class = TokenizersBackend
    path = os.path.abspath(os.fspath(path))
    return tokenizer_class.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """HF checkpoint name of a GGUF tensor; None for tensors HF does not store."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    parts = stem.split(".")
    table = _GEMMA3_BLOCK_TENSORS if arch == "gemma3" else _BLOCK_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no known HF name for architecture {arch!r}")


def reverse_permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its ``LlamaModel.permute``) over ``n_head`` heads."""
    shape = weight.shape
    return (
        weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:])
        .transpose(1, 2)
        .reshape(shape)
    )


def iter_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF checkpoint name, float32 tensor)`` for every tensor, one at a time.

    Shapes follow HF (``[out_features, in_features]`` for linear layers). ``lm_head.weight`` is
    yielded only when the file has ``output.weight`` (otherwise it is tied to the embedding).
    All checks (file, header, names) run before the first tensor is yielded.
    """
    path, header, arch = _read(path)
    n_head = int(header.metadata.get(f"{arch}.attention.head_count", 0))
    n_kv_head = int(header.metadata.get(f"{arch}.attention.head_count_kv", n_head))
    names = [(info, _hf_name(info.name, arch)) for info in header.tensors]
    return _generate_weights(path, arch, names, n_head, n_kv_head)


def _generate_weights(
    path: str,
    arch: str,
    names: list[tuple[_TensorInfo, str | None]],
    n_head: int,
    n_kv_head: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    for info, hf_name in names:
        if hf_name is None:
            continue
        raw = buf[info.offset : info.offset + info.nbytes]
        row_bytes = info.nbytes // max(1, math.prod(info.shape[:-1]))
        try:
            array = dequantize(raw.reshape(*info.shape[:-1], row_bytes), info.qtype)
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"{path}: cannot dequantize {info.name} ({info.qtype.name})") from exc
        if array.dtype != np.float32 or not array.flags.writeable:
            array = array.astype(np.float32)  # copies out of the read-only memory map
        tensor = torch.from_numpy(array.reshape(info.shape))
        if arch in _PERMUTED_QK and info.name.endswith((".attn_q.weight", ".attn_q.bias")):
            tensor = reverse_permute(tensor, n_head).contiguous()
        elif arch in _PERMUTED_QK and info.name.endswith((".attn_k.weight", ".attn_k.bias")):
            tensor = reverse_permute(tensor, n_kv_head).contiguous()
        elif arch == "gemma3" and info.name.endswith("norm.weight"):
            tensor = tensor - 1.0
        yield hf_name, tensor
