"""The model runner's side of LoRA: the adapters it holds, which adapter sits in which device
slot, and each step's token -> slot grouping.

The engine core sends every adapter's tensors once (``add``, whole, on the host; pinned on a
GPU) and drops them with ``remove``. Each step ``prepare`` (called by the input preparer with
the step's rows) puts the step's adapters into slots: one already in a slot stays there; a
missing one takes a slot no adapter of this step uses, an empty one first, else the least
recently used. The scheduler admits at most ``max_loras`` distinct adapters among the running
requests, so a step always fits. Every tensor-parallel rank sees the same steps and so makes
the same choices.

Loading a slot copies the adapter into the slot buffers in place (``LoRALayer.load``): the
copy waits for the device's queued work, so a step that changes slots costs a sync; steps
whose adapters are already in slots cost only the grouping.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from pagedllm.lora.batch import LoRABatch
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRALayer, attach_lora
from pagedllm.lora.peft_loader import LoRAWeights

logger = logging.getLogger(__name__)


class LoRAWorker:
    """A model's LoRA layers, its adapters on the host and its device slots (see the module
    docstring)."""

    def __init__(
        self, model: torch.nn.Module, config: LoRAConfig, max_num_tokens: int, device: torch.device
    ) -> None:
        self.config = config
        self.device = device
        self.batch = LoRABatch(config.max_loras, max_num_tokens, device)
        self.layers: dict[tuple, LoRALayer] = attach_lora(model, self.batch, config.slot_rank)
        self.adapters: dict[int, LoRAWeights] = {}
        self.slot_ids = [0] * config.max_loras  # the adapter in each slot (0: none)
        self._last_use = [0] * config.max_loras  # the step that last used each slot
        self._steps = 0

    # ---------------------------------------------------------------- adapters
    def add(self, weights: LoRAWeights) -> None:
        """Hold an adapter's tensors (pinned on a GPU, for the copies into slots)."""
        if self.device.type == "cuda":
            weights.modules = {
                k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in weights.modules.items()
            }
        old = self.adapters.get(weights.lora_int_id)
        self.adapters[weights.lora_int_id] = weights
        if old is not None:  # the same id loaded again: its slot holds the old tensors
            self._clear(weights.lora_int_id)

    def remove(self, lora_int_id: int) -> None:
        """Drop an adapter (its slot, if any, becomes free)."""
        self.adapters.pop(lora_int_id, None)
        self._clear(lora_int_id)

    def list(self) -> list[int]:
        """The ids of the adapters held."""
        return sorted(self.adapters)

    def _clear(self, lora_int_id: int) -> None:
        for slot, held in enumerate(self.slot_ids):
            if held == lora_int_id:
                self.slot_ids[slot] = 0

    # ---------------------------------------------------------------- steps
    def prepare(self, lora_ids: np.ndarray, n_sched: np.ndarray) -> None:
        """The step's requests' adapter ids ([R], 0: the base model) and token counts: put
        their adapters into slots and group the tokens by slot. Example (adapter 7 in slot 0):
        ids [7, 0, 7], n_sched [2, 1, 1] -> token slots [0, 0, -1, 0]."""
        self._steps += 1
        ids = np.asarray(lora_ids, dtype=np.int64)
        wanted = [int(i) for i in np.unique(ids) if i > 0]
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step with {len(wanted)} adapters; max_loras is {self.config.max_loras}"
            )
        slot_of = {held: s for s, held in enumerate(self.slot_ids) if held}
        for lora_id in wanted:
            if lora_id not in slot_of:
                slot_of[lora_id] = self._load(lora_id, wanted)
            self._last_use[slot_of[lora_id]] = self._steps
        row_slots = np.array([slot_of[int(i)] if i > 0 else -1 for i in ids], dtype=np.int64)
        self.batch.set(np.repeat(row_slots, n_sched))

    def _load(self, lora_id: int, wanted: list[int]) -> int:
        """Copy adapter ``lora_id`` into a slot no adapter of the step uses; that slot."""
        weights = self.adapters.get(lora_id)
        if weights is None:
            raise RuntimeError(f"LoRA adapter {lora_id} was never sent to this worker")
        free = [s for s, held in enumerate(self.slot_ids) if held not in wanted]
        slot = min(free, key=lambda s: (self.slot_ids[s] != 0, self._last_use[s]))
        for (layer_idx, _), layer in self.layers.items():
            layer.load(slot, weights, layer_idx)
        self.slot_ids[slot] = lora_id
        logger.debug("LoRA adapter %d (%s) in slot %d", lora_id, weights.lora_name, slot)
        return slot


def make_lora_worker(config: Any, model: torch.nn.Module, inputs: Any) -> LoRAWorker | None:
    """The runner's ``LoRAWorker`` when the engine has LoRA (None otherwise), hooked into its
    input preparer (``InputPreparer.lora``: each step's rows reach ``prepare``)."""
    lora_config = getattr(config, "lora_config", None)
    if lora_config is None:
        return None
    worker = LoRAWorker(
        model, lora_config, config.scheduler_config.max_num_batched_tokens, inputs.device
    )
    inputs.lora = worker
    return worker
