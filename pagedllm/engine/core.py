"""EngineCore: the loop of schedule -> execute -> update, with no tokenizer and no HTTP."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedllm.config import EngineConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.output import EngineCoreOutput, SchedulerOutput
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.dp_sync import DPStepSync
from pagedllm.lora.registry import LoRARegistry, make_lora_registry
from pagedllm.worker.executor import Executor, UniProcExecutor, make_executor
from pagedllm.worker.ubatch import ubatch_split

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagedllm.lora.request import LoRARequest
    from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

#: Steps in a row that may fail before the engine gives up (``EngineCore.step_failed``).
MAX_CONSECUTIVE_STEP_FAILURES = 3
#: Seconds between two readings of a mixture of experts' per-expert load (a device sync).
EXPERT_LOAD_PERIOD_S = 1.0


@dataclass
class StepFailure:
    """What ``EngineCore.step_failed`` did: the requests it ended (the ids their callers gave
    them), the error to report to them, and whether the engine is now dead (too many failed
    steps in a row, or the workers are broken): then every request must be failed."""

    request_ids: list[str]
    message: str
    dead: bool


class EngineCore:
    """Owns the scheduler and the executor (the model runner, in this process or in worker
    processes: ``parallel_config.distributed_executor_backend``).

    Each ``step()``: ``Scheduler.schedule()`` -> ``SchedulerOutput`` ->
    ``Executor.execute_model()`` -> ``ModelRunnerOutput`` -> ``Scheduler.update_from_output()``
    -> one ``EngineCoreOutput`` per request that produced something or finished. Only plain
    data crosses to the executor.
    """

    def __init__(
        self, config: EngineConfig, eos_token_ids: set[int] | None = None, tokenizer: object = None
    ) -> None:
        self.config = config
        self.dp_sync: DPStepSync | None = None
        self.executor: Executor = make_executor(config, eos_token_ids)
        try:
            executor = self.executor
            num_blocks = executor.determine_num_blocks()
            executor.initialize_kv_cache(num_blocks)
            executor.capture_cuda_graphs()
            num_host_blocks = executor.initialize_swap_space()
            swap_is_cheaper = executor.swap_is_cheaper()
            kv_groups = executor.kv_cache_groups()
            # (a KV connector may refuse the model here: the workers go down with it)
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                num_blocks,
                num_host_blocks,
                swap_is_cheaper=swap_is_cheaper,
                kv_groups=kv_groups,
                kvc_config=config.kvc_config,
                spec_config=config.speculative_config,
                kv_connectors=config.kv_connectors,
                context_parallel=config.parallel_config.decode_context_parallel_size,
                max_loras=config.lora_config.max_loras if config.lora_config else 0,
            )
            # LoRA adapters: loaded here, sent to the workers (None without enable_lora)
            self.loras = make_lora_registry(config, self.executor, self.scheduler)
            # expert parallelism over data-parallel cores: each step agreed with the others
            pc = config.parallel_config
            if pc.dp_expert_parallel:
                self.dp_sync = DPStepSync(
                    pc.data_parallel_rank,
                    pc.data_parallel_size,
                    "127.0.0.1",
                    pc.data_parallel_rpc_port,
                )
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_blocks = num_blocks
        self.num_steps = 0  # step() calls so far (the metrics' engine steps)
        self.step_seconds = 0.0  # wall time inside step() so far (the dashboard's step time)
        self.num_async_steps = 0  # of which asynchronous (async_scheduling, nothing forcing sync)
        # of those, the steps that took the last step's results before scheduling (a KV
        # connector asked: ``Scheduler.wants_results_first``)
        self.num_results_first = 0
        # failed steps since the last one that completed (see step_failed)
        self.consecutive_failures = 0
        self.max_consecutive_failures = MAX_CONSECUTIVE_STEP_FAILURES
        self.tokenizer = tokenizer
        self.async_scheduling = config.scheduler_config.async_scheduling
        # a mixture of experts' load per expert (``expert_load``), taken from the workers
        self._has_experts = True  # until the executor says the model has none
        self._expert_load: np.ndarray | None = None
        self._load_taken = 0.0
        # async scheduling: the launched step (its executor handle) whose results are not yet
        # applied
        self._pending: tuple[SchedulerOutput, Any] | None = None
        # the handle of the launched step whose sampling waits for the grammar step in flight
        self._grammar_step: Any = None
        if self.executor.device_type == "cuda":
            # Python's full collections walk every tracked object: after torch, Triton and a
            # model are loaded that is millions, a pause of tens of ms charged to whichever
            # step allocates next. Frozen objects are skipped (refcounting still frees them;
            # only cycles among them stay). vLLM does the same after start-up. On a CPU the
            # forward pass dwarfs the pauses, and test runs make many engines: not there.
            gc.collect()
            gc.freeze()

    @property
    def model_runner(self) -> ModelRunner:
        """The in-process model runner (tests and benchmarks look inside it); only the "uni"
        executor has one."""
        if not isinstance(self.executor, UniProcExecutor):
            raise RuntimeError(
                "engine_core.model_runner exists only with distributed_executor_backend='uni'; "
                f"this engine's runner is in worker processes ({type(self.executor).__name__})."
            )
        return self.executor.runner

    def structured_output_manager(self):  # noqa: ANN201
        """The grammar compiler and the grammars' matchers (in a worker process when
        ``grammar_process``), made on first use (xgrammar is an optional dependency)."""
        if self.scheduler.grammar_book.structured is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need a tokenizer.")
            try:
                import xgrammar  # noqa: F401

                from pagedllm.structured_output.compiler import StructuredOutputManager
                from pagedllm.structured_output.grammars import fill_threads, make_grammars
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ValueError("structured outputs need the 'xgrammar' package.") from e
            mc = self.config.model_config
            process = self.config.scheduler_config.grammar_process
            manager = StructuredOutputManager(
                self.tokenizer,
                mc.vocab_size,
                cache_key=f"{mc.tokenizer}|{mc.model}",
                serialize=process,
                max_whitespace=self.config.structured_outputs_config.max_whitespace,
            )
            spec = self.config.speculative_config
            # a row per position: with k drafts a request samples at 1 + k positions
            positions = 1 + spec.num_speculative_tokens if spec is not None else 1
            self.scheduler.grammar_book.grammars = make_grammars(
                process,
                manager,
                self.executor.max_num_reqs * positions,
                pin=self.executor.device_type == "cuda",
                fill_threads=fill_threads(),
            )
            self.scheduler.grammar_book.structured = manager
        return self.scheduler.grammar_book.structured

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it could never be served (nothing is queued then)."""
        so = request.sampling_params.structured_outputs
        if so is not None:
            if so.reasoning_end_token_id is not None and self.config.speculative_config:
                raise ValueError(
                    "structured_outputs.reasoning_end_token_id (structured outputs after "
                    "reasoning) is not supported with speculative decoding: drafts would cross "
                    "the end of the thinking unconstrained."
                )
            self.structured_output_manager()
        if request.lora_request is not None:  # its adapter, loaded now if it is not yet
            self._lora_registry().acquire(request.lora_request)
        self.scheduler.add_request(request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and list a LoRA adapter (``LoRARegistry.add``); False if already loaded.
        ValueError for a bad adapter (named in the message) or an engine without LoRA."""
        return self._lora_registry().add(lora_request)

    def remove_lora(self, lora: int | str) -> bool:
        """Unlist a LoRA adapter by id or name; False if none is listed so. Its weights go
        once no live request uses it."""
        return self._lora_registry().remove(lora)

    def list_loras(self) -> list[LoRARequest]:
        """The listed LoRA adapters, by id ([] without LoRA)."""
        return [] if self.loras is None else self.loras.list()

    def _lora_registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora.")
        return self.loras

    def add_beam_request(self, request: Request, params, eos_ids: set[int]) -> None:  # noqa: ANN001
        """Queue a beam search whose first beam is ``request``."""
        if self.config.kvc_config.enabled:
            raise ValueError("beam search is not supported with KV-Compress (enable_kvc).")
        if params.beam_width > self.config.scheduler_config.max_num_seqs:
            raise ValueError(
                f"beam_width ({params.beam_width}) is larger than max_num_seqs "
                f"({self.config.scheduler_config.max_num_seqs})."
            )
        if request.lora_request is not None:  # every beam runs with the search's adapter
            self._lora_registry().acquire(request.lora_request)
        self.scheduler.add_request(request)
        self.scheduler.beams.register(request, params, eos_ids)

    def abort_requests(self, request_ids: list[str] | str) -> None:
        """End requests now and free their blocks; unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests_stopped(self, request_ids: list[str]) -> None:
        """End requests that hit a stop string (found by the detokenizer)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self._pending is not None or self.scheduler.has_unfinished_requests()

    def step(self, after_launch: Callable[[], None] | None = None) -> list[EngineCoreOutput]:
        """Run one iteration; returns what changed.

        If it raises, the caller must call ``step_failed`` before anything else.

        ``after_launch`` (async scheduling): called once, after this iteration's step is
        queued on the device and before the wait for the previous step's tokens (a
        synchronous step: for its own tokens): the caller's own work that may overlap the
        device (``LLMEngine``'s deferred output processing). Not called when nothing was
        launched, nor for a step with structured requests (the caller then does that work
        itself, after the step). Synchronous steps (speculation, penalties, n > 1 while they
        live) overlap it too: what it finishes (a stop string) may be in the launched step,
        whose token for it is then dropped, as under async scheduling.

        Synchronous: schedule step N, run it, wait for its tokens, update. With
        ``async_scheduling``: schedule and launch step N, then wait for step N-1 (finished on
        the device by the time N is queued behind it) and update from it, so the host's work
        for N-1's results, the output processing and the scheduling of N+1 overlap the device
        running N. The price: a request that finishes at N-1 was also computed in N (its extra
        token is dropped). Requests that need their tokens on the host before their next
        forward pass (penalties, n > 1, beams: ``Request.needs_host_tokens``) switch the
        engine to synchronous steps while they live.

        Grammars (``Grammars``, in a worker process on GPUs): a step with structured requests
        queues its forward pass, then submits the grammar step - step N-1's tokens, then the
        bitmask of step N's structured requests - and its sampling waits for that. Async: the
        grammar step is submitted as soon as N-1's tokens reach the host and runs during the
        update, the caller's output processing and the scheduling of N+1; the next ``step()``
        collects it after that scheduling and queues step N's sampling before step N+1's
        forward pass (which reads N's tokens on the device). Sync: submitted and collected at
        once, the tokens of the last step going with the next step's grammar step.
        """
        if self.dp_sync is not None and not self.has_unfinished_requests():
            self._dp_agree(None)  # nothing here: the other cores' steps still need this one
            return []
        self.num_steps += 1
        t0 = time.perf_counter()
        if self.async_scheduling and not self.scheduler.needs_sync:
            self.num_async_steps += 1
            outputs = self._step_async(after_launch)
        else:
            outputs = self._step_sync(after_launch)
        self.step_seconds += time.perf_counter() - t0
        self.consecutive_failures = 0
        return outputs

    def step_failed(self, error: BaseException) -> StepFailure:
        """Recover from a ``step()`` that raised ``error``: the requests it may have left
        wrong end (``Scheduler.fail_in_flight``: the running ones, the swapped ones; those
        still waiting for their first step stay), the steps in flight are dropped, the
        workers forget every request (``Executor.reset_requests``) and the engine goes on.
        A second failed step in a row ends the waiting requests too (one of them may be what
        fails). After ``max_consecutive_failures`` failed steps in a row, or if the recovery
        itself fails (a broken executor), the engine is dead: the caller fails every request
        and stops."""
        self.consecutive_failures += 1
        message = f"the engine failed while running this request: {error!r}"
        dead = self.consecutive_failures >= self.max_consecutive_failures
        self._pending = None
        self._grammar_step = None
        ids: list[str] = []
        grammars = self.scheduler.grammar_book.grammars
        if grammars is not None and grammars.in_flight:
            try:
                grammars.collect()  # its step is lost; its requests' matchers go below
            except Exception:
                logger.exception("the grammar step of a failed step failed too")
        try:
            ids = self.scheduler.fail_in_flight(everything=self.consecutive_failures > 1)
            self.executor.reset_requests()
        except Exception:
            logger.exception("recovering from a failed step failed")
            dead = True
        if dead:  # every request goes
            ids += [i for i in self.request_ids() if i not in ids]
            if self.consecutive_failures >= self.max_consecutive_failures:
                message = (
                    f"the engine is dead: {self.consecutive_failures} steps failed in a row "
                    f"(the last: {error!r})"
                )
            else:
                message = f"the engine is dead: it could not recover from {error!r}"
        return StepFailure(ids, message, dead)

    def _step_sync(self, after_launch: Callable[[], None] | None) -> list[EngineCoreOutput]:
        outputs = self._resolve_pending()
        if not self.scheduler.has_unfinished_requests():
            return outputs
        scheduler_output = self.scheduler.schedule()
        executor = self.executor
        if self.dp_sync is not None:
            self._dp_agree(scheduler_output)
        if not scheduler_output.structured_requests:
            if after_launch is None:
                runner_output = executor.execute_model(scheduler_output)
            else:  # the caller's work runs while the device computes the step
                launched = executor.launch_step(scheduler_output)
                after_launch()
                runner_output = executor.resolve(launched)
        else:  # the grammar step's collect queues the sampling with its bitmask
            step = executor.launch_forward(scheduler_output)
            self._submit_grammars(step, scheduler_output.structured_requests)
            outputs += self._collect_grammars()
            runner_output = executor.resolve(step)
        return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self, after_launch: Callable[[], None] | None) -> list[EngineCoreOutput]:
        executor, scheduler = self.executor, self.scheduler
        outputs: list[EngineCoreOutput] = []
        if self._pending is not None and scheduler.wants_results_first():
            # e.g. step N-1's KV-Compress evictions free blocks step N wants: its results
            # first, as a synchronous step takes them
            self.num_results_first += 1
            outputs = self._resolve_pending()
        scheduler_output = scheduler.schedule() if scheduler.has_unfinished_requests() else None
        # step N-1's sampling, if it waited for its bitmask: queued before step N's forward,
        # which reads N-1's tokens on the device (collected after scheduling N, to give the
        # grammar step that much more time)
        outputs += self._collect_grammars()
        launched = None
        structured: list[int] = []
        if scheduler_output is not None:
            structured = scheduler_output.structured_requests
            if structured:  # its sampling waits for the grammar step's bitmask
                launched = (scheduler_output, executor.launch_forward(scheduler_output))
            else:
                launched = (scheduler_output, executor.launch_step(scheduler_output))
            if after_launch is not None and not structured:  # (a grammar step is pending:
                after_launch()  # no request may end before it is submitted)
        if self._pending is not None:
            last_output, last_step = self._pending
            self._pending = None
            runner_output = executor.resolve(last_step)
            if structured:
                # N-1's tokens to the grammars and N's bitmask, before the update: the
                # grammar step runs during the update and the caller's output processing
                scheduler.send_grammar_tokens(last_output, runner_output)
                self._submit_grammars(launched[1], structured)
            outputs += scheduler.update_from_output(last_output, runner_output)
        elif structured:
            self._submit_grammars(launched[1], structured)
        self._pending = launched
        return outputs

    def _dp_agree(self, scheduler_output: SchedulerOutput | None) -> None:
        """Expert parallelism over data-parallel cores: agree on this step with the other
        cores (``engine/dp_sync.py``) and give the step every core's token count; a core
        with no tokens of its own joins the MoE layers' exchanges. Once a core has stopped,
        a step with work raises RuntimeError (this core can no longer compute it: its
        experts are a part) and an idle one does nothing."""
        sync = self.dp_sync
        assert sync is not None
        so = scheduler_output
        n_sched = list(so.num_scheduled_tokens.values()) if so is not None else []
        mine = sum(n_sched)
        split, overlap = (mine, 0), False
        pc = self.config.parallel_config
        if pc.enable_dbo and mine > 0:  # micro-batches a and b (worker/ubatch.py)
            r = ubatch_split(n_sched)
            decode = all(n == 1 for n in n_sched)
            threshold = pc.dbo_decode_token_threshold if decode else pc.dbo_prefill_token_threshold
            overlap = r > 0 and mine >= threshold
            if overlap:
                split = (sum(n_sched[:r]), sum(n_sched[r:]))
        agreed = sync.agree(split, overlap)
        if sync.stopped and so is not None:
            raise RuntimeError(
                "another data-parallel engine core stopped: the experts it held are gone."
            )
        ub = (tuple(agreed.ubatches[0]), tuple(agreed.ubatches[1])) if agreed.ubatches else None
        if so is not None:
            so.dp_step_tokens = tuple(agreed.counts)
            so.dp_ubatch_tokens = ub
        if mine == 0 and any(agreed.counts):
            self.executor.execute_dp_idle(agreed.counts, ub)

    def dp_stop(self) -> None:
        """Tell the other data-parallel cores this one is leaving (a no-op without them)."""
        sync = self.dp_sync
        if sync is not None and not sync.stopped:
            try:
                sync.agree((0, 0), stopping=True)
            except Exception:  # a peer already gone: nothing to tell it
                logger.warning("data-parallel cores: the last agreement failed", exc_info=True)
            sync.stopped = True

    def _submit_grammars(self, step: Any, fill_ids: list[int]) -> None:
        """Start the grammar step whose bitmask ``step``'s sampling waits for."""
        self.scheduler.grammar_book.grammars.submit(fill_ids)
        self._grammar_step = step

    def _collect_grammars(self) -> list[EngineCoreOutput]:
        """Finish the grammar step in flight, if any: queue the sampling that waited for its
        bitmask, and end the requests whose token a grammar rejected."""
        grammars = self.scheduler.grammar_book.grammars
        if grammars is None or not grammars.in_flight:
            return []
        result = grammars.collect()
        step, self._grammar_step = self._grammar_step, None
        if step is not None:
            self.executor.launch_sample(step, result)
        return self.scheduler.apply_grammar_step(result)

    def _resolve_pending(self) -> list[EngineCoreOutput]:
        outputs = self._collect_grammars()
        if self._pending is None:
            return outputs
        scheduler_output, launched = self._pending
        self._pending = None
        runner_output = self.executor.resolve(launched)
        return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)

    def stats(self) -> dict[str, Any]:
        """The scheduler's counters and gauges (``Scheduler.make_stats``) plus the KV cache's
        free and total blocks: what the server's metrics read after each iteration."""
        stats: dict[str, Any] = dict(self.scheduler.make_stats())
        kv = self.scheduler.kv_cache_manager
        stats["num_free_blocks"] = kv.num_free_blocks()
        stats["num_blocks"] = kv.num_blocks
        stats["num_steps"] = self.num_steps
        stats["step_seconds"] = self.step_seconds
        stats["num_async_steps"] = self.num_async_steps
        stats["num_results_first"] = self.num_results_first
        if self._has_experts and time.monotonic() - self._load_taken >= EXPERT_LOAD_PERIOD_S:
            self.expert_load()
        if self._expert_load is not None:  # a mixture of experts: pairs per expert
            stats["moe_expert_pairs"] = self._expert_load.sum(axis=0).tolist()
        if self.dp_sync is not None:
            stats["dp_idle_steps"] = self.dp_sync.num_idle_steps
            stats["dbo_steps"] = self.dp_sync.num_overlapped_steps
        return stats

    def expert_load(self) -> np.ndarray | None:
        """The (token, expert) pairs each expert of each MoE layer has computed on this core
        since it started ``[layers, E]`` (padding rows not counted; under expert parallelism
        only this core's experts); None for a dense model. It waits for the device: the
        stats take it at most every ``EXPERT_LOAD_PERIOD_S``."""
        self._load_taken = time.monotonic()
        if not self._has_experts:
            return None
        load = self.executor.expert_load()
        if load is None:
            self._has_experts = False
            return None
        taken = np.asarray(load, dtype=np.int64)
        self._expert_load = taken if self._expert_load is None else self._expert_load + taken
        return self._expert_load

    def request_ids(self) -> list[str]:
        """The ids callers gave the requests in the scheduler (a request with n > 1 or a beam
        search counts once)."""
        return list(
            dict.fromkeys(r.parent_id or r.request_id for r in self.scheduler.requests.values())
        )

    def shutdown(self) -> None:
        """Stop the grammar worker process, if one runs, and the executor's workers (first
        telling the other data-parallel cores, if any, that this one is leaving)."""
        self.dp_stop()
        try:
            if self.scheduler.grammar_book.grammars is not None:
                self.scheduler.grammar_book.grammars.close()
        finally:
            self.executor.shutdown()

    def check_integrity(self) -> None:
        """KV cache invariants; when idle, every block is free."""
        kv = self.scheduler.kv_cache_manager
        kv.check_integrity()
        if not self.scheduler.has_unfinished_requests():
            assert kv.is_idle_clean(), "blocks leaked while idle"
