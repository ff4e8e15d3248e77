"""Loaded by every Python process whose PYTHONPATH starts with this folder (scale_out_gpu.py's
"no all-reduce" runs and their worker processes): the tensor-parallel all-reduce becomes the
identity, before the layers import it. The numbers are wrong; the schedule (``ignore_eos``,
fixed lengths) and every other kernel are the same, so the run's time minus the normal run's
is what the all-reduces cost inside the engine. A diagnostic, never for outputs."""

import importlib.util
import os
import sys

if os.environ.get("PAGEDLLM_BENCH_NO_ALLREDUCE") == "1":
    from pagedllm.distributed import parallel_state

    parallel_state.all_reduce = lambda x: x

# this file hides any other sitecustomize on the path: run the next one too
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d, "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _f)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
