"""Executors: the one way ``EngineCore`` reaches the model, in this process or in workers.

``make_executor`` picks one by ``ParallelConfig.distributed_executor_backend`` (vLLM's names):
``"uni"`` (the default) runs one ``ModelRunner`` in the engine's process; ``"mp"`` runs one
worker process per rank (``multiproc_executor.py``, ``worker_proc.py``); ``"ray"`` one Ray
actor per rank, placed across the nodes of a Ray cluster (``ray_executor.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from pagedllm.config import EXECUTOR_BACKENDS, EngineConfig
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedllm.lora.peft_loader import LoRAWeights
    from pagedllm.structured_output.grammars import GrammarStep
    from pagedllm.worker.model_runner import ModelRunner


class Executor(ABC):
    """What the engine core asks of the model's workers: one per rank, each owning a
    ``ModelRunner``; the executor calls every worker and hands back rank 0's answer.

    The contract:

    - Only plain data crosses: ``SchedulerOutput`` in, ``ModelRunnerOutput`` out, a grammar
      step's bitmask in, numbers and ``kv_cache_groups()``' description out. Never the
      scheduler's ``Request`` objects; every argument and result pickles.
    - Start-up, in this order: ``determine_num_blocks`` (the minimum over workers; the
      profiling pass runs on every worker), ``initialize_kv_cache(num_blocks)`` with that
      number on every worker, ``capture_cuda_graphs``, ``initialize_swap_space``.
    - A step: ``launch_forward(so)`` returns a handle at once (the forward pass is queued),
      ``launch_sample(handle, grammar_step)`` queues its sampling (with the bitmask of the
      step's structured requests, or None), ``resolve(handle)`` waits for its tokens. Steps
      are launched and resolved in order; under async scheduling step N is launched (forward
      and sample) before step N-1 is resolved, so at most two are in flight. Each handle is
      resolved exactly once. ``launch_step(so)`` is the first two at once and
      ``execute_model(so)`` all three, for a step without structured requests.
    - Failures: a worker's exception comes back as a ``RuntimeError`` carrying its traceback;
      a worker that died raises a ``RuntimeError`` naming it (rank, pid, exit code) instead of
      waiting for it. After either the executor is broken: every later call raises. A step
      that failed otherwise (in the engine core, or a runner exception in this process) is
      followed by ``reset_requests()``: the workers forget every request and launched step.
    - ``shutdown()`` frees the workers (processes end); it is idempotent.
    """

    device_type: str  # "cuda" or "cpu": the workers' device
    max_num_reqs: int  # rows of each worker's persistent batch (max_num_seqs)

    @abstractmethod
    def kv_cache_groups(self) -> Any:
        """Plain data describing the KV cache's layer groups (``ModelRunner.kv_cache_groups``)."""

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """The KV cache's block count every worker can hold (the minimum over workers)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks on every worker."""

    @abstractmethod
    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs on every worker (a no-op off GPUs; with enforce_eager only
        KV-Compress's kernel warm-up)."""

    @abstractmethod
    def initialize_swap_space(self) -> int:
        """Allocate host blocks for swap preemption; their number."""

    @abstractmethod
    def swap_is_cheaper(self) -> bool:
        """The 'auto' preemption rule (``ModelRunner.swap_is_cheaper``)."""

    @abstractmethod
    def launch_forward(self, scheduler_output: SchedulerOutput) -> Any:
        """Queue a step's forward pass; returns its handle without waiting."""

    @abstractmethod
    def launch_sample(self, handle: Any, grammar_step: GrammarStep | None) -> None:
        """Queue the sampling of a launched step, with its grammar bitmask (or None)."""

    @abstractmethod
    def resolve(self, handle: Any) -> ModelRunnerOutput:
        """Wait for a launched step's tokens."""

    def launch_step(self, scheduler_output: SchedulerOutput) -> Any:
        """Queue a step without structured requests, its forward pass and its sampling (one
        message to each worker where they are processes); its handle."""
        handle = self.launch_forward(scheduler_output)
        self.launch_sample(handle, None)
        return handle

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run a step without structured requests to the end: forward, sample, resolve."""
        handle = self.launch_forward(scheduler_output)
        self.launch_sample(handle, None)
        return self.resolve(handle)

    @abstractmethod
    def reset_requests(self) -> None:
        """After a failed step: every worker forgets its requests and the steps it launched
        (``ModelRunner.reset_requests``); raises if the executor is broken."""

    @abstractmethod
    def execute_dp_idle(self, counts: list[int], ubatches: Any = None) -> None:
        """Expert parallelism over data-parallel cores, a step where this core has no tokens
        and another has: join each MoE layer's exchange (``ModelRunner.execute_dp_idle``;
        ``ubatches``: the micro-batches' counts under dual-batch overlap)."""

    @abstractmethod
    def expert_load(self) -> list[list[int]] | None:
        """The (token, expert) pairs each expert computed since the last call, per MoE
        layer ``[layers][E]``, over the ranks; None for a model without experts."""

    def add_lora(self, weights: LoRAWeights) -> None:
        """Send a LoRA adapter's tensors to every worker (``LoRAWorker.add``)."""
        self._lora_call("add", weights)

    def remove_lora(self, lora_int_id: int) -> None:
        """Drop a LoRA adapter on every worker (``LoRAWorker.remove``)."""
        self._lora_call("remove", lora_int_id)

    @abstractmethod
    def _lora_call(self, name: str, *args: Any) -> None:
        """Call the ``LoRAWorker`` method ``name`` on every worker."""

    def shutdown(self) -> None:  # noqa: B027 - an in-process executor holds nothing to free
        """Free the workers; safe to call twice."""


class UniProcExecutor(Executor):
    """One ``ModelRunner`` in the engine's process: the same calls as a bare runner (the
    handle is the runner's ``LaunchedStep``). ``runner`` is public for tests and
    benchmarks that look inside."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None) -> None:
        from pagedllm.worker.model_runner import ModelRunner

        if config.device_config.device == "cpu":  # --cpu-threads / --cpu-threads-bind
            from pagedllm.worker.cpu_threads import apply_cpu_threads, host_rank

            # (alone on the host and neither set: a no-op; a data-parallel core: its share)
            apply_cpu_threads(config.device_config, *host_rank(config.parallel_config, 0))
        self.runner: ModelRunner = ModelRunner(config, eos_token_ids)
        self.device_type = self.runner.device.type
        self.max_num_reqs = self.runner.input_batch.max_num_reqs

    # the runner's methods are looked up at each call, so that tests may wrap them
    def kv_cache_groups(self) -> Any:
        return self.runner.kv_cache_groups()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def initialize_swap_space(self) -> int:
        return self.runner.initialize_swap_space()

    def swap_is_cheaper(self) -> bool:
        return self.runner.swap_is_cheaper()

    def launch_forward(self, scheduler_output: SchedulerOutput) -> Any:
        return self.runner.launch_forward(scheduler_output)

    def launch_sample(self, handle: Any, grammar_step: GrammarStep | None) -> None:
        self.runner.launch_sample(handle, grammar_step)

    def resolve(self, handle: Any) -> ModelRunnerOutput:
        return self.runner.resolve(handle)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def reset_requests(self) -> None:
        self.runner.reset_requests()

    def execute_dp_idle(self, counts: list[int], ubatches: Any = None) -> None:
        self.runner.execute_dp_idle(counts, ubatches)

    def expert_load(self) -> list[list[int]] | None:
        return self.runner.expert_load()

    def _lora_call(self, name: str, *args: Any) -> None:
        getattr(self.runner.lora, name)(*args)


def plain_grammar(grammar_step: GrammarStep | None) -> tuple | None:
    """A grammar step as plain data for another process: (fill ids, a numpy copy of just the
    mask's rows - a tensor view would pickle its whole buffer), or None."""
    if grammar_step is None:
        return None
    mask = grammar_step.mask
    return grammar_step.fill_ids, None if mask is None else mask.numpy().copy()


class WorkerGroupExecutor(Executor):
    """An executor whose ranks run elsewhere (processes, Ray actors): its start-up calls go
    to every rank through ``_call`` (the ranks' replies, by rank) and rank 0's (or the
    minimum's, for sizes every rank must hold) answer comes back."""

    @abstractmethod
    def _call(self, name: str, *args: Any) -> list[Any]:
        """Call the runner method ``name`` on every rank; the replies, by rank."""

    def kv_cache_groups(self) -> Any:
        return self._call("kv_cache_groups")[0]

    def determine_num_blocks(self) -> int:
        return min(self._call("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def capture_cuda_graphs(self) -> None:
        self._call("capture_cuda_graphs")

    def initialize_swap_space(self) -> int:
        return min(self._call("initialize_swap_space"))

    def swap_is_cheaper(self) -> bool:
        return bool(self._call("swap_is_cheaper")[0])

    def execute_dp_idle(self, counts: list[int], ubatches: Any = None) -> None:
        self._call("execute_dp_idle", counts, ubatches)

    def _lora_call(self, name: str, *args: Any) -> None:
        self._call(f"lora.{name}", *args)

    def expert_load(self) -> list[list[int]] | None:
        """The ranks' counts summed (each counts only what it computed)."""
        loads = self._call("expert_load")
        if loads[0] is None:
            return None
        return [[sum(c) for c in zip(*layer)] for layer in zip(*loads)]


def make_executor(config: EngineConfig, eos_token_ids: set[int] | None = None) -> Executor:
    """The executor ``config.parallel_config.distributed_executor_backend`` names."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "uni":
        return UniProcExecutor(config, eos_token_ids)
    if backend == "mp":
        from pagedllm.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, eos_token_ids)
    if backend == "ray":
        from pagedllm.worker.ray_executor import RayExecutor

        return RayExecutor(config, eos_token_ids)
    raise ValueError(
        f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {backend!r}."
    )
