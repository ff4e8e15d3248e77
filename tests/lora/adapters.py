"""PEFT adapters made at test time on the tiny random models (tests/models/tiny.py), their
merged copies (``merge_and_unload``) and HF transformers + PEFT's greedy references."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: str,
    out: str,
    seed: int,
    targets: list[str],
    r: int = 8,
    alpha: float = 16,
    rslora: bool = False,
    std: float = 0.1,
) -> str:
    """A PEFT LoRA adapter of ``base`` saved to ``out``, with random A and B (PEFT starts B at
    zero: the adapter would change nothing)."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora
    )
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                torch.nn.init.normal_(p, 0.0, std)
    peft_model.save_pretrained(out)
    return out


def merged_copy(base: str, adapter: str, out: str) -> str:
    """The base model with the adapter merged into its weights, saved as a plain checkpoint
    (with the base's tokenizer)."""
    import transformers as tf
    from peft import PeftModel

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(base):
        if f.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(base, f), out)
    return out


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], n: int) -> list:
    """HF transformers' greedy continuations, through PEFT's LoRA layers (not merged)."""
    import transformers as tf
    from peft import PeftModel

    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            seq = model.generate(
                input_ids=torch.tensor([p]), max_new_tokens=n, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        outs.append(seq[0, len(p) :].tolist())
    return outs


def edit_config(adapter: str, out: str, **changes: object) -> str:
    """A copy of an adapter folder with ``adapter_config.json`` fields changed."""
    shutil.copytree(adapter, out)
    path = os.path.join(out, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return out


def prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    """Prompts of 5, 23 and 40 tokens (the last: 5 full blocks of 8)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=k).tolist() for k in (5, 23, 40)[:n]]


def tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def engine(path: str, **kw) -> LLM:  # noqa: ANN003
    """The tests' engine: float32, blocks of 8 tokens."""
    return LLM(path, dtype="float32", max_model_len=256, block_size=8, **kw)
