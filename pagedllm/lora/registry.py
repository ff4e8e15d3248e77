"""The engine core's adapters: which are known, loaded on the workers and listed.

``add`` reads an adapter from its PEFT folder (``peft_loader.py``: every check, a ValueError
naming the adapter and the problem), then sends its tensors to every worker
(``Executor.add_lora``). A request may name any adapter: one not loaded yet is loaded when
the request arrives (``acquire``), so a bad adapter fails that request alone.

``max_cpu_loras`` bounds the adapters kept loaded: loading one more first drops the least
recently used adapter that no live request uses (an adapter a request uses always stays;
the bound is then exceeded until those requests end). ``remove`` unlists an adapter at once;
its tensors leave the workers as soon as no live request uses it (checked at every later
call here).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.peft_loader import load_peft_adapter
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    """Adapters of one engine core (see the module docstring). ``in_use()`` returns the ids
    the live requests use (the scheduler's); ``executor`` reaches the workers."""

    def __init__(
        self,
        config: LoRAConfig,
        model_config: Any,
        executor: Any,
        in_use: Callable[[], Iterable[int]],
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.executor = executor
        self.in_use = in_use
        # loaded adapters, least recently used first
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()
        self.unlisted: set[int] = set()  # removed, still used by live requests

    def add(self, request: LoRARequest) -> bool:
        """Load and list an adapter; False if it is already loaded (the same name, id and
        path). ValueError for a bad adapter, or an id or name taken by another adapter."""
        self._check_type(request)
        known = self.loaded.get(request.lora_int_id)
        if known is not None and request.lora_int_id not in self.unlisted:
            self._check_same(known, request)
            self.loaded.move_to_end(request.lora_int_id)
            return False
        for other in self.loaded.values():
            if other.lora_name == request.lora_name and other.lora_int_id not in self.unlisted:
                raise ValueError(
                    f"lora_name {request.lora_name!r} is taken by adapter id "
                    f"{other.lora_int_id}; remove it first."
                )
        if known is not None:  # unlisted, still in use: listed again (same tensors)
            self._check_same(known, request)
            self.unlisted.discard(request.lora_int_id)
            self.loaded.move_to_end(request.lora_int_id)
            return True
        mc = self.model_config
        weights = load_peft_adapter(
            request, mc.text_config, self.config.max_lora_rank, mc.torch_dtype
        )
        self._make_room()
        self.executor.add_lora(weights)
        self.loaded[request.lora_int_id] = request
        logger.info(
            "LoRA adapter %r (id %d, rank %d, %d modules) loaded from %s",
            request.lora_name, request.lora_int_id, weights.rank, len(weights.modules),
            request.lora_path,
        )  # fmt: skip
        return True

    def acquire(self, request: LoRARequest) -> None:
        """Make sure a request's adapter is loaded (loading it if needed) before the request
        is queued; ValueError if it cannot be."""
        self._check_type(request)
        known = self.loaded.get(request.lora_int_id)
        if known is None:
            self.add(request)
            return
        self._check_same(known, request)
        self.loaded.move_to_end(request.lora_int_id)

    def remove(self, key: int | str) -> bool:
        """Unlist an adapter by id or name; False if no listed adapter has it. Its tensors
        stay on the workers while live requests use it."""
        lora_id = self._find(key)
        if lora_id is None:
            return False
        self.unlisted.add(lora_id)
        self._purge()
        return True

    def list(self) -> list[LoRARequest]:
        """The listed adapters, by id."""
        return [r for i, r in sorted(self.loaded.items()) if i not in self.unlisted]

    # ----------------------------------------------------------------- internals
    def _find(self, key: int | str) -> int | None:
        for i, r in self.loaded.items():
            if i not in self.unlisted and (key == i or key == r.lora_name):
                return i
        return None

    def _purge(self) -> None:
        """Drop unlisted adapters no live request uses any more."""
        used = set(self.in_use())
        for lora_id in [i for i in self.unlisted if i not in used]:
            self._drop(lora_id)

    def _make_room(self) -> None:
        """Drop unused adapters (unlisted ones, then the least recently used) until one more
        fits in ``max_cpu_loras``."""
        self._purge()
        used = set(self.in_use())
        for lora_id in list(self.loaded):
            if len(self.loaded) < int(self.config.max_cpu_loras or 1):
                return
            if lora_id not in used:
                logger.info("LoRA adapter %d dropped (max_cpu_loras)", lora_id)
                self._drop(lora_id)

    def _drop(self, lora_id: int) -> None:
        self.executor.remove_lora(lora_id)
        self.loaded.pop(lora_id, None)
        self.unlisted.discard(lora_id)

    @staticmethod
    def _check_type(request: Any) -> None:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}.")

    @staticmethod
    def _check_same(known: LoRARequest, request: LoRARequest) -> None:
        if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise ValueError(
                f"lora_int_id {request.lora_int_id} is adapter {known.lora_name!r} "
                f"({known.lora_path}); got {request.lora_name!r} ({request.lora_path})."
            )


def make_lora_registry(config: Any, executor: Any, scheduler: Any) -> LoRARegistry | None:
    """The engine core's registry when the engine has LoRA (None otherwise), with the
    ``lora_modules`` loaded (ids 1, 2, ... in order; a bad one is a ValueError at start-up).
    The adapters in use are those of the scheduler's live requests."""
    lora_config = getattr(config, "lora_config", None)
    if lora_config is None:
        return None
    requests = scheduler.requests

    def in_use() -> set[int]:
        return {r.lora_request.lora_int_id for r in requests.values() if r.lora_request}

    registry = LoRARegistry(lora_config, config.model_config, executor, in_use)
    for i, m in enumerate(lora_config.lora_modules, start=1):
        registry.add(LoRARequest(m.name, i, m.path, m.base_model_name))
    return registry
