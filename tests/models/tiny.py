"""Tiny random-weight models of each supported architecture, and HF greedy references."""

from __future__ import annotations

import json
import os

import torch

# A small byte-level tokenizer is enough for engine tests; we build one without downloads.
_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _config(arch: str):  # noqa: ANN202
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**_COMMON)
    if arch == "mistral":
        return tf.MistralConfig(**{**_COMMON, "sliding_window": 24})
    if arch == "qwen2":
        return tf.Qwen2Config(**{**_COMMON, "tie_word_embeddings": True})
    if arch == "qwen3":
        return tf.Qwen3Config(**{**_COMMON, "head_dim": 32})
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 4, "head_dim": 32, "tie_word_embeddings": True},
            sliding_window=12,
            query_pre_attn_scalar=24,
            layer_types=[
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "qwen3_moe":  # 8 experts, top-2, layer 1 dense (mlp_only_layers)
        return tf.Qwen3MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3, "head_dim": 32},
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        )  # fmt: skip
    if arch == "qwen2_moe":  # 8 experts, top-2, not renormalized, a gated shared expert
        return tf.Qwen2MoeConfig(
            **{**_COMMON, "tie_word_embeddings": False}, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
            use_sliding_window=False,
        )  # fmt: skip
    if arch == "mixtral":  # 4 experts, top-2
        return tf.MixtralConfig(**{**_COMMON, "sliding_window": None}, num_local_experts=4,
                                num_experts_per_tok=2)  # fmt: skip
    raise ValueError(arch)


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def make_tiny_model(arch: str, path: str, seed: int = 0, **overrides: object) -> str:
    """Save a random-weight model (float32 safetensors + a small tokenizer) to ``path``;
    ``overrides`` replace config fields (e.g. ``num_key_value_heads=1``)."""
    import transformers as tf

    torch.manual_seed(seed)
    config = _config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = getattr(tf, _MODEL_CLASSES[arch])(config)
    # Larger-than-default weights make the distribution peaky, so greedy choices are decisive
    # and a wrong kernel shows as different tokens, not as a tie broken differently.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path, config.vocab_size)
    return path


def _save_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges: one token per byte, plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {s: i for i, s in enumerate(specials)}
    for b in sorted(pre_tokenizers.ByteLevel.alphabet()):  # its order varies by call
        vocab[b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    assert len(vocab) <= vocab_size
    with open(os.path.join(path, "config.json")) as f:
        json.load(f)


def hf_greedy(
    path: str,
    prompts: list[list[int]],
    max_new_tokens: int,
    num_logprobs: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """HF transformers' greedy continuation of each prompt (one at a time, no padding), and
    the log-softmax of the logits at each generated position (computed in float32 from the
    logits of a ``dtype`` model)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # Never stop at EOS and never mask it (min_new_tokens would): pagedllm runs with ignore_eos.
    model.generation_config.eos_token_id = None
    tokens, logprobs = [], []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens.append(out.sequences[0, len(p) :].tolist())
        logprobs.append([lg[0].float().log_softmax(-1) for lg in out.logits])
    return tokens, logprobs


def make_perturbed_copy(path: str, out: str, noise: float, seed: int = 1) -> str:
    """A copy of the saved model at ``path`` with N(0, noise) added to every weight but the
    norms: a draft model for speculative decoding that agrees with the original on many
    greedy tokens, not all (same tokenizer, same shapes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    file = os.path.join(out, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if "norm" not in name:
            tensors[name] = t + noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, file, metadata={"format": "pt"})
    return out
