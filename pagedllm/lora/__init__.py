"""LoRA adapters (``--enable-lora``): PEFT checkpoints applied per request, several adapters
and the base model in one batch. Importing this package does not import torch:
``LoRARequest`` and ``LoRAConfig`` are plain dataclasses; the model side lives in
``layers.py``, ``worker.py`` and ``peft_loader.py``."""

from pagedllm.lora.config import LoRAConfig, LoRAModulePath
from pagedllm.lora.request import LoRARequest

__all__ = ["LoRAConfig", "LoRAModulePath", "LoRARequest"]
