"""Loaded by every Python process whose PYTHONPATH starts with this folder (scale_out_gpu.py
puts it there for its ``--profile`` runs and its "no all-reduce" runs, and their worker
processes inherit it). Diagnostics, each on its own variable:

``PAGEDLLM_BENCH_NO_ALLREDUCE=1``: the tensor-parallel all-reduce becomes the identity, before
the layers import it. The numbers are wrong; the schedule (``ignore_eos``, fixed lengths) and
every other kernel are the same, so the run's time minus the normal run's is what the
all-reduces cost inside the engine. Never for outputs.

``PAGEDLLM_STEP_PROFILE=DIR``: each process that runs a ``ModelRunner`` (a worker of the
multiprocess executor) times its step methods (``launch_forward``, ``launch_sample``,
``resolve``) and, at exit, writes ``DIR/worker_r<rank>_<pid>.json``:

    events: [kind, start, seconds, wait, device] per call, ``start`` on time.monotonic()
            (one clock for every process of the host); ``wait`` the part of a "resolve" spent
            waiting for the step's tokens on the device; ``device`` that step's device time
            (CUDA events from the start of its forward pass to the end of its sampling)

With ``PAGEDLLM_STEP_PROFILE_AT=N`` rank 0 also runs torch.profiler over its forward passes
N .. N+19 and writes the kernels by device time to ``DIR/kernels_r0.txt``. The engine's
outputs are unchanged."""

import atexit
import importlib.util
import json
import os
import sys
import time


def _install(out_dir: str) -> None:
    # the runner's three step methods, not the worker's message loop: the worker module runs
    # as __main__ (python -m), so a copy imported here would not be the one that serves
    try:
        from pagedllm.worker import model_runner
    except ImportError:  # the checkout is not installed: the repository root, two levels up
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        from pagedllm.worker import model_runner
    from pagedllm.distributed.parallel_state import tp_info

    cls = model_runner.ModelRunner
    profile_at = int(os.environ.get("PAGEDLLM_STEP_PROFILE_AT", "0"))
    state: dict = {"events": [], "runner": None, "forwards": 0, "prof": None}

    def timed(kind: str, fn):  # noqa: ANN001, ANN202
        def method(self, step, *args):  # noqa: ANN001, ANN002, ANN202
            if state["runner"] is None:
                state["runner"] = self
                self.time_device, self.device_times = True, []
            if kind == "forward" and profile_at and tp_info()[0] == 0:
                _profiler_tick(state, profile_at, out_dir)
            t0 = time.monotonic()
            wait = 0.0
            if kind == "resolve" and step.event is not None:
                step.event.synchronize()
                wait = time.monotonic() - t0
            n_dev = len(self.device_times)
            reply = fn(self, step, *args)
            dt = time.monotonic() - t0
            dev = self.device_times
            device = dev[-1] if len(dev) > n_dev else None
            if len(dev) > 4096:  # keep memory flat; a step needs only the last value
                del dev[:-1]
            state["events"].append([kind, t0, dt, wait, device])
            return reply

        return method

    cls.launch_forward = timed("forward", cls.launch_forward)
    cls.launch_sample = timed("sample", cls.launch_sample)
    cls.resolve = timed("resolve", cls.resolve)

    def dump() -> None:
        if state["runner"] is None or not state["events"]:
            return
        if state["prof"] is not None:
            _profiler_stop(state, out_dir)
        rank = tp_info()[0]
        path = os.path.join(out_dir, f"worker_r{rank}_{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "events": state["events"]}, f)

    atexit.register(dump)


def _profiler_tick(state: dict, at: int, out_dir: str) -> None:
    state["forwards"] += 1
    n = state["forwards"]
    if n == at:
        from torch.profiler import ProfilerActivity, profile

        state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        state["prof"].start()
    elif n == at + 20 and state["prof"] is not None:
        _profiler_stop(state, out_dir)


def _profiler_stop(state: dict, out_dir: str) -> None:
    import torch

    prof, state["prof"] = state["prof"], None
    torch.cuda.synchronize()
    prof.stop()
    ka = prof.key_averages()
    with open(os.path.join(out_dir, "kernels_r0.txt"), "w") as f:
        f.write("20 forward passes of rank 0, by device time\n")
        f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=60))
        f.write("\nby host time\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if os.environ.get("PAGEDLLM_BENCH_NO_ALLREDUCE") == "1":
    from pagedllm.distributed import parallel_state

    parallel_state.all_reduce = lambda x: x

_dir = os.environ.get("PAGEDLLM_STEP_PROFILE")
if _dir:
    _install(_dir)

# this file hides any other sitecustomize on the path: run the next one too
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d, "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _f)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
