"""The Ray executor: the tensor-parallel ranks as Ray actors, on one host or several.

``--distributed-executor-backend ray`` runs each rank's ``Worker`` (``worker_proc.py``: a
``ModelRunner`` and its launched steps) in a Ray actor. The actors are placed by a placement
group of one bundle per rank ({"GPU": 1} on GPUs, {"CPU": 1} on CPUs), PACK strategy: on one
node while it has room, across nodes otherwise - the way to run a model wider than one host.
Rank 0's actor reports its node's IP and a free port there; the ranks join their
torch.distributed group through it (NCCL or gloo), exactly as the multiprocess executor's.

The cluster: ``ray.init(address=RAY_ADDRESS or "auto")`` joins a running cluster (``ray start
--head`` on one host, ``ray start --address=HEAD:PORT`` on the others); with none running, a
local one is started for this process. Ray is an optional dependency (``pip install ray``).

Calls: each step sends forward, sample and resolve to every actor (a caller's calls to one
actor run in order); resolve waits for every rank's reply, so an exception in any of the
three surfaces there as a ``RuntimeError`` naming the rank, and an actor that died (its
process killed, its node lost) as one naming the rank and saying so. Every wait wakes each
``_POLL_S`` and is bounded at start-up by ``PAGEDLLM_WORKER_START_TIMEOUT``.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.executor import WorkerGroupExecutor, plain_grammar
from pagedllm.worker.multiproc_executor import start_timeout

if TYPE_CHECKING:
    from pagedllm.structured_output.grammars import GrammarStep

_POLL_S = 1.0


class _RankActor:
    """The body of one rank's actor: a ``Worker`` built by ``init``."""

    def __init__(self) -> None:
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0: the ranks' store)."""
        import ray

        from pagedllm.utils.net import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def init(self, config: Any, eos: Any, rank: int, world: int, init_method: str) -> dict:
        import ray

        from pagedllm.worker.worker_proc import Worker

        self.worker = Worker(config, eos, rank, world, init_method)
        return {**self.worker.info(), "node": ray.get_runtime_context().get_node_id()}

    def handle(self, msg: tuple) -> Any:
        from pagedllm.worker.worker_proc import _NO_REPLY

        reply = self.worker.handle(msg)
        return None if reply is _NO_REPLY else reply


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError(
            "distributed_executor_backend 'ray' needs Ray: pip install ray (or pagedllm[ray])."
        ) from e
    return ray


class RayExecutor(WorkerGroupExecutor):
    """One Ray actor per tensor-parallel rank; rank 0's results come back (see the module
    docstring and ``Executor``)."""

    def __init__(self, config: EngineConfig, eos_token_ids: set[int] | None = None) -> None:
        ray = self._ray = _import_ray()
        self._actors: list[Any] = []
        self._pg: Any = None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or "auto"
            try:
                ray.init(address=address, log_to_driver=False)
            except ConnectionError:  # no cluster running: a local one for this process
                if address != "auto":
                    raise
                ray.init(log_to_driver=False)
        world = config.parallel_config.tensor_parallel_size
        gpu = config.device_config.device == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self._ids = itertools.count()
        self._broken: str | None = None
        self._pending: dict[int, list[Any]] = {}  # step id -> refs of its forward/sample
        timeout = start_timeout()
        try:
            self._pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
            try:
                ray.get(self._pg.ready(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"the Ray cluster has no room for {world} bundles of {bundle} within "
                    f"{timeout:g} s"
                ) from None
            actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RankActor)
            self._actors = [
                actor_cls.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank
                    )
                ).remote()
                for rank in range(world)
            ]
            host, port = ray.get(self._actors[0].address.remote(), timeout=timeout)
            init_method = f"tcp://{host}:{port}" if world > 1 else ""
            refs = [
                a.init.remote(config, eos_token_ids, rank, world, init_method)
                for rank, a in enumerate(self._actors)
            ]
            infos = self._get(refs, timeout)
        except BaseException:
            self.shutdown()
            raise
        self.nodes = [info["node"] for info in infos]  # each rank's Ray node id
        self.device_type: str = infos[0]["device_type"]
        self.max_num_reqs: int = infos[0]["max_num_reqs"]

    # ----------------------------------------------------------------- messages
    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"the executor is broken: {self._broken}")
        if not self._actors:
            raise RuntimeError("the executor was shut down")

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """Each ref's value, in order (ref i belongs to rank i mod world). Waits for all of
        them at once, so a rank that died or failed is reported at once even while another
        waits in a collective for it: RuntimeError naming it (the executor is then broken);
        the actor's death before any rank's failure."""
        ray = self._ray
        world = len(self._actors) or 1
        deadline = None if timeout is None else time.monotonic() + timeout
        waiting = list(refs)
        while waiting:
            done, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=_POLL_S)
            failures = []
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    failures.insert(0, (refs.index(ref) % world, "died", e))
                except ray.exceptions.RayTaskError as e:
                    failures.append((refs.index(ref) % world, "failed", e))
            if failures:
                rank, what, e = failures[0]
                self._broken = f"worker rank {rank} (a Ray actor) {what}"
                raise RuntimeError(f"{self._broken}:\n{e}")
            if waiting and deadline is not None and time.monotonic() > deadline:
                self._broken = f"a worker did not answer within {timeout:g} s"
                raise RuntimeError(self._broken)
        return ray.get(list(refs))

    def _each(self, name: str, *args: Any) -> list[Any]:
        """Call ``name`` on every actor; the refs, by rank."""
        self._check()
        return [getattr(a, name).remote(*args) for a in self._actors]

    def _call(self, name: str, *args: Any) -> list[Any]:
        return self._get(self._each("handle", ("call", name, args)))

    # ----------------------------------------------------------------- steps
    def launch_forward(self, scheduler_output: SchedulerOutput) -> int:
        step_id = next(self._ids)
        self._pending[step_id] = self._each("handle", ("forward", step_id, scheduler_output))
        return step_id

    def launch_sample(self, handle: int, grammar_step: GrammarStep | None) -> None:
        self._pending[handle] += self._each(
            "handle", ("sample", handle, plain_grammar(grammar_step))
        )

    def resolve(self, handle: int) -> ModelRunnerOutput:
        refs = self._pending.pop(handle, []) + self._each("handle", ("resolve", handle))
        return self._get(refs)[-len(self._actors)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._get(self._each("handle", ("execute", scheduler_output)))[0]

    def reset_requests(self) -> None:
        self._pending.clear()
        self._get(self._each("handle", ("reset",)))

    def shutdown(self) -> None:
        """Kill the actors and remove the placement group; safe to call twice."""
        actors, self._actors = self._actors, []
        ray = self._ray
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already gone
                pass
        pg, self._pg = self._pg, None
        if pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
