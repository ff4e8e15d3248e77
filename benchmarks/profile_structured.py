"""Profile one JSON-constrained batch (host side) to see where structured-output time goes."""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_suite import make_hf_model  # noqa: E402
from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.structured_output.params import StructuredOutputsParams  # noqa: E402

if __name__ == "__main__":
    import torch

    path = make_hf_model("qwen3-0.6b", torch.bfloat16, "/tmp/qwen3_bfloat16")
    llm = LLM(path, tokenizer=os.environ["PAGEDLLM_TOKENIZER_DIR"], dtype="bfloat16",
              max_model_len=1024, gpu_memory_utilization=0.85)
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}},
              "required": ["text"]}
    prompts = [{"prompt_token_ids": list(range(1000 + i, 1064 + i))} for i in range(128)]
    for so in (None, StructuredOutputsParams(json=schema)):
        p = SamplingParams(temperature=1.0, seed=0, max_tokens=64, ignore_eos=True,
                           structured_outputs=so)
        llm.generate(prompts[:2], p, use_tqdm=False)
        pr = cProfile.Profile()
        pr.enable()
        t = time.perf_counter()
        llm.generate(prompts, p, use_tqdm=False)
        torch.cuda.synchronize()
        print("constrained" if so else "free", time.perf_counter() - t)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
