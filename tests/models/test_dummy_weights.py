"""``load_format="dummy"``: random weights of a realistic scale, the same for the same seed."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams


def _weights(path: str, seed: int) -> dict[str, torch.Tensor]:
    llm = LLM(path, load_format="dummy", dtype="float32", seed=seed, max_model_len=64)
    model = llm.llm_engine.engine_core.model_runner.model
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # fmt: skip
    assert len(out[0].outputs[0].token_ids) == 4
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dummy_weights_are_seeded_and_small(tiny_models, monkeypatch) -> None:  # noqa: ANN001
    # float32 on PyTorch's F.linear: the weights stay as loaded (not moved into oneDNN's
    # packed layout, which frees them), so they can be read back
    monkeypatch.setenv("PAGEDLLM_FLOAT32_EXACT", "1")
    path = tiny_models("llama")
    a, b, c = _weights(path, 0), _weights(path, 0), _weights(path, 1)
    for name, t in a.items():
        assert torch.equal(t, b[name]), name  # same seed, same weights
        if "norm" in name:
            assert torch.all(t == 1.0), name
            continue
        assert t.abs().max() <= 0.02 and t.std() > 0.005, name
        assert not torch.equal(t, c[name]), name  # another seed, other weights
