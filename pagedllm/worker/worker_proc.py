"""A model worker process of the multiprocess executor (``multiproc_executor.py``).

Started as ``python -m pagedllm.worker.worker_proc FD``, FD being one end of a socket pair
(inherited) that carries pickled messages (``Channel``), so nothing of the engine's
``__main__`` is imported again. Messages in:
    ("init", config, eos_token_ids, rank, world_size, init_method)   first, once: joins the
                                 tensor-parallel group (world_size > 1), builds the ModelRunner
    ("call", name, args)         a runner method of ``CALLS`` (start-up, and the MoE calls
                                 between steps); replies
    ("forward", step_id, scheduler_output)    launch_forward; no reply
    ("sample", step_id, grammar)    launch_sample; grammar: None or (fill_ids, mask array)
    ("step", step_id, scheduler_output)    launch_forward, then launch_sample without a
                                 bitmask (a step without structured requests); no reply
    ("resolve", step_id)         replies with the ModelRunnerOutput (rank 0; others None)
    ("execute", scheduler_output)   forward + sample + resolve; replies likewise
    ("reset",)                   forget every request and launched step (a step failed); replies
Messages out: ("ok", result) for each message that replies (after "init": the runner's
device type, batch rows and pid); ("error", traceback) for any message that failed, sent
when it failed (a step that does not reply reports it before the next reply).
The process ends when the connection closes (the engine exited or shut it down); it ignores
SIGINT, which the engine handles.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from typing import Any

from pagedllm.utils.channel import Channel
from pagedllm.utils.child import child_channel

# the runner's methods the engine may call by name
CALLS = frozenset(
    {
        "kv_cache_groups",
        "determine_num_blocks",
        "initialize_kv_cache",
        "capture_cuda_graphs",
        "initialize_swap_space",
        "swap_is_cheaper",
        "execute_dp_idle",
        "expert_load",
        "lora.add",  # LoRA: an adapter's tensors to hold (``lora/worker.py``), and its removal
        "lora.remove",
    }
)

_NO_REPLY = object()


class Worker:
    """One rank's ``ModelRunner`` and the steps it launched and has not resolved, by id
    (under async scheduling step N is launched before step N-1 is resolved)."""

    def __init__(
        self,
        config: Any,
        eos_token_ids: set[int] | None,
        rank: int,
        world: int,
        init_method: str = "",
    ) -> None:
        import torch

        from pagedllm.distributed.parallel_state import (
            init_custom_all_reduce,
            init_decode_context_parallel,
            init_tensor_parallel,
            set_expert_parallel,
        )
        from pagedllm.worker.cpu_threads import apply_cpu_threads, host_rank
        from pagedllm.worker.model_runner import ModelRunner

        device = config.device_config.device
        if device.startswith("cuda") and world > 1:
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if not device.startswith("cuda"):  # the ranks (of every core) share the host's cores
            apply_cpu_threads(config.device_config, *host_rank(config.parallel_config, rank))
        init_tensor_parallel(
            rank, world, init_method, "cuda" if device.startswith("cuda") else "cpu"
        )
        init_decode_context_parallel(config.parallel_config.decode_context_parallel_size)
        set_expert_parallel(config.parallel_config.enable_expert_parallel)
        if device.startswith("cuda") and not config.parallel_config.disable_custom_all_reduce:
            init_custom_all_reduce(torch.device("cuda", torch.cuda.current_device()))
        self.rank = rank
        self.runner = ModelRunner(config, eos_token_ids)
        self.steps: dict[int, Any] = {}

    def info(self) -> dict:
        """What the executor learns once: the device type, the batch's rows, the pid."""
        return {
            "device_type": self.runner.device.type,
            "max_num_reqs": self.runner.input_batch.max_num_reqs,
            "pid": os.getpid(),
        }

    def handle(self, msg: tuple) -> Any:
        """Carry out one message; its reply, or ``_NO_REPLY``."""
        kind = msg[0]
        runner = self.runner
        if kind == "forward":
            self.steps[msg[1]] = runner.launch_forward(msg[2])
            return _NO_REPLY
        if kind == "step":
            step = runner.launch_forward(msg[2])
            self.steps[msg[1]] = step
            runner.launch_sample(step, None)
            return _NO_REPLY
        if kind == "sample":
            runner.launch_sample(self.steps[msg[1]], _grammar_step(msg[2]))
            return _NO_REPLY
        if kind == "resolve":
            out = runner.resolve(self.steps.pop(msg[1]))
            return out if self.rank == 0 else None
        if kind == "execute":
            out = runner.execute_model(msg[1])
            return out if self.rank == 0 else None
        if kind == "reset":
            self.steps.clear()
            runner.reset_requests()
            return None
        if kind == "call":
            if msg[1] not in CALLS:
                raise ValueError(f"not a worker call: {msg[1]!r}")
            target: Any = runner
            for part in msg[1].split("."):  # "lora.add": the runner's LoRA worker's method
                target = getattr(target, part)
            result = target(*msg[2])
            if msg[1] == "initialize_swap_space" and runner.device.type == "cuda":
                # the last start-up call: freeze the heap, as the engine core does (its
                # reason: a full collection's pause, here on every rank, between steps)
                gc.collect()
                gc.freeze()
            return result
        raise ValueError(f"unknown worker message {kind!r}")


def _grammar_step(grammar: tuple | None) -> Any:
    """The ``GrammarStep`` the runner's sampling reads, from its plain form."""
    if grammar is None:
        return None
    import torch

    from pagedllm.structured_output.grammars import GrammarStep

    fill_ids, mask = grammar
    return GrammarStep(fill_ids, None if mask is None else torch.from_numpy(mask))


def serve(conn: Channel) -> None:
    """The worker's loop (see the module docstring)."""
    try:
        kind, config, eos_token_ids, rank, world, init_method = conn.recv()
    except (EOFError, OSError):
        return
    assert kind == "init", kind
    try:
        worker = Worker(config, eos_token_ids, rank, world, init_method)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", worker.info()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply = worker.handle(msg)
        except Exception:
            reply = ("error", traceback.format_exc())
        else:
            if reply is _NO_REPLY:
                continue
            reply = ("ok", reply)
        try:
            conn.send(reply)
        except OSError:  # the engine is gone
            return


def main(argv: list[str]) -> None:
    """Entry point: serve the engine on the inherited socket ``argv[1]``."""
    serve(child_channel(argv))


if __name__ == "__main__":
    main(sys.argv)
