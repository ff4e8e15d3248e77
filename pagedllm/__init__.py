"""pagedllm: a paged-KV-cache LLM inference and serving engine."""

from __future__ import annotations

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):  # lazy: importing pagedllm must not import torch-heavy modules
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":
        from pagedllm.config import EngineArgs

        return EngineArgs
    raise AttributeError(name)
