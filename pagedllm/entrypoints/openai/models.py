"""The models a server answers to: the base model, and its LoRA adapters by name (vLLM's
``OpenAIServingModels``). A request's ``model`` picks one: the base model's served name, or an
adapter's name (its tokens then run with that adapter); any other name is a 404.

Adapters come from ``--lora-modules`` (ids 1, 2, ... as the engine loads them at start) and, at
run time, from ``POST /v1/load_lora_adapter`` / ``POST /v1/unload_lora_adapter``. Like vLLM,
those two routes exist only when ``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is set to a true value: they make the server read any
folder it can see. The table lives in each API server process; with several processes a
run-time load reaches only the process that served it (start-up adapters are in all).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any

from pagedllm.engine.async_llm import AsyncLLMBase
from pagedllm.entrypoints.openai.errors import RequestError
from pagedllm.lora.request import LoRARequest


def runtime_updates_allowed() -> bool:
    """True when the run-time adapter routes are switched on by the environment."""
    for var in ("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes"):
            return True
    return False


class ServingModels:
    """The base model's name and the adapters by name."""

    def __init__(self, llm: AsyncLLMBase, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name
        cfg = getattr(llm.config, "lora_config", None)
        self.lora_enabled = cfg is not None
        self.adapters: dict[str, LoRARequest] = {}
        for i, m in enumerate(cfg.lora_modules if cfg else (), start=1):
            self.adapters[m.name] = LoRARequest(m.name, i, m.path, m.base_model_name)
        self._ids = itertools.count(len(self.adapters) + 1)
        self._lock = asyncio.Lock()

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model, or no name given); 404 with
        vLLM's message for a name this server does not serve."""
        if model is None or model == self.model_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise RequestError(f"The model `{model}` does not exist.", param="model",
                               status_code=404, err_type="NotFoundError")  # fmt: skip
        return lora

    def cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``: the base model, then each adapter (parent: its base model)."""
        base = {"id": self.model_name, "object": "model", "created": created,
                "owned_by": "pagedllm", "root": self.model_name, "parent": None,
                "max_model_len": max_model_len}  # fmt: skip
        cards = [base]
        for name, lora in self.adapters.items():
            cards.append({**base, "id": name, "root": name,
                          "parent": lora.base_model_name or self.model_name})  # fmt: skip
        return cards

    def _check_enabled(self) -> None:
        if not self.lora_enabled:
            raise RequestError("LoRA adapters are not enabled: start the server with "
                               "--enable-lora.", param="lora_name")  # fmt: skip

    async def load(self, body: dict[str, Any]) -> str:
        """``POST /v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}``: 400 naming the
        field when the adapter cannot be loaded (the engine's message says why)."""
        self._check_enabled()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string.", param="lora_name")
        if not isinstance(path, str) or not path:
            raise RequestError("lora_path must be a non-empty string.", param="lora_path")
        async with self._lock:
            if name in self.adapters or name == self.model_name:
                raise RequestError(f"The lora adapter '{name}' has already been loaded.",
                                   param="lora_name")  # fmt: skip
            lora = LoRARequest(name, next(self._ids), path, body.get("base_model_name"))
            try:
                await self.llm.add_lora(lora)
            except ValueError as e:
                raise RequestError(str(e), param="lora_path") from e
            self.adapters[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, body: dict[str, Any]) -> str:
        """``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``: 404 if no such adapter.
        Requests already running with it finish with it."""
        self._check_enabled()
        name = body.get("lora_name")
        async with self._lock:
            lora = self.adapters.get(name) if isinstance(name, str) else None
            if lora is None:
                raise RequestError(f"The lora adapter '{name}' cannot be found.",
                                   param="lora_name", status_code=404,
                                   err_type="NotFoundError")  # fmt: skip
            await self.llm.remove_lora(lora.lora_int_id)
            del self.adapters[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
