"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among the running
requests (the device's adapter slots, ``pagedllm/lora/worker.py``). A waiting request whose
adapter would be one too many waits, and requests behind it may go first (vLLM's rule);
requests of the base model or of an adapter already running are never held back."""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.request import Request


def lora_id_of(request: Request) -> int:
    """The request's adapter id (0: the base model)."""
    lr = request.lora_request
    return 0 if lr is None else lr.lora_int_id


class LoRAAdmission:
    """Answers "may this waiting request run now?" for LoRA (see the module docstring)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def fits(self, request: Request, running: Iterable[Request]) -> bool:
        """Whether admitting ``request`` keeps the running adapters within ``max_loras``.
        Example (max_loras 1, adapter 3 running): adapter 3 or the base model -> True,
        adapter 5 -> False."""
        lora_id = lora_id_of(request)
        if lora_id == 0 or not self.max_loras:  # (max_loras 0: an engine without LoRA)
            return True
        active = {lora_id_of(r) for r in running} - {0}
        return lora_id in active or len(active) < self.max_loras
