"""DPAsyncLLM: data parallelism behind one API server - N engine cores, one front end each.

``--data-parallel-size N`` starts N engine core processes (each an ``MPAsyncLLM``: its own
scheduler, KV cache and model, and its own tensor-parallel workers with
``--tensor-parallel-size``); this front end routes every request to one of them and merges
what the server needs (health, stats for ``/metrics``).

The routing rule (``DPRouter``), in order:

1. Prefix affinity. A request's key is its ``cache_salt`` and its first ``block_size``
   prompt tokens - the smallest prefix a core's prefix cache can reuse. A key seen before
   goes to the core that served it (that core holds its blocks), unless that core has
   ``AFFINITY_SLACK`` more unfinished requests than the least loaded one (then load wins and
   the key moves there). The table remembers the last ``AFFINITY_ENTRIES`` keys.
2. Load. Otherwise the live core with the fewest unfinished requests (the lowest index on a
   tie). Prompts shorter than one block carry no key.

Faults: a core that dies fails its own requests (``EngineDeadError`` in their streams, a 500
for each) and is reported (an error in the log; ``/health`` stays 200 while another core
serves, with ``dp_live_cores`` in the stats); new requests go to the live cores. With no
live core left ``is_running`` turns False and the ``on_dead`` callbacks run (the server
exits).

On GPUs core i sees GPUs [i * tp, (i + 1) * tp) (``CUDA_VISIBLE_DEVICES`` of its process).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from pagedllm.beam_search import BeamSearchParams
from pagedllm.config import EngineConfig
from pagedllm.engine.async_llm import (
    AsyncLLMBase,
    EngineDeadError,
    RequestStream,
    StatLogger,
    cache_salt_of,
)
from pagedllm.engine.mp_async_llm import MPAsyncLLM
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.utils.net import free_port

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 8  # unfinished requests a core may have above the least loaded one
AFFINITY_ENTRIES = 100_000


class DPRouter:
    """Picks the core of each request (see the module docstring for the rule)."""

    def __init__(self, num_cores: int, block_size: int) -> None:
        self.num_cores = num_cores
        self.block_size = block_size
        self._where: OrderedDict[tuple, int] = OrderedDict()  # key -> core, oldest first
        self.routed = [0] * num_cores  # requests sent to each core
        self.by_affinity = 0  # of which by prefix affinity

    def key(self, ids: list[int], salt: str | None) -> tuple | None:
        """The affinity key of a prompt; None when it is shorter than one block."""
        if len(ids) < self.block_size:
            return None
        return (salt, *ids[: self.block_size])

    def pick(self, key: tuple | None, loads: list[int], live: list[bool]) -> int:
        """The core for a request with ``key``, given each core's unfinished requests and
        whether it is alive. Example: loads [3, 12], key last served by core 1 -> core 1 if
        12 <= 3 + AFFINITY_SLACK, else core 0 (and the key moves to core 0)."""
        candidates = [i for i in range(self.num_cores) if live[i]]
        if not candidates:
            raise EngineDeadError("every engine core has stopped.")
        least = min(candidates, key=lambda i: (loads[i], i))
        core = least
        if key is not None:
            seen = self._where.get(key)
            if seen is not None and live[seen] and loads[seen] <= loads[least] + AFFINITY_SLACK:
                core = seen
                self.by_affinity += 1
            self._where[key] = core
            self._where.move_to_end(key)
            if len(self._where) > AFFINITY_ENTRIES:
                self._where.popitem(last=False)
        self.routed[core] += 1
        return core


def _core_env(config: EngineConfig, index: int) -> dict[str, str] | None:
    """The GPUs core ``index`` sees (None on a CPU: nothing to set)."""
    if config.device_config.device != "cuda":
        return None
    tp = config.parallel_config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    gpus = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    mine = gpus[index * tp : (index + 1) * tp]
    if len(mine) < tp:
        raise ValueError(
            f"data_parallel_size x tensor_parallel_size needs {tp * (index + 1)} GPUs or more; "
            f"{len(gpus)} are visible."
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


def _core_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each core's config: its data-parallel rank, and with expert parallelism the local
    ports of the cores' groups (``distributed/expert_parallel.py``, ``engine/dp_sync.py``)."""
    pc = config.parallel_config
    ports = {}
    if pc.dp_expert_parallel:
        master = free_port()
        rpc = free_port()
        while rpc == master:
            rpc = free_port()
        ports = {"data_parallel_master_port": master, "data_parallel_rpc_port": rpc}
    return [
        dataclasses.replace(
            config, parallel_config=dataclasses.replace(pc, data_parallel_rank=i, **ports)
        )
        for i in range(pc.data_parallel_size)
    ]


