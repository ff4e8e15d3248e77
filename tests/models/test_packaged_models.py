"""The real packaged models, loaded by pagedllm from their GGUF files: greedy tokens equal HF
transformers' greedy tokens on the same dequantized weights (16 tokens, a few prompts)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_loader import iter_gguf_weights, load_gguf_config

PROMPTS = {
    "smollm2": ["The capital of France is", "def fibonacci(n):", "Once upon a time,"],
    "gemma3": ["The capital of France is", "Water boils at", "1, 2, 3, 4,"],
}
NEW_TOKENS = 16  # per prompt; 32 cost the 2-core CI ~25 s more


def _path(name: str) -> str:
    from pagedllm.model import packaged

    try:
        return (
            packaged.smollm2_gguf_path() if name == "smollm2" else packaged.gemma3_270m_gguf_path()
        )
    except FileNotFoundError as e:  # the README's set-up installs both packages
        pytest.fail(str(e))


def _hf_reference(
    path: str, prompts_ids: list[list[int]], new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """HF's model class, built from the same config, holding the same dequantized weights
    (test_gguf_loader shows these equal transformers' own GGUF loading, tensor by tensor)."""
    import transformers as tf

    try:  # every weight is loaded below (the tied LM head too): skip the random init (~5 s)
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers
        no_init_weights = contextlib.nullcontext
    config = load_gguf_config(path)
    with no_init_weights():
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = dict(iter_gguf_weights(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    out = []
    for ids in prompts_ids:
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_gguf_greedy_equals_hf(name):
    path = _path(name)
    llm = LLM(path, dtype="float32", max_model_len=512)
    tok = llm.get_tokenizer()
    prompts_ids = [tok.encode(p) for p in PROMPTS[name]]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts_ids],
        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    got = [o.outputs[0].token_ids for o in outs]
    assert got == _hf_reference(path, prompts_ids)
    if name == "smollm2":
        chat = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(temperature=0, max_tokens=24),
            use_tqdm=False,
        )
        assert "Paris" in chat[0].outputs[0].text
        assert chat[0].outputs[0].finish_reason in ("stop", "length")
