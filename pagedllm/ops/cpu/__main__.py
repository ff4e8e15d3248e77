"""``python -m pagedllm.ops.cpu``: build the CPU kernels now (scripts/setup.sh) and say where."""

import logging

from pagedllm.ops.cpu import build_dir, cpu_ops

logging.basicConfig(level=logging.INFO)
print("CPU kernels:", f"built in {build_dir()}" if cpu_ops() is not None else "not available")