class DPAsyncLLM(AsyncLLMBase):
    """N ``MPAsyncLLM`` engine cores behind one front end (see the module docstring)."""

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None) -> None:
        n = config.parallel_config.data_parallel_size
        configs = _core_configs(config)
        # the cores start at once (each loads the model; with expert parallelism each waits
        # for the others to join the experts' group), from this thread: a core process dies
        # with the thread that started it (PR_SET_PDEATHSIG)
        cores: list[MPAsyncLLM] = []
        try:
            for i in range(n):
                cores.append(
                    MPAsyncLLM(configs[i], core_env=_core_env(config, i), defer_ready=True)
                )
            for core in cores:
                core.finish_start()
        except BaseException:
            # (no requests to finish: a core still starting, e.g. waiting for a peer that
            # failed, cannot read its stop message before its start ends; it is killed)
            for core in cores:
                core.shutdown(timeout=1.0)
            raise
        first = cores[0]
        super().__init__(config, first.tokenizer, first.input_processor, stat_loggers)
        self.cores = cores
        self.router = DPRouter(n, config.cache_config.block_size)
        self.num_blocks = sum(c.num_blocks for c in cores)
        self.token_capacity = min(c.token_capacity for c in cores)
        self.startup_seconds = max(c.startup_seconds for c in cores)
        self._core_stats: list[dict[str, Any]] = [dict(c.stats()) for c in cores]
        self._stats = self._merged()
        self._reported: set[int] = set()
        self.on_dead: list[Callable[[str], None]] = []
        for i, core in enumerate(cores):
            core.stat_loggers.append(self._logger_of(i))
            core.on_dead.append(self._core_died(i))

    @classmethod
    def from_engine_args(cls, args: Any, stat_loggers: list[StatLogger] | None = None) -> Any:
        """Start the N engine core processes (each loads the model: slow)."""
        return cls(args.create_engine_config(), stat_loggers)

    # ------------------------------------------------------------------ state
    @property
    def is_running(self) -> bool:
        """True while at least one core is alive and accepting work."""
        return any(c.is_running for c in self.cores)

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineDeadError("every engine core has stopped.")

    async def start(self) -> None:
        for core in self.cores:
            await core.start()

    async def call_in_cores(self, fn: Callable[[Any], Any]) -> list[Any]:
        return list(await asyncio.gather(*(c.call_in_core(fn) for c in self.cores)))

    def new_request_id(self, prefix: str = "req") -> str:
        self._ids += 1
        return f"{prefix}-dp-{self._ids}"

    def _core_died(self, index: int) -> Callable[[str], None]:
        def died(message: str) -> None:
            if index in self._reported:
                return
            self._reported.add(index)
            logger.error("engine core %d of %d stopped: %s", index, len(self.cores), message)
            if not self.is_running:
                for callback in self.on_dead:
                    callback(f"every engine core has stopped (the last: {message})")

        return died

    # ------------------------------------------------------------------ requests
    def loads(self) -> list[int]:
        """Unfinished requests of each core (the streams its front end still tracks)."""
        return [c.num_unfinished for c in self.cores]

    async def _queue(
        self,
        prompt: Any,
        text: str | None,
        ids: list[int],
        params: SamplingParams | BeamSearchParams,
        request_id: str | None,
        priority: int,
        output_kind: str,
        lora_request: Any = None,  # (LoRA is refused with data parallelism: config.py)
    ) -> RequestStream:
        self._check_running()
        rid = request_id or self.new_request_id()
        if any(c.has_request(rid) for c in self.cores):
            raise ValueError(f"request_id {rid!r} is already in use.")
        key = self.router.key(ids, cache_salt_of(prompt, params))
        live = [c.is_running for c in self.cores]
        index = self.router.pick(key, self.loads(), live)
        core = self.cores[index]
        stream = await core._queue(
            prompt, text, ids, params, rid, priority, output_kind, lora_request
        )
        if self.config.parallel_config.dp_expert_parallel:  # the others join its steps now
            for i, other in enumerate(self.cores):
                if i != index and other.is_running:
                    other.wake()
        return stream

    def abort_nowait(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for core in self.cores:
            mine = [r for r in ids if core.has_request(r)]
            if mine and core.is_running:
                core.abort_nowait(mine)

    def prepare_structured_outputs(self) -> concurrent.futures.Future[Any]:
        """Every core's grammar manager; resolves when all are ready."""
        futures = [c.prepare_structured_outputs() for c in self.cores if c.is_running]
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def check(_: Any) -> None:
            if done.done() or not all(f.done() for f in futures):
                return
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                done.set_exception(errors[0])
            else:
                done.set_result(None)

        for f in futures:
            f.add_done_callback(check)
        if not futures:
            done.set_exception(EngineDeadError("every engine core has stopped."))
        return done

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        for core in self.cores:  # the first live core compiles (and thereby checks) it
            if core.is_running:
                await core.check_structured_outputs(params)
                return
        raise EngineDeadError("every engine core has stopped.")

    # ------------------------------------------------------------------ stats
    def _logger_of(self, index: int) -> StatLogger:
        def log(stats: dict[str, Any], outputs: list[RequestOutput]) -> None:
            self._core_stats[index] = dict(stats)
            self._stats = self._merged()
            for log in self.stat_loggers:
                log(self._stats, outputs)

        return log

    def _merged(self) -> dict[str, Any]:
        """The cores' latest stats as one engine's: counts and counters summed (cumulative
        counters stay cumulative), the KV usage averaged, per-position lists summed."""
        merged: dict[str, Any] = {}
        for stats in self._core_stats:
            for key, value in stats.items():
                if isinstance(value, bool) or not isinstance(value, (int, float, list)):
                    merged.setdefault(key, value)
                elif isinstance(value, list):
                    have = merged.setdefault(key, [])
                    have.extend([0] * (len(value) - len(have)))
                    for j, v in enumerate(value):
                        have[j] += v
                else:
                    merged[key] = merged.get(key, 0) + value
        if "kv_cache_usage" in merged:
            merged["kv_cache_usage"] /= len(self._core_stats)
        merged["dp_requests_routed"] = list(self.router.routed)
        merged["dp_live_cores"] = sum(c.is_running for c in self.cores)
        return merged

    def stats(self) -> dict[str, Any]:
        self._stats = self._merged()
        return dict(self._stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        for core in self.cores:
            core.shutdown(timeout)
