"""HF transformers peers on the GPU, on the same weights and prompts as pagedllm:
``generate_batch``-style continuous batching (its paged cache) and static-batch ``generate``."""

from __future__ import annotations

import time
from typing import Any

import torch


def load(model_dir: str, dtype: torch.dtype) -> Any:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None  # ignore EOS: fixed output lengths
    model.generation_config.pad_token_id = 0
    return model


def continuous_batching(model: Any, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """HF's continuous batching manager with a per-request max_new_tokens (falls back to
    ``generate_batch`` with the longest output for every request, counting only each request's
    own length, when this transformers has no per-request limit)."""
    import transformers as tf

    cfg = tf.GenerationConfig(max_new_tokens=max(out_lens), do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    mode = "manager"
    produced = 0
    try:
        mgr = model.init_continuous_batching(generation_config=cfg)
        mgr.start()
        for i, (p, n) in enumerate(zip(prompts, out_lens)):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        got = 0
        while got < len(prompts):
            r = mgr.get_result(timeout=600)
            if r is None:
                break
            got += 1
            produced += len(r.generated_tokens)
        mgr.stop(block=True)
    except (TypeError, AttributeError):
        mode = "generate_batch(max_new_tokens=max)"
        model.generate_batch(inputs=prompts, generation_config=cfg)
        produced = sum(out_lens)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    return {"engine": "hf_continuous_batching", "mode": mode, "elapsed_s": elapsed,
            "output_tokens": produced, "output_tokens_per_s": produced / elapsed,
            "total_tokens_per_s": (produced + sum(map(len, prompts))) / elapsed}


def static_generate(model: Any, prompts: list[list[int]], out_lens: list[int],
                    batch_size: int = 256) -> dict:
    """Static batches, left padded, each run to its longest output; only each request's own
    output length counts as useful tokens (what a static batcher delivers)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        chunk, outs = prompts[s : s + batch_size], out_lens[s : s + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.no_grad():
            model.generate(ids.cuda(), attention_mask=mask.cuda(), do_sample=False,
                           max_new_tokens=max(outs), min_new_tokens=max(outs), pad_token_id=0)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    useful = sum(out_lens)
    return {"engine": "hf_static_generate", "elapsed_s": elapsed, "output_tokens": useful,
            "output_tokens_per_s": useful / elapsed,
            "total_tokens_per_s": (useful + sum(map(len, prompts))) / elapsed}
