"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter: ``lora_name`` (unique; what the OpenAI API calls the model),
    ``lora_int_id`` (unique, >= 1; the engine's key for it) and ``lora_path`` (a PEFT folder:
    ``adapter_config.json`` + ``adapter_model.safetensors``). ``base_model_name``: the model
    it was trained on, informational (the server lists it as the adapter's parent).

    Two requests with the same id must name the same adapter: the engine refuses a request
    whose id is registered under another name or path (``LoRARegistry``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}.")
        i = self.lora_int_id
        if isinstance(i, bool) or not isinstance(i, int) or i < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {i!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(
                f"lora_path of adapter {self.lora_name!r} must name a PEFT adapter folder."
            )

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of ``lora_name``."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of ``lora_path``."""
        return self.lora_path

    def cache_key(self) -> str:
        """What the prefix cache's block hashes carry for this adapter: two adapters never
        share KV blocks, requests of one adapter do (``core/kv_cache/hashing.py``)."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
